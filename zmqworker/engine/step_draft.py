"""One step as the scheduler fills it (StepDraft), and what it remembers of the step
until its output is back (SentStep)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from messages import CachedRequestData, KVConnectorMetadata, NewRequestData, SchedulerOutput
from zmqworker.engine.request import Request


@dataclass
class SentStep:
    """A step sent to the workers and not yet answered."""

    output: SchedulerOutput
    requests: dict[int, Request]  # handle -> request scheduled in it
    sampling: set[int]  # handles whose token this step samples
    finished_handles: list[int]  # the finishes it reports to the workers
    structured: list[Request]  # those it samples for that have a grammar

    def check_output(self, handles: list[int], tokens: list[int]) -> None:
        """Raise unless the output names exactly the step's requests, a token each; the
        step is counted back then (its requests are no longer in flight)."""
        requests = self.requests
        if len(handles) == len(tokens) == len(requests) and requests.keys() == set(handles):
            return
        for handle, request in requests.items():
            request.num_steps_in_flight -= 1
            if handle in self.sampling:
                request.num_pending_samples -= 1
        raise RuntimeError(
            f"ModelRunnerOutput names handles {sorted(handles)} with {len(tokens)} tokens; "
            f"the step scheduled {sorted(requests)}"
        )


class StepDraft:
    """The requests of a step being built: cached ones as deltas, then new ones whole.
    Nothing of a request changes until send() (its counts are read as they were)."""

    def __init__(self) -> None:
        self.scheduled: dict[int, Request] = {}  # handle -> request, in step order
        self.sampling: set[int] = set()
        self.new_reqs: list[NewRequestData] = []
        self._handles: list[int] = []
        self._computed: list[int] = []
        self._num_new: list[int] = []
        self._blocks: list[list[int]] = []
        self._tokens: list[list[int]] = []
        self._placeholders: list[int] = []

    def __len__(self) -> int:
        return len(self.scheduled)

    def add_cached(
        self,
        request: Request,
        num_new: int,
        new_blocks: list[int],
        placeholders: int,
        samples: bool,
        new_tokens: list[int] | None = None,
    ) -> None:
        assert request.handle is not None
        self.scheduled[request.handle] = request
        if samples:
            self.sampling.add(request.handle)
        self._handles.append(request.handle)
        self._computed.append(request.num_computed_tokens)
        self._num_new.append(num_new)
        self._blocks.append(new_blocks)
        self._placeholders.append(placeholders)
        if new_tokens is not None:
            self._tokens.append(new_tokens)

    def add_new(self, request: Request, num_new: int, block_ids: list[int], samples: bool) -> None:
        """A request the workers do not hold, from num_computed_tokens (prefix hits) on."""
        assert request.handle is not None
        self.scheduled[request.handle] = request
        if samples:
            self.sampling.add(request.handle)
        self.new_reqs.append(
            NewRequestData(
                req_id=request.req_id,
                req_handle=request.handle,
                prompt_token_ids=np.array(request.all_token_ids, np.int32),
                sampling_params=request.sampling_params,
                block_ids=np.array(block_ids, np.int32),
                num_scheduled_tokens=num_new,
                num_computed_tokens=request.num_computed_tokens,
                num_output_tokens=len(request.output_token_ids),
                eos_token_ids=request.eos_token_list,
            )
        )

    def send(
        self,
        num_tokens: int,
        finished: list[int],
        preempted: list[int],
        send_token_ids: bool,
        with_placeholders: bool,
        kv_connector_metadata: KVConnectorMetadata | None = None,
    ) -> SentStep:
        """The SchedulerOutput, and the requests moved on: their tokens counted as
        computed, the step counted in flight (and its samples as pending)."""
        output = SchedulerOutput(
            scheduled_new_reqs=self.new_reqs,
            scheduled_cached_reqs=CachedRequestData.build(
                self._handles,
                self._computed,
                self._num_new,
                new_block_ids=self._blocks,
                new_token_ids=self._tokens if send_token_ids else None,
                num_placeholders=self._placeholders if with_placeholders else None,
            ),
            total_num_scheduled_tokens=num_tokens,
            finished_req_handles=finished,
            preempted_req_handles=preempted,
            kv_connector_metadata=kv_connector_metadata,
        )
        scheduled = self.scheduled
        for data in self.new_reqs:
            request = scheduled[data.req_handle]
            request.num_computed_tokens += data.num_scheduled_tokens
            request.num_steps_in_flight += 1
        for handle, num in zip(self._handles, self._num_new, strict=True):
            request = scheduled[handle]
            request.num_computed_tokens += num
            request.num_steps_in_flight += 1
        structured = []
        for handle in self.sampling:
            request = scheduled[handle]
            request.num_pending_samples += 1
            if request.grammar is not None:
                structured.append(request)
        return SentStep(output, scheduled, self.sampling, finished, structured)
