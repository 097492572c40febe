"""The two ways a step's forward runs, each an object built whole with its buffers.

- TorchPath (the CPU's, here): the step's tensors and attention metadata are built per
  step (step_inputs.py) and the plain-torch model runs.
- TritonPath (CUDA's; kernels="triton" anywhere, triton_path.py): persistent device
  inputs, the token feed on the device, CUDA graphs.

Both run a step over the token and block tables they are given (the batch's, or a dummy
step's) and return a Forward: the logits of the requests that sample on the last
pipeline stage, the hidden states elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from messages import WorkerConfig
from zmqworker.attention.decode import AttentionGeometry
from zmqworker.attention.workspace import GatherWorkspace
from zmqworker.model_runner.batch_update import ScheduledRequests
from zmqworker.model_runner.cuda_graphs import StepGraphs
from zmqworker.model_runner.device_inputs import TokenFeed
from zmqworker.model_runner.step_inputs import StepInputBuilder
from zmqworker.models.registry import CausalLM

HiddenStates = dict[str, torch.Tensor]
Output = torch.Tensor | HiddenStates


@dataclass
class Forward:
    """A step's forward: out (logits of the requests that sample, or the hidden states
    on a stage before the last) and, when a graph took their argmax, their greedy ids,
    int32 [len(out)] on the device (else None). kept: the final hidden states of the
    tokens the run was asked to keep (prompt logprobs), in that order."""

    out: Output
    greedy_ids: torch.Tensor | None = None
    kept: torch.Tensor | None = None


def token_index(step: ScheduledRequests, sample_index: np.ndarray) -> np.ndarray | None:
    """The step's token index of each sampling request's last position; None: every
    token samples (a decode step)."""
    if len(sample_index) == step.num_tokens:
        return None
    return np.cumsum(step.num_scheduled)[sample_index] - 1


def kept_rows(out: Output, keep: np.ndarray | None) -> torch.Tensor | None:
    """The final hidden states of the step's tokens keep (None: none asked, or a stage
    before the last)."""
    if keep is None or isinstance(out, dict):
        return None
    return out.index_select(0, torch.from_numpy(keep).to(out.device))


def logits_of(model: CausalLM, out: Output, index: torch.Tensor | None) -> Output:
    if isinstance(out, dict):
        return out
    if index is not None:
        out = out.index_select(0, index)
    return model.compute_logits(out)


class TorchPath:
    def __init__(self, model: CausalLM, config: WorkerConfig, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.graphs: StepGraphs | None = None
        self.token_graphs: StepGraphs | None = None
        # Sized from the KV cache's blocks: given back with the cache (release_buffers).
        self.workspace = GatherWorkspace()
        geometry = AttentionGeometry(
            model.num_heads, model.num_kv_heads, model.head_dim, model.dtype
        )
        self._inputs = StepInputBuilder(
            config.scheduler.max_num_batched_tokens,
            config.scheduler.max_num_seqs,
            config.cache.block_size,
            geometry,
            self.workspace,
            device,
        )

    def release_buffers(self) -> None:
        self.workspace.release()

    def decode_kernel_sizes(self, max_reqs: int) -> list[int]:
        """Batch sizes whose eager decode steps run kernels of their own: none here."""
        return []

    def prefill_kernel_tokens(self, max_reqs: int, max_tokens: int) -> list[int]:
        """Token counts whose prefill steps run kernels of their own: none here."""
        return []

    def run(
        self,
        token_ids: np.ndarray,
        block_table: np.ndarray,
        step: ScheduledRequests,
        sample_index: np.ndarray,
        hidden_in: HiddenStates | None,
        caches: list[torch.Tensor],
        feed: TokenFeed | None = None,
        use_graphs: bool = True,
        keep: np.ndarray | None = None,
    ) -> Forward:
        """hidden_in: the previous stage's tensors (None on the first); feed and
        use_graphs are the Triton path's; keep: step tokens whose final hidden states to
        return too."""
        inputs = self._inputs.build(
            token_ids, block_table, step.rows, step.num_computed, step.num_scheduled,
            step.num_tokens,
        )  # fmt: skip
        rows = token_index(step, sample_index)
        index = None if rows is None else torch.from_numpy(rows).to(self.device)
        with torch.inference_mode():
            meta = inputs.attn_metadata
            out = self.model(inputs.input_ids, inputs.positions, caches, meta, hidden_in)
            return Forward(logits_of(self.model, out, index), kept=kept_rows(out, keep))
