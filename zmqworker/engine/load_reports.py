"""The engine core's load (running and waiting requests) as each client last heard it,
and the stats-only reports that keep that current.

Clients balance their requests over data-parallel engine cores by the load each one
reported (EngineConnection.load). A step's outputs carry the stats, but only to the
clients whose requests they are: a client with no request here would never hear of the
load the others put on it. So whenever the load differs from what a client last heard,
the engine core sends it an EngineCoreOutputs of no request with the stats now: at most
one every REPORT_EVERY_S per client, and the last change always (next_in bounds the
idle loop's wait until the next one due). Only to a client heard from within ACTIVE_S:
one that does not read meanwhile (an LLM between calls) would hold every report, and a
client that sends again hears the load then.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import numpy as np

from messages import Encoder, EngineCoreOutputs, EngineCoreStats
from zmqworker.engine.core_clients import Client

REPORT_EVERY_S = 0.05
ACTIVE_S = 30.0
_NO_TOKENS = np.zeros(0, np.int32)


def load_of(stats: EngineCoreStats) -> int:
    return stats.num_running + stats.num_waiting


class LoadReports:
    def __init__(
        self, engine_index: int, every_s: float = REPORT_EVERY_S, active_s: float = ACTIVE_S
    ) -> None:
        self.engine_index = engine_index
        self.every_s = every_s
        self.active_s = active_s
        self._enc = Encoder()
        self._next_at: float | None = None  # the earliest report held back, if any

    @staticmethod
    def told(client: Client, stats: EngineCoreStats) -> None:
        """client was sent stats (with its outputs, or alone)."""
        client.told_load = load_of(stats)

    def send(
        self,
        load: int,
        stats: Callable[[], EngineCoreStats],
        clients: Iterable[Client],
        send_frames: Callable[[Client, list], None],
    ) -> None:
        """Report stats() (the load now, load) to each client heard from within active_s
        that last heard another load and had no report within every_s; those held back
        are due at next_in(). The stats are built only for a report that goes. Every
        client is looked at before the first send (which may drop one)."""
        now, due, held = time.monotonic(), [], []
        for client in clients:
            if client.told_load != load and now - client.heard_at <= self.active_s:
                (due if now >= client.next_report_at else held).append(client)
        self._next_at = min((c.next_report_at for c in held), default=None)
        if due:
            frames = self._enc.encode(EngineCoreOutputs(self.engine_index, [], _NO_TOKENS, stats()))
            for client in due:
                client.told_load, client.next_report_at = load, now + self.every_s
                send_frames(client, frames)

    def next_in(self, now: float) -> float | None:
        """Seconds until a report held back at the last send() is due; None if none is."""
        return None if self._next_at is None else max(0.0, self._next_at - now)
