"""The utility calls a client has in flight to its engine cores, matched by call id: one
call goes to several engine cores and is done when each has answered, one has failed, its
engine core is gone, or its deadline has passed."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from messages import UtilityCall, UtilityResult
from zmqworker.frontend.errors import utility_error


@dataclass
class PendingCall:
    method: str
    waiting: set[int]  # engine indexes not answered yet
    deadline: float  # time.monotonic()
    results: dict[int, Any] = field(default_factory=dict)
    error: Exception | None = None
    future: asyncio.Future[list[Any]] | None = None

    @property
    def done(self) -> bool:
        return self.error is not None or not self.waiting

    def outcome(self) -> list[Any]:
        """The results in engine order, or the error raised."""
        if self.error is not None:
            raise self.error
        return [self.results[i] for i in sorted(self.results)]

    def finish(self) -> None:
        """Hand the outcome to an awaiting caller, if there is one."""
        future = self.future
        if future is None or future.done():
            return
        if self.error is not None:
            future.set_exception(self.error)
        else:
            future.set_result(self.outcome())


class UtilityCalls:
    def __init__(self) -> None:
        self._calls: dict[int, PendingCall] = {}
        self._ids = itertools.count(1)

    def start(
        self,
        method: str,
        args: Sequence[Any],
        kwargs: dict[str, Any] | None,
        engines: Sequence[int],
        timeout: float,
    ) -> tuple[PendingCall, UtilityCall]:
        """A new call to engines, and the message to send each of them."""
        call_id = next(self._ids)
        call = PendingCall(method, set(engines), time.monotonic() + timeout)
        self._calls[call_id] = call
        return call, UtilityCall(call_id, method, list(args), dict(kwargs or {}))

    def on_result(self, engine_index: int, msg: UtilityResult) -> None:
        call = self._calls.get(msg.call_id)
        if call is None or engine_index not in call.waiting:
            return  # it timed out here already
        call.waiting.discard(engine_index)
        if msg.exc_type is not None:
            call.error = utility_error(engine_index, msg.exc_type, msg.message)
        else:
            call.results[engine_index] = msg.result
        if call.done:
            self._end(msg.call_id)

    def fail_engine(self, engine_index: int, error: Exception) -> None:
        """Its engine core is gone, or sent what did not decode: the calls that wait for it
        fail with error."""
        for call_id, call in list(self._calls.items()):
            if engine_index in call.waiting:
                call.error = error
                self._end(call_id)

    def expire(self, now: float) -> None:
        for call_id, call in list(self._calls.items()):
            if now >= call.deadline:
                call.error = TimeoutError(
                    f"{call.method}: no answer from engine core(s) {sorted(call.waiting)}"
                )
                self._end(call_id)

    def next_deadline(self) -> float | None:
        return min((c.deadline for c in self._calls.values()), default=None)

    def _end(self, call_id: int) -> None:
        self._calls.pop(call_id).finish()
