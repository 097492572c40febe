"""A zmq socket driven by an asyncio loop through its file descriptor.

Each mechanism here is there for a measured reason (docs/cuda.md has the figures):
- The loop watches the socket's FD (add_reader, then receives until EAGAIN, in turns of
  MAX_PER_TURN messages) instead of using zmq.asyncio, which takes about twice as long a
  round trip.
- Any thread may send (send_threadsafe), under a lock (zmq lets a socket move between
  threads behind a full memory barrier), so that the compute thread replies without a hop
  back through the loop (a thread wake-up costs tens of microseconds).
- The FD is edge-triggered and also signals writability, so after every send the
  socket's events are looked at again (a send can swallow the edge of a message that came
  meanwhile), and what the loop must then handle is handed to it.
- Sends that would block go to a backlog, flushed as room comes back: the loop must never
  block on a peer that reads slowly.
- One other thread may lead while it is idle (lead(), see runtime/compute_thread.py): it
  waits on the FD itself and receives the next message, so that a call that arrives while
  the compute thread has nothing to do runs without a hand-off between threads. The loop
  watches the FD through an epoll set of its own, from which lead() removes it and take()
  puts it back: system calls that any thread may make, so the loop is neither woken nor
  asked for anything while another thread leads.
"""

from __future__ import annotations

import asyncio
import logging
import select
import threading
from collections import deque
from collections.abc import Callable, Sequence, Sized
from typing import Any

import zmq

from zmqworker.transport.drops import DropCounter
from zmqworker.transport.frames import NOBLOCK, TooManyFrames, recv_frames, send_frames

log = logging.getLogger("zmqworker.socket")

LEAD_WAIT, LEAD_READY, LEAD_CLOSED = "wait", "ready", "closed"  # what lead() found
# Plain ints: pyzmq's enum flags cost microseconds a use, several uses a message.
_POLLIN, _POLLOUT = int(zmq.POLLIN), int(zmq.POLLOUT)
# The socket's events are read through a zero-timeout zmq_poll, not getsockopt(EVENTS):
# pyzmq's getsockopt looks the option up in an enum, two Python frames each time.
_zmq_poll = zmq.backend.zmq_poll
# Messages handled per turn of the loop: a peer that floods one socket must not keep the
# loop from its other sockets, timers and signals.
MAX_PER_TURN = 64


class AsyncSocket:
    def __init__(
        self,
        sock: zmq.Socket,
        loop: asyncio.AbstractEventLoop,
        on_message: Callable[[list[zmq.Frame]], None],
        on_refused: Callable[[TooManyFrames], None] | None = None,
    ) -> None:
        """on_message(frames) and on_refused(error), for a message of too many frames
        (counted in refused), are called on the loop's thread."""
        self.sock = sock
        self._loop = loop
        self._on_message = on_message
        self._on_refused = on_refused
        self.refused = DropCounter(log, "messages of too many frames")  # taken off whole
        # Re-entrant: a message is handed on under it (see _drain), and a reply that its
        # handling sends takes it again.
        self._lock = threading.RLock()
        self._backlog: deque[Sequence[Any]] = deque()
        self.fd: int = sock.getsockopt(zmq.FD)
        self._poll_items = [(sock, _POLLIN | _POLLOUT)]  # for _after_io's look
        self._closed = False
        self._leader_wake: Callable[[], None] | None = None  # set while a thread leads
        self._watch = select.epoll()  # what the loop watches: the FD, unless a thread leads
        self._watch.register(self.fd, select.EPOLLIN)
        loop.add_reader(self._watch.fileno(), self._drain)
        loop.call_soon(self._drain)  # messages may have arrived before the reader existed

    def send(self, frames: Sequence[Any]) -> None:
        """Send from the loop's thread, never blocking it."""
        if self._send(frames):
            self._loop.call_soon(self._drain)

    def send_threadsafe(self, frames: Sequence[Any]) -> None:
        """Send from any other thread."""
        if self._send(frames):
            self._loop.call_soon_threadsafe(self._drain)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._loop.remove_reader(self._watch.fileno())
            self._watch.close()
            self.sock.close(linger=0)
            wake, self._leader_wake = self._leader_wake, None
        if wake is not None:
            wake()

    def lead(self, wake: Callable[[], None]) -> str:
        """Called by the thread that will wait on self.fd: incoming messages are left to
        it until it calls take(). LEAD_READY: one is there already (take it now, do not
        wait); LEAD_WAIT: wait for the FD or for wake(), which is called when a message
        may be there unseen by that wait; LEAD_CLOSED: the socket is closed."""
        with self._lock:
            if self._closed:
                return LEAD_CLOSED
            self._leader_wake = wake
            self._watch.modify(self.fd, 0)  # cheaper than unregister/register
            return LEAD_READY if self._after_io() else LEAD_WAIT

    def take(self, queued: Sized) -> list[zmq.Frame] | None:
        """End the lead: the next message, if one is there and nothing is queued (queued
        is looked at under the lock: the leader must not run a message ahead of work
        queued before it); the loop receives the rest."""
        with self._lock:
            if self._closed:
                return None
            self._leader_wake = None
            frames = None
            if not queued:
                try:  # no EVENTS first: a receive takes in the socket's news by itself
                    frames = recv_frames(self.sock)
                except zmq.Again:
                    frames = None
                except TooManyFrames as e:
                    self._refuse(e, self._loop.call_soon_threadsafe)
            more = self._after_io()
            # Only now: the FD, still readable from the edge just handled, would wake the
            # loop for nothing.
            self._watch.modify(self.fd, select.EPOLLIN)
        if more:  # their edge is gone: the loop must look by itself
            self._loop.call_soon_threadsafe(self._drain)
        return frames

    def _send(self, frames: Sequence[Any]) -> bool:
        """Send or queue; True when the loop has something to do (input or a backlog)."""
        with self._lock:
            if self._closed:
                return False
            if not self._backlog:
                try:
                    send_frames(self.sock, frames, NOBLOCK)
                except zmq.Again:
                    self._backlog.append(frames)
            else:
                self._backlog.append(frames)
            pending = self._after_io()
            if (pending or self._backlog) and self._leader_wake is not None:
                # This send took the edge the leader waits for (an input, or room for
                # the backlog), and the loop leaves the socket to the leader.
                self._leader_wake()
                return False
            return bool(self._backlog) or pending

    def _drain(self) -> None:
        for _ in range(MAX_PER_TURN):
            with self._lock:
                if self._closed or self._leader_wake is not None:
                    return  # a leader receives: the FD is its to look at
                if not self._after_io():
                    return
                # Handed on under the lock: a leader's take() then finds every message
                # received before its own already queued, and calls keep arrival order.
                try:
                    frames = recv_frames(self.sock)
                except TooManyFrames as e:
                    self._refuse(e, self._loop.call_soon)
                    continue
                try:
                    self._on_message(frames)
                except Exception:  # one bad message must not leave the next ones unread
                    log.exception("handling a message failed")
        # The FD's edge for the messages still there is gone: look again next turn.
        self._loop.call_soon(self._drain)

    def _refuse(self, error: TooManyFrames, schedule: Callable[..., object]) -> None:
        self.refused.count(str(error))
        if self._on_refused is not None:
            schedule(self._on_refused, error)

    def _after_io(self) -> bool:
        """After anything that may have taken in the socket's news (and so its FD's edge):
        send what the backlog can, and say whether a message waits. Under the lock."""
        ready = _zmq_poll(self._poll_items, 0)
        # Again after each flush: its sends, or this look, may have taken in the news of
        # room come back (and with it the FD's edge).
        while self._backlog and ready and ready[0][1] & _POLLOUT:
            self._flush()
            ready = _zmq_poll(self._poll_items, 0)
        return bool(ready) and bool(ready[0][1] & _POLLIN)

    def _flush(self) -> None:
        while self._backlog:
            try:
                send_frames(self.sock, self._backlog[0], NOBLOCK)
            except zmq.Again:
                return
            self._backlog.popleft()
