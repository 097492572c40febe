"""Which producers a decode rank reads through shared memory: those of its host (by boot
id, which the pull names and the producer compares with its own), unless this host's
/proc does not show them (another pid namespace on the same host), which is decided per
producer address, never for the whole puller.

A memfd the answer names that cannot be opened means one of two things: the producer is
not visible here, or it closed the memfd before the open (its staging expired or was
withdrawn). Once a producer's memfd was opened here, /proc shows it: the staging is
gone, and that load alone fails. Before that, the two cannot be told apart (in another
pid namespace its pid may be a process of this one): that producer's bytes come over
tcp from then on.
"""

from __future__ import annotations

from zmqworker.transport.host import boot_id


class SameHost:
    def __init__(self, shm: bool) -> None:
        """shm: whether this rank reads producers of its host through shared memory."""
        self._host_id = boot_id() if shm else ""
        self._apart: set[str] = set()  # producers whose memfds /proc does not show here
        self._opened: set[str] = set()  # producers whose memfds were opened here

    def host_id(self, address: str) -> str:
        """What pulls from address name as this host ("": send the bytes over tcp)."""
        return "" if address in self._apart else self._host_id

    def opened(self, address: str) -> None:
        """A memfd of address's was opened here: /proc shows that producer."""
        self._opened.add(address)

    def cannot_open(self, address: str, error: Exception) -> str | None:
        """A memfd of address's could not be opened (error): the load's error where its
        staging is gone, else None (address is read over tcp from now on: ask again)."""
        if address in self._opened:
            return (
                f"the memfd holding its staging is gone ({error}): it expired or was "
                "withdrawn before it was read"
            )
        self._apart.add(address)
        return None
