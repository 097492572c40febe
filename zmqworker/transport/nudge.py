"""Waking the engine thread that waits in a blocking receive on the ROUTER socket.

The thread that pumps the RpcClient's socket waits inside zmq's own receive, as a bare
pyzmq ping-pong does: no poll of its own around it and no look at the socket's events
between replies (together about a sixth of a 4-worker no-op round trip on 2 cores).
Whatever else must wake it arrives as a message on that same socket: an empty frame from
an inproc DEALER connected beside the workers, sent by a thread that wants the socket
while it is pumped, and by a thread that watches the workers' death signals (pidfds) and
the ROUTER's monitor (a peer disconnected: its heartbeats stopped, or it went away).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from zmqworker.transport.frames import NOBLOCK
from zmqworker.transport.wake_pipe import WakePipe

log = logging.getLogger("zmqworker.executor")

NUDGE_IDENTITY = b"zmqworker-nudge"  # its ROUTER identity; workers' are zmq's own (\0...)


class Nudger:
    def __init__(
        self,
        router: zmq.Socket,
        death_fds: dict[int, int],
        on_death: Callable[[int], None],
        on_disconnect: Callable[[], None] | None = None,
    ) -> None:
        """death_fds: fd -> rank, readable once that rank died; on_death(rank) is called
        (on the watching thread) before the nudge that follows it. on_disconnect: called
        likewise when a peer of the ROUTER disconnects (its monitor says so)."""
        address = f"inproc://zmqworker-nudge-{id(self):x}"
        router.bind(address)
        self._sock = router.context.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTING_ID, NUDGE_IDENTITY)
        self._sock.connect(address)
        self._lock = threading.Lock()  # a zmq socket is not thread-safe
        self._closed = False
        self._stop = WakePipe()
        self._monitor = None
        if on_disconnect is not None:
            self._monitor = router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._thread: threading.Thread | None = None
        if death_fds or self._monitor is not None:
            self._thread = threading.Thread(
                target=self._watch,
                args=(dict(death_fds), on_death, on_disconnect),
                name="rpc-watch",
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

    def close(self, router: zmq.Socket) -> None:
        """Stop watching (before the watched fds are closed), close the DEALER and the
        ROUTER's monitor."""
        self._stop.wake()
        if self._thread is not None:
            self._thread.join()
        self._stop.close()
        with self._lock:
            self._closed = True
            self._sock.close(linger=0)
        if self._monitor is not None:
            router.disable_monitor()
            self._monitor.close(linger=0)

    def _watch(
        self,
        fds: dict[int, int],
        on_death: Callable[[int], None],
        on_disconnect: Callable[[], None] | None,
    ) -> None:
        poller = zmq.Poller()
        for fd in fds:
            poller.register(fd, zmq.POLLIN)
        poller.register(self._stop.fd, zmq.POLLIN)
        if self._monitor is not None:
            poller.register(self._monitor, zmq.POLLIN)
        while True:
            for what, _ in poller.poll():
                if what == self._stop.fd:
                    return
                try:
                    if what is self._monitor:
                        event = recv_monitor_message(self._monitor)
                        if event["event"] == zmq.EVENT_DISCONNECTED and on_disconnect:
                            on_disconnect()
                    else:
                        poller.unregister(what)
                        on_death(fds.pop(what))
                except Exception:  # the watch must go on for the other ranks
                    log.exception("reporting a worker's death failed")
            self.nudge()
