"""A zmq socket driven by an asyncio loop through its file descriptor.

zmq.asyncio adds 95-175 us per round trip on this kind of machine; watching the socket's
FD with loop.add_reader and receiving until EAGAIN adds 40-60 us (ARCHITECTURE.md).

The loop receives; any thread may send (send_threadsafe), so that the compute thread
replies without a hop back through the loop. A lock serialises the socket (zmq allows
a socket to move between threads behind a full memory barrier). The FD is
edge-triggered and also signals writability: after every send we look at zmq.EVENTS
ourselves, because a send can swallow the edge of a message that arrived meanwhile.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import zmq

# Plain ints: pyzmq's enum flags cost about 3 us a use here, several uses a message.
_EVENTS, _POLLIN, _POLLOUT, _NOBLOCK = (
    int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.POLLOUT), int(zmq.NOBLOCK)
)


class AsyncSocket:
    def __init__(
        self,
        sock: zmq.Socket,
        loop: asyncio.AbstractEventLoop,
        on_message: Callable[[list[zmq.Frame]], None],
    ) -> None:
        self.sock = sock
        self._loop = loop
        self._on_message = on_message
        self._lock = threading.Lock()
        self._backlog: deque[Sequence[Any]] = deque()
        self._fd = sock.getsockopt(zmq.FD)
        self._closed = False
        loop.add_reader(self._fd, self._drain)
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
            self._loop.remove_reader(self._fd)
            self.sock.close(linger=0)

    def _send(self, frames: Sequence[Any]) -> bool:
        """Send or queue; True when the loop has something to do (input or a backlog)."""
        with self._lock:
            if self._closed:
                return False
            if not self._backlog:
                try:
                    self.sock.send_multipart(frames, _NOBLOCK, copy=False)
                except zmq.Again:
                    self._backlog.append(frames)
            else:
                self._backlog.append(frames)
            return bool(self._backlog) or bool(self.sock.getsockopt(_EVENTS) & _POLLIN)

    def _drain(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                events = self.sock.getsockopt(_EVENTS)
                if self._backlog and events & _POLLOUT:
                    self._flush()
                if not events & _POLLIN:
                    return
                frames = self.sock.recv_multipart(_NOBLOCK, copy=False)
            self._on_message(frames)

    def _flush(self) -> None:
        while self._backlog:
            try:
                self.sock.send_multipart(self._backlog[0], _NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._backlog.popleft()
