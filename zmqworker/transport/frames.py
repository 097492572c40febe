"""Multipart send and receive without pyzmq's sugar, for every message of a round trip.

Socket.send_multipart and recv_multipart spend most of a message's time on enum flag
arithmetic and an RCVMORE getsockopt per frame, and a step's round trip makes at least
four: the plain per-frame calls below take a fraction of it (Frame.more says whether
another frame follows; docs/cuda.md has the figures). Sends go to the backend's send
itself: the sugar layer above it only handles DRAFT routing ids and groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import zmq
import zmq.backend

NOBLOCK, SNDMORE = int(zmq.NOBLOCK), int(zmq.SNDMORE)
_send = zmq.backend.Socket.send  # (socket, data, flags, copy)


def send_frames(sock: zmq.Socket, frames: Sequence[Any], flags: int = 0) -> None:
    """Send frames as one message; buffers at or above the socket's copy_threshold go
    without a copy (the caller keeps them alive and unchanged until sent)."""
    last = len(frames) - 1
    for i in range(last):
        _send(sock, frames[i], flags | SNDMORE, False)
    _send(sock, frames[last], flags, False)


def recv_frames(sock: zmq.Socket, flags: int = NOBLOCK) -> list[zmq.Frame]:
    """The next message's frames (zmq.Again when none is there, with NOBLOCK)."""
    frame = sock.recv(flags, copy=False)
    frames = [frame]
    while frame.more:
        frame = sock.recv(flags, copy=False)
        frames.append(frame)
    return frames
