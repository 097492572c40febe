"""The puller's sockets, owned by its thread: a CURVE DEALER (the deployment's KV keys)
for each connection to each prefill address, the first for every message but the parts
of a split pull (tcp_parts.py), all in one context whose TCP_STREAMS I/O threads run the
connections' CURVE side by side, each registered in the puller's poller.

A send never blocks: to a peer that takes nothing (dead, unreachable) messages queue up
to the socket's SNDHWM, and a blocking send would then hold the thread, and every pull's
timeout with it. A message that cannot go, or an address that cannot be connected,
raises PeerSendError, its address's sockets closed (their queue with them). An address's
sockets are closed too once no pull to it waits and it has been idle IDLE_CLOSE_S (a
prefill restarted on a new port leaves its old one behind), and at most MAX_PEERS
addresses are open at once: a new one closes the one idle longest.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterator

import zmq

from messages.kv_peer import KVPeerMessage
from zmqworker.kv_transfer import wire
from zmqworker.kv_transfer.tcp_parts import TCP_STREAMS
from zmqworker.transport.curve import KVKeys
from zmqworker.transport.frames import NOBLOCK, send_frames

IDLE_CLOSE_S = 30.0
MAX_PEERS = 64


class PeerSendError(RuntimeError):
    """A message could not go to a prefill address: its sockets are closed."""


def address_error(address: str) -> str | None:
    """Why a puller cannot connect to address (None: it can try): a tcp address needs a
    host and a port in 1..65535, an ipc one a path."""
    scheme, sep, rest = address.partition("://")
    if sep and scheme == "ipc" and rest:
        return None
    if not sep or scheme != "tcp":
        return f"{address!r} is not a tcp://host:port (or ipc://path) address"
    host, colon, port = rest.rpartition(":")
    if not colon or not host or host == "*":
        return f"{address!r} lacks a host or a port (tcp://host:port)"
    if not port.isdigit() or not 0 < int(port) < 65536:
        return f"{address!r} has no port in 1..65535"
    return None


class PeerSockets:
    def __init__(
        self, keys: KVKeys | None, poller: zmq.Poller, busy: Callable[[], Collection[str]]
    ) -> None:
        """busy(): the addresses that pulls wait on (their sockets stay open)."""
        self._keys = keys
        self._ctx = zmq.Context(io_threads=TCP_STREAMS)
        self._socks: dict[str, dict[int, zmq.Socket]] = {}  # by address, then connection
        self._used: dict[str, float] = {}  # when each address last sent or received
        self._poller = poller
        self._busy = busy

    @property
    def addresses(self) -> list[str]:
        """The addresses with sockets open."""
        return list(self._socks)

    @property
    def num_sockets(self) -> int:
        """The sockets open, over all addresses (connections)."""
        return sum(len(conns) for conns in list(self._socks.values()))

    def send(self, address: str, msg: KVPeerMessage, connection: int = 0) -> None:
        """msg to address over that connection (made on first use), without blocking;
        PeerSendError, the address's sockets closed, where it cannot go."""
        try:
            send_frames(self._socket(address, connection), [wire.encode(msg)], NOBLOCK)
        except zmq.Again:
            self.close_address(address)
            raise PeerSendError(
                f"the prefill at {address} takes no more messages (unreachable, or not "
                "reading): its queue is full"
            ) from None
        except zmq.ZMQError as e:
            self.close_address(address)
            raise PeerSendError(f"cannot send to the prefill at {address}: {e}") from e
        self._used[address] = time.monotonic()

    def readable(self, events: dict) -> Iterator[tuple[str, zmq.Socket]]:
        """(address, socket) of each open socket the poll's events say has messages."""
        for address, conns in list(self._socks.items()):  # the caller may send, or close
            for sock in list(conns.values()):
                if events.get(sock) and not sock.closed:
                    self._used[address] = time.monotonic()
                    yield address, sock

    def close_idle(self) -> None:
        """Close the sockets of each address no pull waits on, idle IDLE_CLOSE_S."""
        cutoff = time.monotonic() - IDLE_CLOSE_S
        idle = [address for address, used in self._used.items() if used <= cutoff]
        if idle:
            busy = set(self._busy())
            for address in idle:
                if address not in busy:
                    self.close_address(address)

    def close_address(self, address: str) -> None:
        self._used.pop(address, None)
        for sock in self._socks.pop(address, {}).values():
            self._poller.unregister(sock)
            sock.close(linger=0)

    def close(self) -> None:
        for address in list(self._socks):
            self.close_address(address)
        self._ctx.term()

    def _socket(self, address: str, connection: int) -> zmq.Socket:
        conns = self._socks.get(address)
        if conns is None:
            self._make_room(address)
            conns = self._socks[address] = {}
            self._used[address] = time.monotonic()
        sock = conns.get(connection)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.linger = 0
            try:
                if self._keys is not None:
                    self._keys.make_client(sock)
                sock.connect(address)
            except BaseException:
                sock.close(linger=0)
                raise
            self._poller.register(sock, zmq.POLLIN)
            conns[connection] = sock
        return sock

    def _make_room(self, address: str) -> None:
        """Close the address idle longest where MAX_PEERS are open (PeerSendError where
        pulls wait on all of them)."""
        if len(self._socks) < MAX_PEERS:
            return
        busy = set(self._busy())
        idle = [a for a in self._socks if a not in busy]
        if not idle:
            raise PeerSendError(
                f"pulls wait on all {MAX_PEERS} prefill addresses open here: none for {address}"
            )
        self.close_address(min(idle, key=lambda a: self._used.get(a, 0.0)))
