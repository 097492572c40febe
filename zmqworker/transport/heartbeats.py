"""ZMTP heartbeats between an engine and its workers, one rule for both ends: a peer
silent for a bound (no traffic, no answer to a ping) loses its connection, pinged
HEARTBEATS times within that bound. libzmq's I/O thread answers the pings, so a process
busy in Python still answers; a stopped or lost one does not."""

from __future__ import annotations

import zmq

HEARTBEATS = 5  # pings sent within the silence bound
MAX_TTL_MS = 6_553_500  # the wire holds deciseconds, at most 65535
MAX_SILENT_S = (2**31 - 1) // 1000  # the longest bound libzmq's options hold (int ms)


def check_bound(name: str, silent_s: float | None) -> None:
    """Refuse (ValueError naming `name`) a silence bound that is neither None nor seconds
    > 0 that libzmq's options hold: before any socket takes it."""
    if silent_s is not None and not 0 < silent_s <= MAX_SILENT_S:
        raise ValueError(
            f"{name} must be seconds > 0, at most {MAX_SILENT_S:,} (libzmq's int "
            f"milliseconds), or None; got {silent_s!r}"
        )


def keep_alive(sock: zmq.Socket, silent_s: float, tell_peer: bool = False) -> None:
    """Ping sock's peers and drop one silent for silent_s (set before it connects or
    binds). tell_peer: every ping carries the bound too, and a peer that sets none of its
    own drops this end once it is silent as long (it learns the bound from the first)."""
    bound_ms = max(1, round(silent_s * 1000))
    sock.setsockopt(zmq.HEARTBEAT_IVL, max(1, round(silent_s * 1000 / HEARTBEATS)))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, bound_ms)
    if tell_peer:
        sock.setsockopt(zmq.HEARTBEAT_TTL, min(max(bound_ms, 100), MAX_TTL_MS))
