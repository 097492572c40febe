"""A step's output whose sampled ids may still be on their way from the device.

On CUDA the sampled ids (and logprobs) are copied into pinned host memory with
non_blocking copies and an event is recorded after them; the worker can reply as soon as
is_ready() says the copy landed, without blocking the event loop. On the CPU there is
nothing to wait for.

It imports no torch (it only holds tensors): the worker process checks every reply
against this class, and a worker that runs no model needs no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from messages import KVConnectorOutput, LogprobsLists, ModelRunnerOutput, PromptLogprobs

if TYPE_CHECKING:
    import torch


class AsyncModelRunnerOutput:
    """Host tensors for the requests that sampled, placed into the full output on demand.

    sampled_index[i] is the output position of host row i; None means every request of
    the step sampled, in order.
    """

    def __init__(
        self,
        req_handles: np.ndarray,
        sampled_index: np.ndarray | None,
        sampled_token_ids: torch.Tensor,
        logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        event: torch.cuda.Event | None = None,
        prompt_logprobs: PromptLogprobs | None = None,
    ) -> None:
        self._req_handles = req_handles
        self._sampled_index = sampled_index
        self._sampled = sampled_token_ids
        self._logprobs = logprobs
        self._event = event
        self._prompt_logprobs = prompt_logprobs  # on the host already
        self._output: ModelRunnerOutput | None = None
        # The worker's, set after the step: the KV transfers that ended (kv_transfer/).
        self.kv_connector_output: KVConnectorOutput | None = None

    def is_ready(self) -> bool:
        """True when get_output() will not wait. Never blocks."""
        return self._event is None or self._event.query()

    def get_output(self) -> ModelRunnerOutput:
        """The step's ModelRunnerOutput; waits for the device-to-host copy if needed."""
        if self._output is None:
            if self._event is not None:
                self._event.synchronize()
            self._output = self._build()
        return self._output

    def _build(self) -> ModelRunnerOutput:
        tokens = self._place(self._sampled.numpy(), fill=-1)
        logprobs = None
        if self._logprobs is not None:
            ids, values, ranks = (t.numpy() for t in self._logprobs)
            logprobs = LogprobsLists(
                logprob_token_ids=self._place(ids, fill=-1),
                logprobs=self._place(values, fill=-np.inf),
                sampled_token_ranks=self._place(ranks, fill=-1),
            )
        return ModelRunnerOutput(
            req_handles=self._req_handles,
            sampled_token_ids=tokens,
            logprobs=logprobs,
            kv_connector_output=self.kv_connector_output,
            prompt_logprobs=self._prompt_logprobs,
        )

    def _place(self, values: np.ndarray, fill: float) -> np.ndarray:
        """values (one row per sampling request) spread over every request of the step;
        the requests that did not sample get fill (-1 ids, -inf logprobs)."""
        if self._sampled_index is None:
            return values
        full = np.full((len(self._req_handles), *values.shape[1:]), fill, values.dtype)
        full[self._sampled_index] = values
        return full
