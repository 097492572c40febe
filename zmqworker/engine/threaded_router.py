"""The disaggregated pair served as it is meant to run: each instance's engine core in a
loop thread of its own (core_loop.py), so that a long prefill step never holds up a
decode step, and the router (this) in the caller's thread handing requests across.
DisaggregatedEngine steps both cores from one thread instead, for tests that must place
an event between two steps."""

from __future__ import annotations

import queue
from collections.abc import Iterable, Sequence

from messages import SamplingParams
from zmqworker.engine.core import EngineCore
from zmqworker.engine.core_loop import CoreLoop, Snapshot
from zmqworker.engine.disaggregated import (
    DisaggregatedEngine,
    RoutedRequest,
    check_routed,
    decode_request,
    run_to_end,
)
from zmqworker.engine.request import Request

PREFILL, DECODE = "prefill", "decode"


class ThreadedRouter:
    """Not thread-safe itself: one thread calls add_request, poll and the rest."""

    def __init__(self, pair: DisaggregatedEngine) -> None:
        self.pair = pair
        self.requests: dict[str, RoutedRequest] = {}
        self._inputs: dict[str, tuple[list[int], SamplingParams, list[int]]] = {}
        self._side: dict[str, str] = {}  # where each unfinished request is
        self._events: queue.SimpleQueue[tuple[str, list[Snapshot] | BaseException]] = (
            queue.SimpleQueue()
        )
        self._loops = {
            side: CoreLoop(
                core,
                side,
                lambda changed, side=side: self._events.put((side, changed)),
                lambda error, side=side: self._events.put((side, error)),
            )
            for side, core in ((PREFILL, pair.prefill), (DECODE, pair.decode))
        }

    def add_request(
        self,
        req_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        eos_token_ids: Iterable[int] = (),
    ) -> None:
        check_routed(req_id, self.requests)
        prompt, eos = list(prompt_token_ids), list(eos_token_ids)
        side = DECODE if self.pair.prefills_locally(prompt, params) else PREFILL
        request = Request(req_id, prompt, params, eos_token_ids=eos, remote_decode=side == PREFILL)
        self.requests[req_id] = RoutedRequest(req_id)
        self._inputs[req_id] = (prompt, params, eos)
        self._side[req_id] = side
        self._loops[side].call(lambda core: self._add(side, core, request))

    def poll(self, timeout: float) -> list[RoutedRequest]:
        """The requests that changed, waiting up to timeout for the first change."""
        changed: dict[str, RoutedRequest] = {}
        try:
            event = self._events.get(timeout=timeout)
            while True:
                self._apply(*event, changed)
                event = self._events.get_nowait()
        except queue.Empty:
            pass
        return list(changed.values())

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        eos_token_ids: Iterable[int] = (),
        timeout_s: float = 600.0,
    ) -> list[RoutedRequest]:
        """Run prompts to the end (bounded by timeout_s); their results in order."""
        return run_to_end(
            self, "routed", prompts, params, eos_token_ids, timeout_s, lambda: self.poll(0.1)
        )

    def stop(self) -> None:
        """Stop both loops (the engine cores stay: pair.shutdown() ends them)."""
        for loop in self._loops.values():
            loop.stop()

    # on the loops' threads ------------------------------------------------------------

    def _add(self, side: str, core: EngineCore, request: Request) -> None:
        try:
            core.add_request(request)
        except Exception as e:
            self._events.put((side, [_refused(request, e)]))

    # on the router's thread -------------------------------------------------------------

    def _apply(
        self, side: str, event: list[Snapshot] | BaseException, changed: dict[str, RoutedRequest]
    ) -> None:
        if isinstance(event, BaseException):
            # The core aborted every request it held: theirs end with the error.
            for req_id in [r for r, s in self._side.items() if s == side]:
                routed = self.requests[req_id]
                routed.update(routed.token_ids, "abort", f"{req_id!r}: the {side} failed: {event}")
                self._finish(req_id)
                changed[req_id] = routed
            return
        for snap in event:
            if self._side.get(snap.req_id) != side:
                continue  # ended on this side already
            routed = self.requests[snap.req_id]
            goes_on = side == PREFILL and snap.kv_transfer_out is not None
            finish = None if goes_on else snap.finish_reason
            routed.update(snap.output_token_ids, finish, snap.error, snap.logprobs)
            changed[snap.req_id] = routed
            if goes_on:
                assert snap.kv_transfer_out is not None
                request = decode_request(
                    snap.req_id, self._inputs[snap.req_id], snap.kv_transfer_out,
                    snap.output_token_ids[0],
                )  # fmt: skip
                self._side[snap.req_id] = DECODE
                self._loops[DECODE].call(lambda core, r=request: self._add(DECODE, core, r))
            elif routed.finished:
                self._finish(snap.req_id)

    def _finish(self, req_id: str) -> None:
        self._side.pop(req_id, None)
        self._inputs.pop(req_id, None)


def _refused(request: Request, error: Exception) -> Snapshot:
    return Snapshot(
        request.req_id, tuple(request.output_token_ids), "abort", str(error), None, (None, None)
    )
