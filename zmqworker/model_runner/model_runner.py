"""The model runner: this rank's model, its paged KV cache and the persistent batch.

Each step: the SchedulerOutput's deltas update the persistent batch (validated first, so a
bad step changes nothing), the step's flat inputs are gathered from it, the model runs,
and on the last pipeline stage the last position of every request that reached the end
of its known tokens is turned into logits and sampled.

Two input paths share that step. The plain-torch path (the CPU's) builds tensors and
attention metadata per step. The Triton path (CUDA's; kernels="triton" anywhere) writes
the step into persistent device buffers with one copy (device_inputs.py), takes the
previous step's samples from the device, and replays a CUDA graph for decode steps
(cuda_graphs.py); nothing in it waits for the device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from messages import (
    GrammarOutput,
    IntermediateTensors,
    KVCacheConfig,
    KVCacheSpec,
    SchedulerOutput,
    WorkerConfig,
)
from zmqworker.attention.kv_cache import allocate_kv_cache, release_workspaces
from zmqworker.distributed.parallel_state import ParallelState
from zmqworker.distributed.pp_channel import PendingTensors
from zmqworker.model_runner.async_output import AsyncModelRunnerOutput
from zmqworker.model_runner.batch_update import ScheduledRequests
from zmqworker.model_runner.cuda_graphs import Capture, DecodeGraphs, default_graph_sizes
from zmqworker.model_runner.device_inputs import DeviceInputs, DeviceStep, TokenFeed
from zmqworker.model_runner.dummy_steps import DummySteps
from zmqworker.model_runner.grammar import apply_grammar_bitmask
from zmqworker.model_runner.input_batch import InputBatch
from zmqworker.model_runner.sampled_tokens import (
    Samples,
    record_samples,
    to_host,
    token_feed,
    write_samples,
)
from zmqworker.model_runner.sampler import Sampler, SamplingMetadata
from zmqworker.model_runner.step_inputs import StepInputBuilder
from zmqworker.models.registry import build_model, torch_dtype

KERNELS = ("auto", "torch", "triton")
HiddenStates = dict[str, torch.Tensor]


@dataclass
class _StepLogits:
    """A step run up to its logits, waiting to be sampled."""

    step: ScheduledRequests
    sample_index: np.ndarray  # positions in step of the requests that sample
    logits: torch.Tensor  # float32 [len(sample_index), vocab]


def uses_triton(kernels: str, device: torch.device) -> bool:
    if kernels not in KERNELS:
        raise ValueError(f"device.kernels must be one of {', '.join(KERNELS)}, got {kernels!r}")
    return kernels == "triton" or (kernels == "auto" and device.type == "cuda")


class ModelRunner:
    """Complete once constructed: the model is loaded and the batch and input buffers
    exist; the KV cache comes with initialize_kv_cache. graph_capture replaces CUDA graph
    capture (tests on the CPU pass a recorder); None captures graphs only on CUDA."""

    def __init__(
        self, config: WorkerConfig, state: ParallelState, graph_capture: Capture | None = None
    ) -> None:
        scheduler = config.scheduler
        if scheduler.max_num_seqs < 1 or scheduler.max_num_batched_tokens < 1:
            raise ValueError(
                f"scheduler max_num_seqs ({scheduler.max_num_seqs}) and max_num_batched_tokens "
                f"({scheduler.max_num_batched_tokens}) must be >= 1"
            )
        if config.cache.block_size < 1:
            raise ValueError(f"cache block_size must be >= 1, got {config.cache.block_size}")
        self.config = config
        self.state = state
        self.device = torch.device(state.device)
        self.block_size = config.cache.block_size
        self.fused = uses_triton(config.device.kernels, self.device)
        self.model = build_model(config.model, state, fused=self.fused)
        self.max_model_len = (
            config.model.max_model_len or self.model.hf_config.max_position_embeddings
        )
        self.max_num_reqs = min(scheduler.max_num_seqs, scheduler.max_num_batched_tokens)
        self.batch = InputBatch(
            max_num_seqs=scheduler.max_num_seqs,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=scheduler.max_num_batched_tokens,
            block_size=self.block_size,
            vocab_size=self.model.vocab_size,
            device=self.device,
        )
        self.kv_caches: list[torch.Tensor] = []
        self.sampler = Sampler()
        self._torch_inputs: StepInputBuilder | None = None
        self._device_inputs: DeviceInputs | None = None
        if self.fused:
            self._device_inputs = DeviceInputs(
                scheduler.max_num_batched_tokens,
                scheduler.max_num_seqs,
                self.batch.max_blocks_per_req,
                self.block_size,
                self.model.num_kv_heads,
                self.max_model_len,
                self.device,
            )
        else:
            self._torch_inputs = StepInputBuilder(
                scheduler.max_num_batched_tokens,
                scheduler.max_num_seqs,
                self.block_size,
                self.device,
            )
        self._stream = (
            torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        )
        self.graphs = self._make_graphs(graph_capture)
        self._graph_inputs: HiddenStates = {}
        self._step_logits: _StepLogits | None = None
        self._samples: Samples | None = None
        self.dummy = DummySteps(self)

    # start-up -------------------------------------------------------------------------

    def get_kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec(
            block_size=self.block_size,
            num_kv_heads=self.model.num_kv_heads,
            head_size=self.model.head_dim,
            dtype=self._cache_dtype_name(),
            layer_names=list(self.model.layer_names),
        )

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        """Allocate kv_cache_config.num_blocks blocks for each of this rank's layers."""
        spec = self.get_kv_cache_spec()
        num_blocks = kv_cache_config.num_blocks
        if num_blocks < 1:
            raise ValueError(f"KV cache config has {num_blocks} blocks; at least 1 is needed")
        _check_kv_cache_config(kv_cache_config, spec)
        self.release_kv_cache()
        self.kv_caches = [self.new_cache(num_blocks) for _ in spec.layer_names]
        self.batch.num_kv_blocks = num_blocks

    def new_cache(self, num_blocks: int) -> torch.Tensor:
        spec = self.get_kv_cache_spec()
        return allocate_kv_cache(
            num_blocks,
            spec.block_size,
            spec.num_kv_heads,
            spec.head_size,
            torch_dtype(spec.dtype),
            self.device,
        )

    def release_kv_cache(self) -> None:
        """Drop the cache, the graphs captured over it and the attention's gather
        workspaces sized from it (sleep and shutdown must give all back)."""
        if self.graphs is not None:
            self.graphs.release()
        self.kv_caches = []
        release_workspaces()
        self.batch.num_kv_blocks = 0

    def profile_run(self) -> None:
        """The dummy steps of peak-memory profiling (dummy_steps.py)."""
        self.dummy.profile()

    def warm_up(self, batch_sizes: list[int]) -> None:
        """Dummy decode steps at each batch size, then the CUDA graphs, if any."""
        self.dummy.warm_up(batch_sizes)
        self.capture_graphs()

    def capture_graphs(self) -> None:
        """Capture the decode graphs over the current KV cache (again after a wake-up)."""
        if self.graphs is not None and self.kv_caches:
            self.graphs.capture_all()

    def probe_graph_memory(self) -> int:
        """Bytes the decode graphs hold once captured, measured by capturing them over a
        one-block cache and releasing them: what the KV cache budget must leave free."""
        if self.graphs is None or self.device.type != "cuda":
            return 0
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free_before = torch.cuda.mem_get_info()[0]
        real, self.kv_caches = self.kv_caches, [self.new_cache(1)] * len(self.model.layer_names)
        try:
            self.graphs.capture_all()
            torch.cuda.synchronize()
            used = free_before - torch.cuda.mem_get_info()[0]
        finally:
            self.graphs.release()
            self._graph_inputs = {}
            self.kv_caches = real
            torch.cuda.empty_cache()
        return max(0, used)

    # steps ----------------------------------------------------------------------------

    def execute_model(
        self,
        scheduler_output: SchedulerOutput,
        intermediate_tensors: IntermediateTensors | PendingTensors | None = None,
        sample: bool = True,
    ) -> AsyncModelRunnerOutput | IntermediateTensors | None:
        """Run one step. Non-last pipeline stages return IntermediateTensors; the last
        returns an AsyncModelRunnerOutput, or None with sample=False (then call
        sample_tokens)."""
        if self._step_logits is not None:
            raise RuntimeError("execute_model before sample_tokens consumed the previous step")
        if scheduler_output.total_num_scheduled_tokens > 0 and not self.kv_caches:
            raise RuntimeError("execute_model before initialize_kv_cache: there is no KV cache")
        # Tensors still on their way from the previous stage are waited for only once
        # this step's inputs are ready, so their transfer overlaps the preparation.
        pending = intermediate_tensors if isinstance(intermediate_tensors, PendingTensors) else None
        hidden_in = (
            None if pending else self._intermediate_inputs(intermediate_tensors, scheduler_output)
        )
        # Parking a preempted request copies its tokens: they must all be on the host.
        wait = not self.fused or bool(scheduler_output.preempted_req_handles)
        write_samples(self.batch, self._samples, wait=wait)
        step = self.batch.update(scheduler_output)
        if len(step) == 0:
            return self._finish_empty_step(step, sample)

        def previous_stage() -> HiddenStates | None:
            if pending is None:
                return hidden_in
            return self._intermediate_inputs(pending.wait(), scheduler_output)

        sample_index = self._sample_index(step)
        batch = self.batch
        feed = token_feed(batch, self._samples) if self.fused else None
        out = self.forward(
            batch.token_ids,
            batch.block_table,
            step,
            sample_index,
            previous_stage,
            self.kv_caches,
            feed,
        )
        if not self.state.is_last_stage:
            assert isinstance(out, dict)
            return IntermediateTensors(out)
        assert isinstance(out, torch.Tensor)
        step_logits = _StepLogits(step, sample_index, out)
        if not sample:
            self._step_logits = step_logits
            return None
        return self._sample(step_logits, None)

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> AsyncModelRunnerOutput:
        """Sample the logits kept by execute_model(sample=False), after applying the
        grammar bitmask of the requests it names."""
        if self._step_logits is None:
            raise RuntimeError("sample_tokens without a preceding execute_model(sample=False)")
        # A rejected grammar output leaves the logits pending: the caller may retry.
        output = self._sample(self._step_logits, grammar_output)
        self._step_logits = None
        return output

    def shutdown(self) -> None:
        """Drop the KV cache, the graphs and anything in flight; safe to call twice."""
        write_samples(self.batch, self._samples, wait=True)
        self._samples = None
        self._step_logits = None
        self.release_kv_cache()

    # the forward ----------------------------------------------------------------------

    def _sample_index(self, step: ScheduledRequests) -> np.ndarray:
        """Positions in step of the requests that reached the end of their known tokens;
        the others are mid chunked prefill and need no logits."""
        if not self.state.is_last_stage:
            return np.zeros(0, np.int64)
        ends = step.num_computed + step.num_scheduled
        return np.flatnonzero(ends == self.batch.num_tokens[step.rows])

    def forward(
        self,
        token_ids: np.ndarray,
        block_table: np.ndarray,
        step: ScheduledRequests,
        sample_index: np.ndarray,
        previous_stage: Callable[[], HiddenStates | None],
        caches: list[torch.Tensor],
        feed: TokenFeed | None = None,
        use_graphs: bool = True,
    ) -> torch.Tensor | HiddenStates:
        """Run a step's forward over the given token and block tables (the batch's, or a
        dummy step's) and caches: the sampling requests' logits on the last stage, the
        hidden states elsewhere. previous_stage is called once the inputs are ready."""
        ends = np.cumsum(step.num_scheduled)
        # Token index of each sampling request's last position; None: every token samples.
        token_index = None if len(sample_index) == step.num_tokens else ends[sample_index] - 1
        args = (token_ids, block_table, step.rows, step.num_computed, step.num_scheduled)
        if self._device_inputs is None:
            assert self._torch_inputs is not None
            inputs = self._torch_inputs.build(*args, step.num_tokens)
            meta = inputs.attn_metadata
            hidden_in = previous_stage()
            with torch.inference_mode():
                out = self.model(inputs.input_ids, inputs.positions, caches, meta, hidden_in)
                index = None if token_index is None else torch.from_numpy(token_index)
                return self._outputs(out, index)
        graph_size = None
        if use_graphs and self.graphs is not None and step.num_tokens == len(step):
            graph_size = self.graphs.size_for(len(step))
        inputs = self._device_inputs
        inputs.write(*args, step.num_tokens, feed, token_index, pad_to=graph_size)
        sample_index = None if token_index is None else inputs.sample_index(len(token_index))
        hidden_in = previous_stage()
        if graph_size is not None:
            return self._replay(graph_size, len(step), hidden_in, sample_index)
        num_samples = None if token_index is None else len(token_index)
        device_step = inputs.views(
            step.num_tokens, len(step), int(step.num_scheduled.max()), num_samples
        )
        with torch.inference_mode():
            if feed is not None:
                self._feed(device_step)
            meta = device_step.metadata
            out = self.model(device_step.input_ids, meta.positions, caches, meta, hidden_in)
            return self._outputs(out, device_step.sample_index)

    def _outputs(
        self, out: torch.Tensor | HiddenStates, token_index: torch.Tensor | None
    ) -> torch.Tensor | HiddenStates:
        if isinstance(out, dict):
            return out
        if token_index is not None:
            out = out.index_select(0, token_index.to(self.device))
        return self.model.compute_logits(out)

    def _feed(self, device_step: DeviceStep) -> None:
        """The previous step's samples into this step's input ids, on the device."""
        from zmqworker.model_runner.token_feed import feed_tokens

        assert self._device_inputs is not None
        feed_tokens(device_step.input_ids, device_step.feed_index, self._device_inputs.sampled)

    def _replay(
        self,
        size: int,
        num_reqs: int,
        hidden_in: HiddenStates | None,
        sample_index: torch.Tensor | None,
    ) -> torch.Tensor | HiddenStates:
        assert self.graphs is not None
        if hidden_in is not None:
            for name, tensor in hidden_in.items():
                self._graph_inputs[name][:num_reqs].copy_(tensor)
        outputs = self.graphs.replay(size)
        if not self.state.is_last_stage:
            # The next replay reuses the graph's buffers; the pipeline sends these later.
            return {name: t[:num_reqs].clone() for name, t in outputs.items()}
        logits = outputs["logits"][:num_reqs]
        return logits if sample_index is None else logits.index_select(0, sample_index)

    def _make_graphs(self, capture: Capture | None) -> DecodeGraphs | None:
        if not self.fused or self.config.model.enforce_eager:
            return None
        if capture is None and self.device.type != "cuda":
            return None
        sizes = list(self.config.scheduler.cuda_graph_sizes) or default_graph_sizes(
            self.max_num_reqs
        )
        bad = [s for s in sizes if not 1 <= s <= self.max_num_reqs]
        if bad:
            raise ValueError(
                f"cuda_graph_sizes {bad} outside [1, {self.max_num_reqs}] (max_num_seqs and "
                "max_num_batched_tokens bound a decode step)"
            )
        assert self._device_inputs is not None
        return DecodeGraphs(sizes, self._graph_body, self._device_inputs.idle_decode, capture)

    def _graph_body(self, size: int) -> HiddenStates:
        """A decode step of `size` rows over the persistent buffers, as a graph records it."""
        assert self._device_inputs is not None
        model = self.model
        step = self._device_inputs.views(size, size, 1, None)
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
            out = model(step.input_ids, meta.positions, self.kv_caches, meta, hidden_in)
            if isinstance(out, dict):
                return out
            return {"logits": model.compute_logits(out)}

    # sampling -------------------------------------------------------------------------

    def _sample(
        self, step_logits: _StepLogits, grammar_output: GrammarOutput | None
    ) -> AsyncModelRunnerOutput:
        batch = self.batch
        step, index, logits = step_logits.step, step_logits.sample_index, step_logits.logits
        rows = step.rows[index]
        metadata = SamplingMetadata.build(
            batch.temperature[rows],
            batch.top_k[rows],
            batch.top_p[rows],
            batch.min_p[rows],
            batch.num_logprobs[rows],
            batch.sampling_generators(rows),
            logits.shape[1],
            self.device,
        )
        if len(rows):
            # The previous samples leave the device buffer: the host must hold them.
            write_samples(batch, self._samples, wait=True)
        out = None
        if self._device_inputs is not None:
            out = self._device_inputs.sampled[: len(rows)]  # where the token feed reads
        with torch.inference_mode():
            if grammar_output is not None:
                self._apply_grammar(step, index, logits, grammar_output)
            sampled = self.sampler(logits, metadata, out)
        host_ids, host_logprobs, event = to_host(sampled, self._stream)
        if len(rows):
            self._samples = record_samples(batch, rows, host_ids, event)
            write_samples(batch, self._samples, wait=False)
        sampled_index = None if len(index) == len(step) else index
        return AsyncModelRunnerOutput(step.handles, sampled_index, host_ids, host_logprobs, event)

    def _apply_grammar(
        self,
        step: ScheduledRequests,
        sample_index: np.ndarray,
        logits: torch.Tensor,
        grammar: GrammarOutput,
    ) -> None:
        batch = self.batch
        sampling = {h: i for i, h in enumerate(step.handles[sample_index].tolist())}
        in_step = set(step.handles.tolist())
        handles = np.asarray(grammar.req_handles).reshape(-1).tolist()
        keep, targets = [], []
        for k, handle in enumerate(handles):
            if handle in sampling:
                keep.append(k)
                targets.append(sampling[handle])
            elif handle not in in_step:
                raise ValueError(
                    f"{batch.describe(handle)}: grammar bitmask for a request not in this step"
                )
        bitmask = np.asarray(grammar.grammar_bitmask)
        if bitmask.ndim != 2 or bitmask.shape[0] != len(handles):
            raise ValueError(
                f"grammar bitmask shape {bitmask.shape} does not match its "
                f"{len(handles)} request handles"
            )
        names = [batch.describe(handles[k]) for k in keep]
        apply_grammar_bitmask(logits, np.array(targets, np.int64), bitmask[keep], names)

    def _finish_empty_step(
        self, step: ScheduledRequests, sample: bool
    ) -> AsyncModelRunnerOutput | IntermediateTensors | None:
        """A step that computes nothing (it only finishes or preempts requests)."""
        model = self.model
        if not self.state.is_last_stage:
            empty = torch.empty(0, model.hidden_size, dtype=model.dtype, device=self.device)
            return IntermediateTensors({"hidden_states": empty, "residual": empty.clone()})
        logits = torch.empty(0, model.vocab_size, dtype=torch.float32, device=self.device)
        step_logits = _StepLogits(step, np.zeros(0, np.int64), logits)
        if not sample:
            self._step_logits = step_logits
            return None
        return self._sample(step_logits, None)

    # helpers --------------------------------------------------------------------------

    def _intermediate_inputs(
        self, intermediate: IntermediateTensors | None, so: SchedulerOutput
    ) -> HiddenStates | None:
        """The previous stage's tensors on this device (copied: decoded message memory is
        read-only), checked against the step's token count before the step changes state."""
        if self.state.is_first_stage:
            if intermediate is not None:
                raise ValueError("the first pipeline stage takes no intermediate tensors")
            return None
        if so.total_num_scheduled_tokens == 0:
            return None
        if intermediate is None:
            raise ValueError(
                f"pipeline stage {self.state.pp_rank} needs the previous stage's "
                "intermediate tensors"
            )
        missing = {"hidden_states", "residual"} - intermediate.tensors.keys()
        if missing:
            raise ValueError(f"intermediate tensors lack {sorted(missing)}")
        tensors = {}
        for name, tensor in intermediate.tensors.items():
            if tensor.dim() < 1 or tensor.shape[0] != so.total_num_scheduled_tokens:
                raise ValueError(
                    f"intermediate tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                    f"{so.total_num_scheduled_tokens} tokens"
                )
            tensors[name] = _on_device(tensor, self.device)
        return tensors

    def _cache_dtype_name(self) -> str:
        name = self.config.cache.cache_dtype
        model_dtype = self.config.model.dtype
        if name == "auto":
            return model_dtype
        if name != model_dtype:
            raise ValueError(
                f"cache_dtype {name!r} differs from the model dtype {model_dtype!r}; the paged "
                "attention needs them equal (use 'auto')"
            )
        return name


def _check_kv_cache_config(config: KVCacheConfig, spec: KVCacheSpec) -> None:
    """Every layer of this rank has a tensor and a group of this rank's shape; other
    ranks' layers are ignored."""
    sizes = {name: t.size_bytes for t in config.tensors for name in t.shared_by}
    groups = {name: g.spec for g in config.groups for name in g.layer_names}
    for name in spec.layer_names:
        if name not in sizes or name not in groups:
            raise ValueError(f"KV cache config has no tensor or group for layer {name!r}")
        other = groups[name]
        mine = (spec.block_size, spec.num_kv_heads, spec.head_size, spec.dtype)
        theirs = (other.block_size, other.num_kv_heads, other.head_size, other.dtype)
        if mine != theirs:
            raise ValueError(
                f"KV cache config for layer {name!r} has (block_size, kv heads, head size, "
                f"dtype) {theirs}, this rank needs {mine}"
            )
        if sizes[name] < config.num_blocks * spec.page_size_bytes:
            raise ValueError(
                f"KV cache tensor of layer {name!r} has {sizes[name]} bytes, "
                f"{config.num_blocks} blocks need {config.num_blocks * spec.page_size_bytes}"
            )


def _on_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of tensor on device; from host memory to CUDA through pinned memory, so the
    copy does not make the host wait."""
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device, copy=True)
