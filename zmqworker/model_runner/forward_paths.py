"""The two ways a step's forward runs, each an object built whole with its buffers.

- TorchPath (the CPU's): the step's tensors and attention metadata are built per step
  (step_inputs.py) and the plain-torch model runs.
- TritonPath (CUDA's; kernels="triton" anywhere): the step is written into persistent
  device buffers with one copy (device_inputs.py), the previous step's samples are fed
  from the device, and decode steps replay CUDA graphs (cuda_graphs.py).

Both run a step over the token and block tables they are given (the batch's, or a dummy
step's) and return the logits of the requests that sample on the last pipeline stage,
the hidden states elsewhere. A decode graph also takes the argmax of its logits into
DeviceInputs.sampled: a step whose requests are all greedy needs no sampler launch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from messages import WorkerConfig
from zmqworker.attention.decode import AttentionGeometry
from zmqworker.attention.workspace import GatherWorkspace
from zmqworker.distributed.parallel_state import ParallelState
from zmqworker.model_runner.batch_update import ScheduledRequests
from zmqworker.model_runner.cuda_graphs import Capture, DecodeGraphs, default_graph_sizes
from zmqworker.model_runner.device_inputs import DeviceInputs, DeviceStep, TokenFeed
from zmqworker.model_runner.step_inputs import StepInputBuilder
from zmqworker.models.registry import CausalLM

HiddenStates = dict[str, torch.Tensor]
Output = torch.Tensor | HiddenStates
PreviousStage = Callable[[], HiddenStates | None]


@dataclass
class Forward:
    """A step's forward: out (logits of the requests that sample, or the hidden states
    on a stage before the last) and, when a decode graph ran with every request
    sampling, their greedy ids, int32 [num_reqs] on the device (else None)."""

    out: Output
    greedy_ids: torch.Tensor | None = None


def _token_index(step: ScheduledRequests, sample_index: np.ndarray) -> np.ndarray | None:
    """The step's token index of each sampling request's last position; None: every
    token samples (a decode step)."""
    if len(sample_index) == step.num_tokens:
        return None
    return np.cumsum(step.num_scheduled)[sample_index] - 1


def _logits(model: CausalLM, out: Output, index: torch.Tensor | None) -> Output:
    if isinstance(out, dict):
        return out
    if index is not None:
        out = out.index_select(0, index)
    return model.compute_logits(out)


class TorchPath:
    def __init__(self, model: CausalLM, config: WorkerConfig, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.graphs: DecodeGraphs | None = None
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
        previous_stage: PreviousStage,
        caches: list[torch.Tensor],
        feed: TokenFeed | None = None,
        use_graphs: bool = True,
    ) -> Forward:
        """previous_stage is called once the inputs are ready; feed and use_graphs are
        the Triton path's."""
        inputs = self._inputs.build(
            token_ids, block_table, step.rows, step.num_computed, step.num_scheduled,
            step.num_tokens,
        )  # fmt: skip
        hidden_in = previous_stage()
        token_index = _token_index(step, sample_index)
        index = None if token_index is None else torch.from_numpy(token_index).to(self.device)
        with torch.inference_mode():
            meta = inputs.attn_metadata
            out = self.model(inputs.input_ids, inputs.positions, caches, meta, hidden_in)
            return Forward(_logits(self.model, out, index))


class TritonPath:
    """capture: how a decode graph is captured (None: CUDA graphs on CUDA, none on the
    CPU); graphs are off with ModelConfig.enforce_eager."""

    def __init__(
        self,
        model: CausalLM,
        config: WorkerConfig,
        state: ParallelState,
        device: torch.device,
        max_model_len: int,
        max_blocks_per_req: int,
        capture: Capture | None,
    ) -> None:
        scheduler = config.scheduler
        self.model = model
        self.state = state
        self.device = device
        self.inputs = DeviceInputs(
            scheduler.max_num_batched_tokens,
            scheduler.max_num_seqs,
            max_blocks_per_req,
            config.cache.block_size,
            model.num_kv_heads,
            max_model_len,
            device,
        )
        self.graphs: DecodeGraphs | None = None
        if not config.model.enforce_eager and (capture is not None or device.type == "cuda"):
            limit = min(scheduler.max_num_seqs, scheduler.max_num_batched_tokens)
            sizes = list(scheduler.cuda_graph_sizes) or default_graph_sizes(limit)
            bad = [s for s in sizes if not 1 <= s <= limit]
            if bad:
                raise ValueError(
                    f"cuda_graph_sizes {bad} outside [1, {limit}] (max_num_seqs and "
                    "max_num_batched_tokens bound a decode step)"
                )
            self.graphs = DecodeGraphs(sizes, self._graph_body, self.inputs.idle_decode, capture)
        # The graphs' fixed inputs on later pipeline stages, and the caches they run over.
        self._graph_inputs: HiddenStates = {}
        self._graph_caches: list[torch.Tensor] = []

    def decode_kernel_sizes(self, max_reqs: int) -> list[int]:
        """The smallest batch size of each decode split count, and of each kernel choice
        the model makes by token count (the skinny projections' row tiles, the fused
        experts' tile sets: model.kernel_token_starts), up to max_reqs: a step compiles
        each of those kernels once."""
        sizes: dict[int, int] = {}
        for size in range(max_reqs, 0, -1):
            sizes[self.inputs.splits(size)] = size
        tiles = [s for s in self.model.kernel_token_starts() if s <= max_reqs]
        return sorted(set(sizes.values()) | set(tiles))

    def prefill_kernel_tokens(self, max_reqs: int, max_tokens: int) -> list[int]:
        """The token counts of the model's kernel choices (model.kernel_token_starts)
        that only steps of more tokens than requests reach: prefills."""
        return [s for s in self.model.kernel_token_starts() if max_reqs < s <= max_tokens]

    def run(
        self,
        token_ids: np.ndarray,
        block_table: np.ndarray,
        step: ScheduledRequests,
        sample_index: np.ndarray,
        previous_stage: PreviousStage,
        caches: list[torch.Tensor],
        feed: TokenFeed | None = None,
        use_graphs: bool = True,
    ) -> Forward:
        """previous_stage is called once the inputs are uploaded; feed: the previous
        step's samples still valid; use_graphs: replay a captured graph when one fits."""
        graph_size = None
        if use_graphs and self.graphs is not None and step.num_tokens == len(step):
            graph_size = self.graphs.size_for(len(step))
        token_index = _token_index(step, sample_index)
        inputs = self.inputs
        inputs.write(
            token_ids, block_table, step.rows, step.num_computed, step.num_scheduled,
            step.num_tokens, feed, token_index, pad_to=graph_size,
        )  # fmt: skip
        num_samples = None if token_index is None else len(token_index)
        hidden_in = previous_stage()
        if graph_size is not None:
            index = None if num_samples is None else inputs.sample_index(num_samples)
            return self._replay(graph_size, len(step), hidden_in, index)
        device_step = inputs.views(
            step.num_tokens, len(step), int(step.num_scheduled.max()), num_samples
        )
        with torch.inference_mode():
            if feed is not None:
                self._feed(device_step)
            meta = device_step.metadata
            out = self.model(device_step.input_ids, meta.positions, caches, meta, hidden_in)
            return Forward(_logits(self.model, out, device_step.sample_index))

    def capture_graphs(self, caches: list[torch.Tensor]) -> None:
        """Capture the decode graphs over these KV caches (again after a wake-up)."""
        if self.graphs is not None:
            self._graph_caches = caches
            self.graphs.capture_all()

    def release_buffers(self) -> None:
        """Drop the graphs with the buffers captured over the KV cache."""
        if self.graphs is not None:
            self.graphs.release()
        self._graph_inputs, self._graph_caches = {}, []

    def _feed(self, device_step: DeviceStep) -> None:
        """The previous step's samples into this step's input ids, on the device."""
        from zmqworker.model_runner.token_feed import feed_tokens

        feed_tokens(device_step.input_ids, device_step.feed_index, self.inputs.sampled)

    def _replay(
        self,
        size: int,
        num_reqs: int,
        hidden_in: HiddenStates | None,
        sample_index: torch.Tensor | None,
    ) -> Forward:
        assert self.graphs is not None
        if hidden_in is not None:
            for name, tensor in hidden_in.items():
                self._graph_inputs[name][:num_reqs].copy_(tensor)
        outputs = self.graphs.replay(size)
        if not self.state.is_last_stage:
            # The next replay reuses the graph's buffers; the pipeline sends these later.
            return Forward({name: t[:num_reqs].clone() for name, t in outputs.items()})
        logits = outputs["logits"][:num_reqs]
        if sample_index is not None:
            return Forward(logits.index_select(0, sample_index))
        return Forward(logits, self.inputs.sampled[:num_reqs])

    def _graph_body(self, size: int) -> HiddenStates:
        """A decode step of `size` rows over the persistent buffers, as a graph records it."""
        from zmqworker.model_runner.greedy_ids import greedy_ids

        model = self.model
        step = self.inputs.views(size, size, 1, None)
        hidden_in = None
        if not self.state.is_first_stage:
            if not self._graph_inputs:
                rows = max(self.graphs.sizes) if self.graphs else size
                buf = torch.zeros(rows, model.hidden_size, dtype=model.dtype, device=self.device)
                self._graph_inputs = {"hidden_states": buf, "residual": buf.clone()}
            hidden_in = {name: t[:size] for name, t in self._graph_inputs.items()}
        with torch.inference_mode():
            self._feed(step)
            meta = step.metadata
            out = model(step.input_ids, meta.positions, self._graph_caches, meta, hidden_in)
            if isinstance(out, dict):
                return out
            logits = model.compute_logits(out)
            # After the feed read the previous samples: this step's greedy ids take
            # their place (a sampler that runs after the replay overwrites them).
            greedy_ids(logits, self.inputs.sampled[:size])
            return {"logits": logits}
