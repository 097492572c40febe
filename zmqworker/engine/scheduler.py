"""The scheduler: continuous batching of requests into steps, as SchedulerOutput deltas.

Each step fills a token budget: first running requests that decode, then running
requests in the middle of a chunked prefill, then waiting requests (waiting_queue.py:
those whose KV was loaded from a prefill instance, preempted ones, then the rest in
arrival order), whose prompts are cut into chunks to fit the budget. When the KV cache
runs out, the newest running request is preempted by recompute: its blocks are freed
and it waits among the first, to start over with its prompt and its outputs so far as
the new prompt (NewRequestData, under the handle it had: the workers set it aside when
told of the preemption, and drop that when it comes back as new).

Steps in flight: with pipeline stages, a request in a step still in flight is not
scheduled again until that step's output has come back, so those steps hold disjoint
request sets. With async scheduling (one stage, two or more steps in flight), a decode
goes on on top of the steps in flight: its last scheduled token is a placeholder for the
token the step before samples, which the worker fills in itself. Either way a request
in flight is never preempted, and a request that finishes (or is aborted) while steps in
flight still compute it keeps its blocks until they have come back; the tokens they
sample for it are dropped.

What it counts lives in two places, each the one owner: the running requests' counters
in RunningTable's columns (running.py), the steps in flight in StepsInFlight
(in_flight.py). A step is built in a StepDraft (step_draft.py) and its output applied by
step_output.py, in bulk for the requests that only decode.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from messages import ModelRunnerOutput, SchedulerOutput
from zmqworker.cdiv import cdiv
from zmqworker.engine.admission import check_limits, check_new_request
from zmqworker.engine.block_manager import KVBlockManager
from zmqworker.engine.handles import HandlePool
from zmqworker.engine.in_flight import StepsInFlight
from zmqworker.engine.kv_connector import KVConnectorScheduler, step_orders
from zmqworker.engine.prompt_sharing import computed_prompt_blocks
from zmqworker.engine.request import FinishReason, Request, RequestStatus
from zmqworker.engine.running import RunningTable
from zmqworker.engine.step_draft import StepDraft
from zmqworker.engine.step_output import apply_tokens
from zmqworker.engine.waiting_queue import WaitingQueue


class Scheduler:
    """Decides each step's requests and token counts. Not thread-safe.

    send_token_ids: put newly sampled tokens in the cached-request deltas, for workers
    that do not sample themselves (pipeline stages before the last).
    max_concurrent_batches: steps kept in flight. Above 1, a step takes at most its share
    of the requests, so that the next step has requests to run while it is in flight.
    async_scheduling: max_concurrent_batches (at least 2) steps in flight on one stage,
    each going on from the tokens of the one before (placeholders) instead of taking
    other requests.
    kv_connector: the scheduler side of KV transfer (disaggregated prefill and decode).
    """

    def __init__(
        self,
        block_manager: KVBlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        send_token_ids: bool = False,
        max_concurrent_batches: int = 1,
        async_scheduling: bool = False,
        kv_connector: KVConnectorScheduler | None = None,
    ) -> None:
        self.kv = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.send_token_ids = send_token_ids
        self.max_concurrent_batches = max_concurrent_batches
        self.async_scheduling = async_scheduling
        self.kv_connector = kv_connector
        check_limits(self)
        self.waiting = WaitingQueue()
        self.table = RunningTable()  # the running requests, in the order they started
        self.in_flight = StepsInFlight()
        self._requests: dict[str, Request] = {}
        # Finished while a step in flight still computes them (req_id -> handle): their
        # blocks are freed once those steps are back.
        self._draining: dict[str, int] = {}
        self._handles = HandlePool()
        # Handles to report in the next step: finished, and preempted requests.
        self._finished_handles: list[int] = []
        self._preempted_handles: list[int] = []
        self.num_preemptions = 0  # since start: a sign the KV cache is too small
        self.num_prefill_tokens = 0  # since start: tokens prefills computed (EngineCoreStats)
        self.declined: deque[Request] = deque()  # outbox: not run (Request.declines)

    # -- requests in and out ------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.check_request(request)
        self._requests[request.req_id] = request
        if request.remote is not None:
            assert self.kv_connector is not None
            self.kv_connector.add_remote(request)
        else:
            self.waiting.add_new(request)

    def check_request(self, request: Request) -> None:  # add_request's ValueErrors
        if request.req_id in self._requests or request.req_id in self._draining:
            raise ValueError(f"request id {request.req_id!r} is already in the scheduler")
        check_new_request(request, self.max_model_len, self.kv_connector)

    def abort_request(self, req_id: str) -> Request | None:
        """Finish req_id as aborted; None if it is unknown or already finished. A request
        in a step in flight is dropped now; that step's token for it is ignored."""
        request = self._requests.get(req_id)
        if request is None:
            return None
        if request.status is RequestStatus.WAITING_FOR_REMOTE_KV:
            assert self.kv_connector is not None
            del self._requests[req_id]
            request.finish(FinishReason.ABORT)
            self.kv_connector.abort(request)
            return request
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        else:
            assert request.handle is not None
            self.table.remove([int(self.table.position_of_handle[request.handle])])
        request.finish(FinishReason.ABORT)
        self._release(request)
        return request

    @property
    def running(self) -> list[Request]:
        """The running requests, in the order they started (the last is the newest)."""
        return self.table.requests

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    def has_unfinished_requests(self) -> bool:
        """Requests to run, or KV transfers whose end steps must hear of."""
        return bool(self._requests) or (self.kv_connector is not None and self.kv_connector.busy)

    def structured_requests(self, output: SchedulerOutput) -> list[Request]:
        """The requests with a grammar that output, the step just made, samples for."""
        handles = self.in_flight.newest(output).structured
        return [self.table.requests[p] for p in self.table.position_of_handle[handles].tolist()]

    # -- building a step -----------------------------------------------------------------

    def schedule(self) -> SchedulerOutput | None:
        """The next step, or None when there is nothing to compute now (everything is
        waiting on steps in flight, or no request is left). A returned step must be sent
        to the workers and its output passed to update_from_output, in order."""
        self.kv.new_step()
        active = min(self.max_num_seqs, len(self._requests))
        share = 1 if self.async_scheduling else self.max_concurrent_batches
        max_reqs = max(1, cdiv(active, share))
        draft = StepDraft(self.table)
        preempted: list[int] = []  # positions, left in the table until the step is built
        budget = self._schedule_running(draft, self.max_num_batched_tokens, max_reqs, preempted)
        # Waiting requests only when nothing was preempted (the cache is full then).
        if not preempted:
            budget = self._schedule_waiting(draft, budget, max_reqs)
        connector = self.kv_connector
        kv_orders = step_orders(connector, self.kv.host_tier)
        output = None
        if draft or kv_orders is not None or (connector is not None and connector.busy):
            output = draft.send(
                self.in_flight,
                self._finished_handles,
                self._preempted_handles,
                self.async_scheduling,
                kv_orders,
            )
            self._finished_handles, self._preempted_handles = [], []
        self.table.remove(preempted)
        return output

    def _schedule_running(
        self, draft: StepDraft, budget: int, max_reqs: int, preempted: list[int]
    ) -> int:
        """Running requests into draft: decodes first, then chunked prefills in progress;
        the budget left. Decodes that need nothing of the block manager (most of them,
        most steps) go in as arrays; the rest one by one."""
        table = self.table
        if not len(table):
            return budget
        num_left, decodes, slow, others = table.ready(
            self.in_flight, self.kv, self.async_scheduling, self.send_token_ids
        )
        limit = min(budget, max_reqs)
        start = 0
        for i in [*slow, len(decodes)]:
            # The fast decodes before decodes[i] (those still running), then decodes[i].
            part = decodes[start:i]
            if preempted:
                part = part[[table.requests[p].status is RequestStatus.RUNNING for p in part]]
            draft.add_decodes(part[: limit - len(draft)])
            if i == len(decodes) or len(draft) == limit:
                break
            start = i + 1
            self._schedule_one(draft, int(decodes[i]), 1, 1, preempted)
        budget -= len(draft)
        for position in others:
            if budget == 0 or len(draft) == max_reqs:
                break
            budget -= self._schedule_one(
                draft, position, int(num_left[position]), budget, preempted
            )
        return budget

    def _schedule_one(
        self, draft: StepDraft, position: int, num_left: int, budget: int, preempted: list[int]
    ) -> int:
        """A running request into draft, with the blocks it needs; the tokens it computes
        (0 if it was preempted, or waits for room)."""
        table = self.table
        request = table.requests[position]
        if request.status is not RequestStatus.RUNNING:
            return 0  # preempted to make room for an older request
        num_new = min(num_left, budget)
        computed = int(table.computed[position])
        known = request.all_token_ids
        # Positions past the known tokens: what the steps in flight sample. Only the
        # last of them is this step's placeholder; the others those steps compute.
        unknown = max(0, computed + num_new - len(known))
        new_blocks = self.kv.allocate_slots(request.req_id, known, computed, num_new, (), unknown)
        if new_blocks is None:
            new_blocks = self._preempt_until_fits(position, num_new, unknown, draft, preempted)
            if new_blocks is None:
                return 0
        full = min(computed + num_new, len(known)) // self.kv.block_size
        table.full_blocks_told[position] = full
        new_tokens = None
        if self.send_token_ids:
            # Tokens from position num_computed on; workers append those they lack.
            lacking = len(known) > table.tokens_sent[position]
            new_tokens = known[computed:] if lacking else []
            table.tokens_sent[position] = len(known)
        draft.add_one(position, num_new, new_blocks, num_new == num_left, new_tokens)
        if num_left > 1:  # a chunk that leaves one token: it goes as a decode, counted here
            self.num_prefill_tokens += num_new + (num_left - num_new == 1)
        return num_new

    def _schedule_waiting(self, draft: StepDraft, budget: int, max_reqs: int) -> int:
        """Waiting requests into draft, in order, while they fit, each after the pulls of
        remote KV that came before it (those holding no blocks); the budget left."""
        seqs, pulls, skipped = self.max_num_seqs, self.kv_connector, 0
        while len(self.waiting) > skipped and budget > 0 and len(draft) < max_reqs:
            request = self.waiting[skipped]
            behind_none = pulls is None or request.num_loaded_tokens > 0  # loaded: has blocks
            if len(self.table) >= seqs or not (behind_none or pulls.order_loads(request)):
                break  # an earlier pull waits for blocks: this one waits behind it
            computed = computed_prompt_blocks(request, self._requests, self.table, self.kv)
            if computed is None:  # its sibling computes their prompt in a step to come
                skipped += 1
                continue
            hits, host_slots, num_hit = computed
            if (why := request.declines(num_hit)) is not None:  # for a prefill instance
                self.waiting.remove(request)
                request.finish(FinishReason.DECLINED)
                request.error = why
                self._release(request)
                self.declined.append(request)
                continue
            num_new = min(request.num_tokens - num_hit, budget)
            new_blocks = self.kv.allocate_slots(
                request.req_id, request.all_token_ids, num_hit, num_new, hits, 0, host_slots
            )
            if new_blocks is None:
                # No request running or draining will free a block: a loaded one gives its own.
                busy = len(self.table) or self._draining
                if busy or not self.waiting.unload(request, self.kv):
                    break
                self.num_preemptions += 1
                continue
            self.waiting.remove(request)
            request.start_running(num_hit)
            request.num_loaded_tokens = 0  # the table counts them from now on
            if request.handle is None:
                request.handle = self._handles.acquire()
                self.in_flight.reserve(request.handle)
            position = self.table.add(request, num_hit, self.max_model_len)
            self.table.full_blocks_told[position] = (num_hit + num_new) // (self.kv.block_size)
            samples = num_new == request.num_tokens - num_hit
            draft.add_new(position, num_new, self.kv.block_ids(request.req_id), samples)
            self.num_prefill_tokens += num_new + (request.num_tokens - num_hit - num_new == 1)
            budget -= num_new
        return budget

    def _preempt_until_fits(
        self, position: int, num_new: int, unknown: int, draft: StepDraft, preempted: list[int]
    ) -> list[int] | None:
        """Blocks for num_new more tokens (unknown: positions steps in flight sample) of
        the request at position, preempting newer ones in no step, newest first, then
        itself; None if it went, or waits (for newer ones in a step to come back)."""
        table, request = self.table, self.table.requests[position]
        idle = (self.in_flight.num_steps[table.handle[: len(table)]] == 0) & ~draft.in_step()
        running = np.array([r.status is RequestStatus.RUNNING for r in table.requests], bool)
        victims = (np.flatnonzero(idle[position:]) + position).tolist()  # never older; newest last
        while victims:
            victim = victims.pop()
            if not running[victim]:
                continue  # preempted already
            if victim == position and (~idle[position + 1 :] & running[position + 1 :]).any():
                return None  # else two that alternate steps could preempt each other for ever
            self._preempt(victim)
            preempted.append(victim)
            if victim == position:
                return None
            computed, known = int(table.computed[position]), request.all_token_ids
            blocks = self.kv.allocate_slots(request.req_id, known, computed, num_new, (), unknown)
            if blocks is not None:
                return blocks
        return None  # the rest are in flight: it waits for their steps to come back

    def _preempt(self, position: int) -> None:
        """Back to waiting, to start over; its position leaves the table once the step
        is built."""
        request = self.table.requests[position]
        assert request.handle is not None
        self._preempted_handles.append(request.handle)
        self.num_preemptions += 1
        self.waiting.preempt(request, self.kv)

    # -- consuming a step's output ------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[Request]:
        """Apply the sampled tokens of the oldest step in flight (which must be
        scheduler_output); return the requests that got a token or finished."""
        step = self.in_flight.pop(scheduler_output)
        self._handles.release(step.finished_handles)
        changed, finished, held = apply_tokens(
            self.table, self.in_flight, step, runner_output, self.max_model_len
        )
        # held: a prefill instance's requests, whose KV stays for the decode instance.
        for position in finished + held:
            self._release(self.table.requests[position], hold_kv=position in held)
        self.table.remove(finished + held)
        if self._draining:
            for req_id, handle in list(self._draining.items()):
                if not self.in_flight.steps_of(handle):
                    del self._draining[req_id]
                    self.kv.free(req_id)
        kv_output = runner_output.kv_connector_output
        if kv_output is not None:
            assert self.kv_connector is not None
            failed = self.kv_connector.update(kv_output, self.waiting.add_loaded)
            for request in failed:
                del self._requests[request.req_id]
            changed += failed
        return changed

    def reset_after_failure(self, workers_lost: bool = False) -> list[Request]:
        """Abort every request after a step failed (and every step in flight has been
        waited for): the workers may or may not have applied the failed step, so the next
        step reports every handle they could hold as finished (workers ignore those they
        do not hold). workers_lost: a worker died. Returns the aborted requests."""
        aborted = list(self._requests.values())
        for request in aborted:
            request.finish(FinishReason.ABORT)
            request.handle = None
            self.kv.free(request.req_id)
        for req_id in self._draining:
            self.kv.free(req_id)
        self._finished_handles = self._handles.live_handles()
        self._preempted_handles = []
        for state in (self._requests, self.waiting, self.table, self._draining, self.in_flight):
            state.clear()
        if self.kv_connector is not None:
            self.kv_connector.reset(workers_lost)
        return aborted

    def _release(self, request: Request, hold_kv: bool = False) -> None:
        """Forget a finished request (out of the waiting queue, or about to leave the
        table): the next step tells the workers (their steps run in order, so one in
        flight still finds it); its blocks go once no step in flight computes it (hold_kv:
        once its KV is sent, which is later), its handle once the step that tells the
        workers has come back."""
        del self._requests[request.req_id]
        handle = request.handle
        if hold_kv:
            assert self.kv_connector is not None
            self.kv_connector.hold(request)
        elif handle is not None and self.in_flight.steps_of(handle):
            self._draining[request.req_id] = handle
        else:
            self.kv.free(request.req_id)
        if handle is None:
            return  # the workers never saw it
        if handle in self._preempted_handles:
            # Preempted and finished before the workers heard: report it once, finished.
            self._preempted_handles.remove(handle)
        self._finished_handles.append(handle)
        request.handle = None
