"""Waking the engine thread that waits in a blocking receive on the ROUTER socket.

The thread that pumps the RpcClient's socket waits inside zmq's own receive, as a bare
pyzmq ping-pong does: no poll of its own around it and no look at the socket's events
between replies (together about a sixth of a 4-worker no-op round trip on 2 cores).
Whatever else must wake it arrives as a message on that same socket: an empty frame from
an inproc DEALER connected beside the workers, sent by a thread that wants the socket
while it is pumped, and by a thread that watches the workers' death signals (pidfds).
"""

from __future__ import annotations

import logging
import select
import threading
from collections.abc import Callable

import zmq

from zmqworker.transport.frames import NOBLOCK
from zmqworker.transport.wake_pipe import WakePipe

log = logging.getLogger("zmqworker.executor")

NUDGE_IDENTITY = b"zmqworker-nudge"  # its ROUTER identity; workers' are zmq's own (\0...)


class Nudger:
    def __init__(
        self, router: zmq.Socket, death_fds: dict[int, int], on_death: Callable[[int], None]
    ) -> None:
        """death_fds: fd -> rank, readable once that rank died; on_death(rank) is called
        (on the watching thread) before the nudge that follows it."""
        address = f"inproc://zmqworker-nudge-{id(self):x}"
        router.bind(address)
        self._sock = router.context.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTING_ID, NUDGE_IDENTITY)
        self._sock.connect(address)
        self._lock = threading.Lock()  # a zmq socket is not thread-safe
        self._closed = False
        self._stop = WakePipe()
        self._thread: threading.Thread | None = None
        if death_fds:
            self._thread = threading.Thread(
                target=self._watch,
                args=(dict(death_fds), on_death),
                name="rpc-deaths",
                daemon=True,
            )
            self._thread.start()

    def nudge(self) -> None:
        """Wake the thread blocked in the ROUTER's receive (if none is, the next one to
        receive finds the nudge and passes over it)."""
        with self._lock:
            if self._closed:
                return
            try:
                self._sock.send(b"", NOBLOCK)
            except zmq.Again:  # its queue is full of nudges already: one is enough
                return

    def close(self) -> None:
        """Stop watching (before the watched fds are closed) and close the DEALER."""
        self._stop.wake()
        if self._thread is not None:
            self._thread.join()
        self._stop.close()
        with self._lock:
            self._closed = True
            self._sock.close(linger=0)

    def _watch(self, fds: dict[int, int], on_death: Callable[[int], None]) -> None:
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        poller.register(self._stop.fd, select.POLLIN)
        while fds:
            for fd, _ in poller.poll():
                if fd == self._stop.fd:
                    return
                poller.unregister(fd)
                try:
                    on_death(fds.pop(fd))
                except Exception:  # the watch must go on for the other ranks
                    log.exception("reporting a worker's death failed")
            self.nudge()
