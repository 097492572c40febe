"""The thread that runs model work, in arrival order, off the event loop.

Lighter than ThreadPoolExecutor + run_in_executor: one queue, one thread, and the
completion handled on this thread (the reply is sent from here), so a call costs at most
one thread hop, not two.

Given the engine socket, the thread also waits on it whenever it has nothing to do
(leader/follower): the next message is received here, and a call runs at once, with no
hop at all. While the thread works, the event loop receives, as it always does, so
health checks and the next steps are taken in while a long step runs.
"""

from __future__ import annotations

import logging
import select
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

from zmqworker.transport.async_socket import LEAD_CLOSED, LEAD_READY, AsyncSocket
from zmqworker.transport.wake_pipe import WakePipe

log = logging.getLogger("zmqworker.compute")

Done = Callable[[Any, BaseException | None], None]
Job = tuple[Callable[[], Any], Done]
# What the idle thread received -> the job to run on this thread now, or None when the
# message was handed elsewhere.
OnMessage = Callable[[list[zmq.Frame]], Job | None]


class ComputeThread:
    def __init__(
        self, name: str, sock: AsyncSocket | None = None, on_message: OnMessage | None = None
    ) -> None:
        """sock and on_message: wait on sock while idle, and hand what arrives to
        on_message (called on this thread)."""
        if (sock is None) != (on_message is None):
            raise ValueError("ComputeThread takes a socket and on_message together")
        self._sock = sock
        self._on_message = on_message
        self._jobs: deque[Job] = deque()
        self.busy_since: float | None = None  # time.monotonic() the running job started
        self._lock = threading.Lock()
        self._idle = False
        self._stopping = False
        self._wakes = WakePipe()
        self._poller_closed = select.poll()  # the wake-ups only
        self._poller_closed.register(self._wakes.fd, select.POLLIN)
        self._poller_leading = select.poll()  # the wake-ups and the socket
        self._poller_leading.register(self._wakes.fd, select.POLLIN)
        if sock is not None:
            self._poller_leading.register(sock.fd, select.POLLIN)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any], done: Done) -> None:
        """Run fn, then done(result, error), both on the compute thread."""
        with self._lock:
            self._jobs.append((fn, done))
            idle = self._idle
        if idle:
            self._wakes.wake()

    def stop(self) -> None:
        """Finish the queued work, then end the thread (does not wait for it)."""
        with self._lock:
            self._stopping = True
        self._wakes.wake()

    def join(self, timeout_s: float) -> bool:
        """Wait up to timeout_s for the thread to end after stop(); whether it did."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    job = self._jobs.popleft() if self._jobs else None
                    if job is None:
                        if self._stopping:
                            return
                        self._idle = True
                if job is None:
                    job = self._wait()
                if job is not None:
                    self._execute(*job)
        finally:
            self._wakes.close()

    def _wait(self) -> Job | None:
        """Sleep until there is work: a submitted job (picked up by the next round) or,
        when leading, a message on the socket (returned as the job it makes, if any)."""
        lead = LEAD_CLOSED if self._sock is None else self._sock.lead(self._wakes.wake)
        if lead != LEAD_READY:
            poller = self._poller_closed if lead == LEAD_CLOSED else self._poller_leading
            ready = poller.poll()
            if len(ready) > 1 or ready[0][0] == self._wakes.fd:
                self._wakes.drain()
        with self._lock:
            self._idle = False
        # Receive only with nothing queued: a job queued meanwhile came first.
        frames = None if lead == LEAD_CLOSED else self._sock.take(self._jobs)
        if frames is None:
            return None
        try:
            return self._on_message(frames)
        except Exception:  # the thread must outlive any one message
            log.exception("handling a message on the compute thread failed")
            return None

    def _execute(self, fn: Callable[[], Any], done: Done) -> None:
        self.busy_since = time.monotonic()
        try:
            result, error = fn(), None
        except BaseException as e:  # handed to done, which replies with it
            result, error = None, e
        finally:
            self.busy_since = None
        try:
            done(result, error)
        except Exception:  # the thread must outlive any one call
            log.exception("completing a call on the compute thread failed")
