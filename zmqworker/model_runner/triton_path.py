"""The Triton path of a step's forward (CUDA's; kernels="triton" anywhere): the step is
written into persistent device buffers with one copy (device_inputs.py), the previous
step's samples are fed from the device, and steps replay CUDA graphs (cuda_graphs.py):
decode steps a decode graph, any other step of up to max_num_batched_tokens tokens a
token graph. Eager (enforce_eager, and the dummy steps) stays the reference.

A graph on the last stage also takes the argmax of its logits into DeviceInputs.sampled
(after the feed has read the previous samples there), for the step's sampling rows only:
a step whose requests are all greedy needs no sampler launch, and one that samples
nothing leaves the previous samples for the next step's feed.
"""

from __future__ import annotations

import numpy as np
import torch

from messages import WorkerConfig
from zmqworker.attention.triton_metadata import PREFETCH_REQS
from zmqworker.distributed.parallel_state import ParallelState
from zmqworker.model_runner.batch_update import ScheduledRequests
from zmqworker.model_runner.cuda_graphs import (
    Capture,
    StepGraphs,
    capture_all,
    default_graph_sizes,
    default_token_sizes,
    token_graph_reqs,
)
from zmqworker.model_runner.device_inputs import DeviceInputs, DeviceStep, TokenFeed
from zmqworker.model_runner.forward_paths import (
    Forward,
    HiddenStates,
    kept_rows,
    logits_of,
    token_index,
)
from zmqworker.models.registry import CausalLM


class TritonPath:
    """capture: how a graph is captured (None: CUDA graphs on CUDA, none on the CPU);
    graphs are off with ModelConfig.enforce_eager."""

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
        self.max_num_reqs = min(scheduler.max_num_seqs, scheduler.max_num_batched_tokens)
        self.inputs = DeviceInputs(
            scheduler.max_num_batched_tokens,
            scheduler.max_num_seqs,
            max_blocks_per_req,
            config.cache.block_size,
            model.num_kv_heads,
            max_model_len,
            device,
        )
        from zmqworker.model_runner.greedy_ids import GreedyIds

        # A graph's argmax into the samples' buffer, as many rows as it holds.
        self._greedy_ids = GreedyIds(len(self.inputs.sampled), device)
        self._capture = capture
        # The graphs' static outputs, shared by both sets.
        self._outputs: dict[str, torch.Tensor] = {}
        self.graphs: StepGraphs | None = None
        self.token_graphs: StepGraphs | None = None
        if not config.model.enforce_eager and (capture is not None or device.type == "cuda"):
            limit = self.max_num_reqs
            sizes = list(scheduler.cuda_graph_sizes) or default_graph_sizes(limit)
            bad = [s for s in sizes if not 1 <= s <= limit]
            if bad:
                raise ValueError(
                    f"cuda_graph_sizes {bad} outside [1, {limit}] (max_num_seqs and "
                    "max_num_batched_tokens bound a decode step)"
                )
            self.graphs = StepGraphs(
                "decode", sizes, self._decode_body, self.inputs.idle_decode, self._outputs
            )
            tokens = default_token_sizes(scheduler.max_num_batched_tokens)
            if tokens:
                self.token_graphs = StepGraphs(
                    "token", tokens, self._token_body, self._idle_tokens, self._outputs
                )
        # The graphs' fixed inputs on later pipeline stages, and the caches they run over.
        self._graph_inputs: HiddenStates = {}
        self._graph_caches: list[torch.Tensor] = []

    def decode_kernel_sizes(self, max_reqs: int) -> list[int]:
        """The smallest batch size of each decode split count and of the decode kernel
        without its history prefetch, and of each kernel choice the model makes by token
        count (the skinny projections' row tiles, the fused experts' tile sets:
        model.kernel_token_starts), up to max_reqs: a step compiles each of those
        kernels once."""
        sizes: dict[int, int] = {}
        for size in range(max_reqs, 0, -1):
            sizes[self.inputs.splits(size)] = size
        starts = [*self.model.kernel_token_starts(), PREFETCH_REQS + 1]
        return sorted(set(sizes.values()) | {s for s in starts if s <= max_reqs})

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
        hidden_in: HiddenStates | None,
        caches: list[torch.Tensor],
        feed: TokenFeed | None = None,
        use_graphs: bool = True,
        keep: np.ndarray | None = None,
    ) -> Forward:
        """hidden_in: the previous stage's tensors (None on the first); feed: the previous
        step's samples still valid; use_graphs: replay a captured graph when one fits;
        keep: step tokens whose final hidden states to return too (no graph keeps them)."""
        use_graphs = use_graphs and keep is None
        num_tokens, num_reqs = step.num_tokens, len(step)
        decode_size = token_size = None
        if use_graphs and self.graphs is not None and num_tokens == num_reqs:
            decode_size = self.graphs.size_for(num_reqs)
        if use_graphs and decode_size is None and self.token_graphs is not None:
            token_size = self.token_graphs.size_for(num_tokens)
        index = token_index(step, sample_index)
        pad_tokens = None
        if token_size is not None:
            pad_tokens = (token_size, token_graph_reqs(token_size, self.max_num_reqs))
            if index is None:  # a decode step in a token graph: every token samples
                index = np.arange(num_tokens)
        inputs = self.inputs
        inputs.write(
            token_ids, block_table, step.rows, step.num_computed, step.num_scheduled,
            num_tokens, feed, index, pad_to=decode_size, pad_tokens=pad_tokens,
        )  # fmt: skip
        num_samples = None if index is None else len(index)
        if decode_size is not None:
            sample_rows = None if num_samples is None else inputs.sample_index(num_samples)
            return self._replay_decode(decode_size, num_reqs, hidden_in, sample_rows)
        if token_size is not None:
            assert num_samples is not None
            return self._replay_tokens(token_size, num_tokens, num_samples, hidden_in)
        device_step = inputs.views(num_tokens, num_reqs, int(step.num_scheduled.max()), num_samples)
        with torch.inference_mode():
            if feed is not None:
                self._feed(device_step)
            meta = device_step.metadata
            out = self.model(device_step.input_ids, meta.positions, caches, meta, hidden_in)
            logits = logits_of(self.model, out, device_step.sample_index)
            return Forward(logits, kept=kept_rows(out, keep))

    def capture_graphs(self, caches: list[torch.Tensor]) -> None:
        """Capture the graphs over these KV caches (again after a wake-up): the token
        graphs first, whose largest has the largest outputs."""
        sets = [g for g in (self.token_graphs, self.graphs) if g is not None]
        if not sets:
            return
        self._graph_caches = caches
        if not self.state.is_first_stage and not self._graph_inputs:
            rows = max(g.sizes[-1] for g in sets)
            model = self.model
            buf = torch.zeros(rows, model.hidden_size, dtype=model.dtype, device=self.device)
            self._graph_inputs = {"hidden_states": buf, "residual": buf.clone()}
        capture_all(sets, self._capture, self.device)

    def release_buffers(self) -> None:
        """Drop the graphs with the buffers captured over the KV cache."""
        for graphs in (self.graphs, self.token_graphs):
            if graphs is not None:
                graphs.release()
        self._outputs.clear()
        self._graph_inputs, self._graph_caches = {}, []

    def _feed(self, device_step: DeviceStep) -> None:
        """The previous step's samples into this step's input ids, on the device."""
        from zmqworker.model_runner.token_feed import feed_tokens

        feed_tokens(device_step.input_ids, device_step.feed_index, self.inputs.sampled)

    def _copy_in(self, hidden_in: HiddenStates | None, rows: int) -> None:
        if hidden_in is not None:
            for name, tensor in hidden_in.items():
                self._graph_inputs[name][:rows].copy_(tensor)

    def _replay_decode(
        self,
        size: int,
        num_reqs: int,
        hidden_in: HiddenStates | None,
        sample_index: torch.Tensor | None,
    ) -> Forward:
        assert self.graphs is not None
        self._copy_in(hidden_in, num_reqs)
        outputs = self.graphs.replay(size)
        if not self.state.is_last_stage:
            # The next replay reuses the graph's buffers; the pipeline sends these later.
            return Forward({name: t[:num_reqs].clone() for name, t in outputs.items()})
        logits = outputs["logits"][:num_reqs]
        if sample_index is not None:
            return Forward(logits.index_select(0, sample_index))
        return Forward(logits, self.inputs.sampled[:num_reqs])

    def _replay_tokens(
        self, size: int, num_tokens: int, num_samples: int, hidden_in: HiddenStates | None
    ) -> Forward:
        """A token graph's logits are those of the sampling requests, in order."""
        assert self.token_graphs is not None
        self._copy_in(hidden_in, num_tokens)
        outputs = self.token_graphs.replay(size)
        if not self.state.is_last_stage:
            return Forward({name: t[:num_tokens].clone() for name, t in outputs.items()})
        logits = outputs["logits"][:num_samples]
        return Forward(logits, self.inputs.sampled[:num_samples])

    def _stage_inputs(self, rows: int) -> HiddenStates | None:
        if self.state.is_first_stage:
            return None
        return {name: t[:rows] for name, t in self._graph_inputs.items()}

    def _decode_body(self, size: int) -> HiddenStates:
        """A decode step of `size` rows over the persistent buffers, as a graph records it."""
        step = self.inputs.views(size, size, 1, None)
        return self._graph_forward(step, self._stage_inputs(size))

    def _token_body(self, size: int) -> HiddenStates:
        """A step of `size` tokens (any mix of prefills and decodes) over the persistent
        buffers, as a graph records it: the logits of as many sample rows as such a step
        can have (its sample index pads the rest with token 0)."""
        reqs = token_graph_reqs(size, self.max_num_reqs)
        step = self.inputs.views(size, reqs, size, min(self.max_num_reqs, size))
        return self._graph_forward(step, self._stage_inputs(size))

    def _idle_tokens(self, size: int) -> None:
        self.inputs.idle_tokens(size, token_graph_reqs(size, self.max_num_reqs))

    def _graph_forward(self, step: DeviceStep, hidden_in: HiddenStates | None) -> HiddenStates:
        model = self.model
        with torch.inference_mode():
            self._feed(step)
            meta = step.metadata
            out = model(step.input_ids, meta.positions, self._graph_caches, meta, hidden_in)
            if isinstance(out, dict):
                return out
            logits = logits_of(model, out, step.sample_index)
            assert isinstance(logits, torch.Tensor)
            # After the feed read the previous samples: this step's greedy ids take
            # their place (a sampler that runs after the replay overwrites them), as many
            # as the step samples. Rows past them (padding, or all of them in a step that
            # samples nothing) keep the previous samples, which a later feed may read.
            inputs = self.inputs
            self._greedy_ids(logits, inputs.sampled[: logits.shape[0]], inputs.sample_count)
            return {"logits": logits}
