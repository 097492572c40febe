"""Multipart send and receive without pyzmq's sugar, for every message of a round trip.

Socket.send_multipart and recv_multipart spend most of a message's time on enum flag
arithmetic and an RCVMORE getsockopt per frame, and a step's round trip makes at least
four: the plain per-frame calls below take a fraction of it (Frame.more says whether
another frame follows; docs/cuda.md has the figures). Sends go to the backend's send
itself: the sugar layer above it only handles DRAFT routing ids and groups.

libzmq bounds each frame (ZMQ_MAXMSGSIZE) and counts a multipart message as one against
the high-water mark, whatever its frames: a receive is bounded in frames here, so that a
peer cannot make a receiver hold an object per frame without end.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import zmq
import zmq.backend

from messages.errors import ProtocolError

NOBLOCK, SNDMORE = int(zmq.NOBLOCK), int(zmq.SNDMORE)
_send = zmq.backend.Socket.send  # (socket, data, flags, copy)
# The frames a message may have where its kind does not bound them: a step has up to 5
# data frames a request (prompt, block table, a KV load's two block lists, a save's), a
# client's outputs 6 (logprobs, prompt logprobs), so this holds steps of over 10,000
# requests, and a worker call's values thousands of arrays.
MAX_FRAMES = 1 << 16


class TooManyFrames(ProtocolError):
    """A message of more frames than its socket takes: taken off the socket whole and
    dropped (the next receive starts at the next message). A ProtocolError, so that a
    receiver treats it as any message that does not decode; first: its first frame, which
    may name the call to fail."""

    def __init__(self, count: int, bound: int, first: zmq.Frame) -> None:
        super().__init__(f"a message of {count} frames: this socket takes at most {bound}")
        self.count = count
        self.bound = bound
        self.first = first


def send_frames(sock: zmq.Socket, frames: Sequence[Any], flags: int = 0) -> None:
    """Send frames as one message; buffers at or above the socket's copy_threshold go
    without a copy (the caller keeps them alive and unchanged until sent)."""
    last = len(frames) - 1
    for i in range(last):
        _send(sock, frames[i], flags | SNDMORE, False)
    _send(sock, frames[last], flags, False)


def recv_frames(
    sock: zmq.Socket, flags: int = NOBLOCK, max_frames: int = MAX_FRAMES
) -> list[zmq.Frame]:
    """The next message's frames (zmq.Again when none is there, with NOBLOCK);
    TooManyFrames when it has more than max_frames."""
    frame = sock.recv(flags, copy=False)
    frames = [frame]
    while frame.more:
        if len(frames) == max_frames:
            raise TooManyFrames(max_frames + _discard_rest(sock, flags), max_frames, frames[0])
        frame = sock.recv(flags, copy=False)
        frames.append(frame)
    return frames


def _discard_rest(sock: zmq.Socket, flags: int) -> int:
    """Take the rest of a message off the socket (it is all there once its first frame
    is: libzmq delivers a message whole); how many frames that was."""
    count, more = 0, True
    while more:
        more = sock.recv(flags, copy=False).more
        count += 1
    return count
