"""The scheduler: continuous batching of requests into steps, as SchedulerOutput deltas.

Each step fills a token budget: first running requests that decode, then running
requests in the middle of a chunked prefill, then waiting requests in arrival order
(FCFS), whose prompts are cut into chunks to fit the budget. When the KV cache runs out,
the newest running request is preempted by recompute: its blocks are freed and it waits
at the front of the queue, to start over with its prompt and its outputs so far as the
new prompt (NewRequestData, under the handle it had: the workers set it aside when told
of the preemption, and drop that when it comes back as new).

Steps in flight: with pipeline stages, a request in a step still in flight is not
scheduled again until that step's output has come back, so those steps hold disjoint
request sets. With async scheduling (one stage, two or more steps in flight), a decode
goes on on top of the steps in flight: its last scheduled token is a placeholder for the
token the step before samples, which the worker fills in itself. Either way a request
in flight is never preempted, and a request that finishes (or is aborted) while steps in
flight still compute it keeps its blocks until they have come back; the tokens they
sample for it are dropped.
"""

from __future__ import annotations

from collections import deque

from messages import ModelRunnerOutput, SchedulerOutput
from zmqworker.cdiv import cdiv
from zmqworker.engine.admission import check_limits, check_new_request
from zmqworker.engine.block_manager import KVBlockManager
from zmqworker.engine.handles import HandlePool
from zmqworker.engine.kv_connector import KVConnectorScheduler
from zmqworker.engine.prompt_sharing import computed_prompt_blocks
from zmqworker.engine.request import FinishReason, Request, RequestStatus
from zmqworker.engine.step_draft import SentStep, StepDraft


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
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in the order they started: the last is newest
        self._requests: dict[str, Request] = {}
        # Finished while a step in flight still computes them: released once it is back.
        self._draining: dict[str, Request] = {}
        self._steps: deque[SentStep] = deque()
        self._handles = HandlePool()
        # Handles to report in the next step: finished, and preempted requests.
        self._finished_handles: list[int] = []
        self._preempted_handles: list[int] = []
        self.num_preemptions = 0  # since start: a sign the KV cache is too small
        self.num_prefill_tokens = 0  # since start: tokens prefills computed (EngineCoreStats)
        # Tokens each running request's workers have seen, for send_token_ids.
        self._num_tokens_sent: dict[str, int] = {}

    # -- requests in and out ------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.check_request(request)
        self._requests[request.req_id] = request
        if request.remote is not None:
            assert self.kv_connector is not None
            self.kv_connector.add_remote(request)
        else:
            self.waiting.append(request)

    def check_request(self, request: Request) -> None:  # add_request's ValueErrors
        if request.req_id in self._requests or request.req_id in self._draining:
            raise ValueError(f"request id {request.req_id!r} is already in the scheduler")
        check_new_request(request, self.max_model_len, self.kv_connector is not None)

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
            self.running.remove(request)
        request.finish(FinishReason.ABORT)
        self._release(request)
        return request

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    @property
    def num_steps_in_flight(self) -> int:
        return len(self._steps)

    def has_unfinished_requests(self) -> bool:
        """Requests to run, or KV transfers whose end steps must hear of."""
        return bool(self._requests) or (self.kv_connector is not None and self.kv_connector.busy)

    def structured_requests(self, output: SchedulerOutput) -> list[Request]:
        """The requests with a grammar that output, the step just made, samples for."""
        if not self._steps or self._steps[-1].output is not output:
            raise RuntimeError("structured_requests is asked of the step schedule() just made")
        return self._steps[-1].structured

    # -- building a step -----------------------------------------------------------------

    def schedule(self) -> SchedulerOutput | None:
        """The next step, or None when there is nothing to compute now (everything is
        waiting on steps in flight, or no request is left). A returned step must be sent
        to the workers and its output passed to update_from_output, in order."""
        self.kv.new_step()
        active = min(self.max_num_seqs, len(self._requests))
        share = 1 if self.async_scheduling else self.max_concurrent_batches
        max_reqs = max(1, cdiv(active, share))
        draft = StepDraft()
        num_preempted_before = len(self._preempted_handles)
        budget = self._schedule_running(draft, self.max_num_batched_tokens, max_reqs)
        # Waiting requests only when nothing was preempted (the cache is full then).
        if len(self._preempted_handles) == num_preempted_before:
            budget = self._schedule_waiting(draft, budget, max_reqs)
        connector = self.kv_connector
        kv_orders = connector.metadata() if connector is not None else None
        if not draft and kv_orders is None and (connector is None or not connector.busy):
            return None
        step = draft.send(
            self.max_num_batched_tokens - budget,
            self._finished_handles,
            self._preempted_handles,
            self.send_token_ids,
            self.async_scheduling,
            kv_orders,
        )
        self._steps.append(step)
        self._finished_handles, self._preempted_handles = [], []
        return step.output

    def _schedule_running(self, draft: StepDraft, budget: int, max_reqs: int) -> int:
        """Running requests into draft: decodes first, then chunked prefills in progress;
        the budget left. On the engine's step path for every request: locals, no sort."""
        decodes: list[tuple[int, Request]] = []
        prefills: list[tuple[int, Request]] = []
        for r in self.running:
            if r.num_steps_in_flight and not (
                self.async_scheduling and r.continuable(self.max_model_len)
            ):
                continue
            # Tokens to compute before it samples again, those in flight will sample included.
            num_left = len(r.all_token_ids) + r.num_pending_samples - r.num_computed_tokens
            (prefills if num_left > 1 else decodes).append((num_left, r))
        allocate, add = self.kv.allocate_slots, draft.add_cached
        send_token_ids = self.send_token_ids
        num_reqs = num_prefill = 0
        for num_left, request in decodes + prefills:
            if budget == 0 or num_reqs == max_reqs:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted to make room for an older request
            num_new = min(num_left, budget)
            computed, known = request.num_computed_tokens, request.all_token_ids
            # Positions past the known tokens: what the steps in flight sample. Only the
            # last of them is this step's placeholder; the others those steps compute.
            unknown = max(0, computed + num_new - len(known))
            new_blocks = allocate(request.req_id, known, computed, num_new, (), unknown)
            if new_blocks is None:
                new_blocks = self._preempt_until_fits(request, num_new, unknown, draft)
                if new_blocks is None:
                    continue
            new_tokens = None
            if send_token_ids:
                # Tokens from position num_computed on; workers append those they lack.
                lacking = len(known) > self._num_tokens_sent[request.req_id]
                new_tokens = known[computed:] if lacking else []
                self._num_tokens_sent[request.req_id] = len(known)
            add(request, num_new, new_blocks, min(1, unknown), num_new == num_left, new_tokens)
            budget -= num_new
            num_reqs += 1
            if num_left > 1:
                num_prefill += num_new
        self.num_prefill_tokens += num_prefill
        return budget

    def _schedule_waiting(self, draft: StepDraft, budget: int, max_reqs: int) -> int:
        """Waiting requests into draft, in order, while they fit; the budget left."""
        while (
            self.waiting
            and budget > 0
            and len(draft) < max_reqs
            and len(self.running) < self.max_num_seqs
        ):
            request = self.waiting[0]
            if request.num_computed_tokens:  # its KV came from a prefill: blocks held
                hits, num_hit = [], request.num_computed_tokens
            else:
                computed = computed_prompt_blocks(request, self._requests, self.kv)
                if computed is None:
                    break  # its sibling computes the prompt they share: after that step
                hits, num_hit = computed
            num_new = min(request.num_tokens - num_hit, budget)
            new_blocks = self.kv.allocate_slots(
                request.req_id, request.all_token_ids, num_hit, num_new, hits
            )
            if new_blocks is None:
                break
            self.waiting.popleft()
            request.start_running()
            if request.handle is None:
                request.handle = self._handles.acquire()
            request.num_computed_tokens = request.num_cached_tokens = num_hit
            self.running.append(request)
            samples = num_new == request.num_tokens - num_hit
            draft.add_new(request, num_new, self.kv.block_ids(request.req_id), samples)
            self._num_tokens_sent[request.req_id] = request.num_tokens
            self.num_prefill_tokens += num_new
            budget -= num_new
        return budget

    def _preempt_until_fits(
        self, request: Request, num_new: int, unknown: int, draft: StepDraft
    ) -> list[int] | None:
        """Blocks for num_new more tokens of a running request that did not fit (unknown:
        its positions that steps in flight sample), preempting the newest preemptible
        running requests (in no step) until they do; None if request itself had to go,
        or there is nothing left to preempt."""
        while True:
            victim = next(
                (
                    r
                    for r in reversed(self.running)
                    if not r.num_steps_in_flight and r.handle not in draft.scheduled
                ),
                None,
            )
            if victim is None:
                return None  # all in flight: it waits for their steps to come back
            self._preempt(victim)
            if victim is request:
                return None
            new_blocks = self.kv.allocate_slots(
                request.req_id,
                request.all_token_ids,
                request.num_computed_tokens,
                num_new,
                num_placeholders=unknown,
            )
            if new_blocks is not None:
                return new_blocks

    def _preempt(self, request: Request) -> None:
        assert request.handle is not None
        self.running.remove(request)
        self.kv.free(request.req_id)
        self._preempted_handles.append(request.handle)
        self.num_preemptions += 1
        self._num_tokens_sent.pop(request.req_id, None)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    # -- consuming a step's output ------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[Request]:
        """Apply the sampled tokens of the oldest step in flight (which must be
        scheduler_output); return the requests that got a token or finished."""
        if not self._steps or self._steps[0].output is not scheduler_output:
            raise RuntimeError("step outputs must come back in the order the steps were made")
        step = self._steps.popleft()
        self._handles.release(step.finished_handles)
        requests, sampling = step.requests, step.sampling
        handles = runner_output.req_handles.tolist()
        tokens = runner_output.sampled_token_ids.tolist()
        step.check_output(handles, tokens)
        changed: list[Request] = []
        # Every request of the step comes once (checked above): one pass moves it on.
        for row, (handle, token) in enumerate(zip(handles, tokens, strict=True)):
            request = requests[handle]
            request.num_steps_in_flight -= 1
            samples = handle in sampling
            if samples:
                request.num_pending_samples -= 1
            if request.status is RequestStatus.FINISHED:
                continue  # aborted, or finished by an earlier step, while this one ran
            if token < 0:
                if samples:
                    raise RuntimeError(f"no token sampled for {request.req_id!r} (handle {handle})")
                continue
            if not samples:
                raise RuntimeError(
                    f"token {token} sampled for {request.req_id!r} (handle {handle}) in the "
                    "middle of its prefill"
                )
            finished = request.append_output_token(
                token, self.max_model_len, runner_output.logprobs, row
            )
            hold = not finished and request.remote_decode  # a decode instance goes on
            if hold:
                request.finish(FinishReason.LENGTH)
            if finished or hold:
                self.running.remove(request)
                self._release(request, hold)
            changed.append(request)
        if self._draining:
            for request in step.requests.values():
                if not request.num_steps_in_flight and request.req_id in self._draining:
                    del self._draining[request.req_id]
                    self.kv.free(request.req_id)
        if runner_output.kv_connector_output is not None:
            assert self.kv_connector is not None
            failed = self.kv_connector.update(
                runner_output.kv_connector_output, self.waiting.appendleft
            )
            for request in failed:
                del self._requests[request.req_id]
            changed += failed
        return changed

    def reset_after_failure(self) -> list[Request]:
        """Abort every request after a step failed (and every step in flight has been
        waited for): the workers may or may not have applied the failed step, so the next
        step reports every handle they could hold as finished (workers ignore finished
        handles they do not hold). Returns the aborted requests."""
        aborted = list(self._requests.values())
        for request in aborted:
            request.finish(FinishReason.ABORT)
        for request in [*aborted, *self._draining.values()]:
            self.kv.free(request.req_id)
        for request in aborted:
            request.handle = None
            request.num_steps_in_flight = request.num_pending_samples = 0
        self._finished_handles = self._handles.live_handles()
        self._preempted_handles = []
        self._requests.clear()
        self.waiting.clear()
        self.running.clear()
        self._draining.clear()
        self._steps.clear()
        self._num_tokens_sent.clear()
        if self.kv_connector is not None:
            self.kv_connector.reset()
        return aborted

    def _release(self, request: Request, hold_kv: bool = False) -> None:
        """Forget a finished request (out of the queues already): the next step tells the
        workers (their steps run in order, so one in flight still finds it); its blocks
        go once no step in flight computes it (hold_kv: once its KV is sent, which is
        later), its handle once the step that tells the workers has come back."""
        del self._requests[request.req_id]
        self._num_tokens_sent.pop(request.req_id, None)
        if hold_kv:
            assert self.kv_connector is not None
            self.kv_connector.hold(request)
        elif request.num_steps_in_flight:
            self._draining[request.req_id] = request
        else:
            self.kv.free(request.req_id)
        if request.handle is None:
            return  # the workers never saw it
        if request.handle in self._preempted_handles:
            # Preempted and finished before the workers heard: report it once, finished.
            self._preempted_handles.remove(request.handle)
        self._finished_handles.append(request.handle)
        request.handle = None
