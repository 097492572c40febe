"""The model runner: this rank's model, its paged KV cache and the persistent batch.

Each step: the SchedulerOutput's deltas update the persistent batch (validated first, so a
bad step changes nothing), the step's flat inputs are gathered from it, the model runs,
and on the last pipeline stage the last position of every request that reached the end
of its known tokens is turned into logits and sampled. Sampled ids travel to the host
asynchronously on CUDA; the runner writes them into its token table at the start of the
next step, when it needs them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from messages import (
    GrammarOutput,
    IntermediateTensors,
    KVCacheConfig,
    KVCacheSpec,
    SchedulerOutput,
    WorkerConfig,
)
from zmqworker.attention.kv_cache import allocate_kv_cache, release_workspaces
from zmqworker.attention.paged_attention import probe_steps
from zmqworker.distributed.parallel_state import ParallelState
from zmqworker.distributed.pp_channel import PendingTensors
from zmqworker.model_runner.async_output import AsyncModelRunnerOutput
from zmqworker.model_runner.batch_update import ScheduledRequests
from zmqworker.model_runner.grammar import apply_grammar_bitmask
from zmqworker.model_runner.input_batch import InputBatch
from zmqworker.model_runner.sampler import Sampler, SamplerOutput, SamplingMetadata
from zmqworker.model_runner.step_inputs import StepInputBuilder
from zmqworker.models.registry import build_model, torch_dtype

# The dummy sampling of profile_run: every filter on and this many logprobs, the most
# memory the sampler can need.
_PROFILE_NUM_LOGPROBS = 20
# Host copies of (logprob token ids, logprobs, sampled token ranks).
_HostLogprobs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass
class _StepLogits:
    """A step run up to its logits, waiting to be sampled."""

    step: ScheduledRequests
    sample_index: np.ndarray  # positions in step of the requests that sample
    logits: torch.Tensor  # float32 [len(sample_index), vocab]


@dataclass
class _PendingTokens:
    """Sampled ids still being copied to the host (CUDA), and where they go."""

    rows: np.ndarray
    positions: np.ndarray
    host_ids: torch.Tensor
    event: torch.cuda.Event


class ModelRunner:
    def __init__(self, config: WorkerConfig, state: ParallelState) -> None:
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
        self.model: nn.Module | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.batch: InputBatch | None = None
        self.max_model_len = 0
        self.sampler = Sampler()
        self._inputs: StepInputBuilder | None = None
        self._step_logits: _StepLogits | None = None
        self._pending_tokens: _PendingTokens | None = None

    # start-up -------------------------------------------------------------------------

    def load_model(self) -> None:
        model = build_model(self.config.model, self.state)
        max_len = self.config.model.max_model_len or model.hf_config.max_position_embeddings
        scheduler = self.config.scheduler
        self.batch = InputBatch(
            max_num_seqs=scheduler.max_num_seqs,
            max_model_len=max_len,
            max_num_batched_tokens=scheduler.max_num_batched_tokens,
            block_size=self.block_size,
            vocab_size=model.vocab_size,
            device=self.device,
        )
        self._inputs = StepInputBuilder(
            scheduler.max_num_batched_tokens, scheduler.max_num_seqs, self.block_size, self.device
        )
        self.max_model_len = max_len
        self.model = model

    def get_kv_cache_spec(self) -> KVCacheSpec:
        model = self._require_model()
        return KVCacheSpec(
            block_size=self.block_size,
            num_kv_heads=model.num_kv_heads,
            head_size=model.head_dim,
            dtype=self._cache_dtype_name(),
            layer_names=list(model.layer_names),
        )

    def profile_run(self) -> None:
        """Dummy forwards for peak-memory profiling: the largest step (max_num_batched_tokens
        tokens spread over max_num_seqs requests) with the sampler at max_num_seqs, then the
        steps with the attention's largest temporaries (paged_attention.probe_steps: a full
        chunk of decodes at max_model_len, a prefill's largest mask and history gather).
        Uses throwaway KV caches, not the real one."""
        self._require_model()
        scheduler = self.config.scheduler
        num_reqs = min(scheduler.max_num_seqs, scheduler.max_num_batched_tokens)
        # No real step is larger: each request holds at most max_model_len tokens.
        num_tokens = min(scheduler.max_num_batched_tokens, num_reqs * self.max_model_len)
        query_lens = np.full(num_reqs, num_tokens // num_reqs, np.int32)
        query_lens[: num_tokens % num_reqs] += 1
        hidden = self._dummy_forward(query_lens, np.zeros(num_reqs, np.int32), own_cache=False)
        if hidden is not None:
            self._dummy_sample(hidden, greedy=False)
        limits = (scheduler.max_num_seqs, scheduler.max_num_batched_tokens, self.max_model_len)
        for probe_query_lens, context_lens in probe_steps(*limits, self.block_size):
            self._dummy_forward(probe_query_lens, context_lens, own_cache=False)

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        """Allocate kv_cache_config.num_blocks blocks for each of this rank's layers."""
        spec = self.get_kv_cache_spec()
        num_blocks = kv_cache_config.num_blocks
        if num_blocks < 1:
            raise ValueError(f"KV cache config has {num_blocks} blocks; at least 1 is needed")
        _check_kv_cache_config(kv_cache_config, spec)
        self.release_kv_cache()
        self.kv_caches = [
            allocate_kv_cache(
                num_blocks,
                spec.block_size,
                spec.num_kv_heads,
                spec.head_size,
                torch_dtype(spec.dtype),
                self.device,
            )
            for _ in spec.layer_names
        ]
        assert self.batch is not None
        self.batch.num_kv_blocks = num_blocks

    def release_kv_cache(self) -> None:
        """Drop the cache and the attention's gather workspaces sized from it (sleep and
        shutdown must give both back)."""
        self.kv_caches = []
        release_workspaces()
        if self.batch is not None:
            self.batch.num_kv_blocks = 0

    def warm_up(self, batch_sizes: list[int]) -> None:
        """Dummy decode steps (one block of context per request) at each batch size,
        through the model and both sampler paths."""
        self._require_model()
        scheduler = self.config.scheduler
        limit = min(scheduler.max_num_seqs, scheduler.max_num_batched_tokens)
        for size in batch_sizes:
            if not 1 <= size <= limit:
                raise ValueError(f"warm-up batch size {size} is outside [1, {limit}]")
            context = np.full(size, self.block_size - 1, np.int32)
            hidden = self._dummy_forward(np.ones(size, np.int32), context, own_cache=True)
            if hidden is not None:
                self._dummy_sample(hidden, greedy=True)
                self._dummy_sample(hidden, greedy=False)

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
        model = self._require_model()
        batch = self._require_batch()
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
        self._flush_pending_tokens()
        step = batch.update(scheduler_output)
        if len(step) == 0:
            return self._finish_empty_step(step, sample)
        assert self._inputs is not None
        inputs = self._inputs.build(
            batch.token_ids,
            batch.block_table,
            step.rows,
            step.num_computed,
            step.num_scheduled,
            step.num_tokens,
        )
        if pending is not None:
            hidden_in = self._intermediate_inputs(pending.wait(), scheduler_output)
        with torch.inference_mode():
            out = model(
                inputs.input_ids if self.state.is_first_stage else None,
                inputs.positions,
                self.kv_caches,
                inputs.attn_metadata,
                hidden_in,
            )
            if not self.state.is_last_stage:
                return IntermediateTensors(dict(out))
            # Requests that reached the end of their known tokens sample; the others are
            # mid chunked prefill and need no logits.
            samples = inputs.seq_lens == batch.num_tokens[step.rows]
            sample_index = np.flatnonzero(samples)
            if len(sample_index) == len(step):
                last = inputs.query_start_loc[1:] - 1
            else:
                last = inputs.query_start_loc[1:][samples] - 1
            if len(last) != step.num_tokens:
                out = out[torch.from_numpy(last.astype(np.int64)).to(self.device)]
            logits = model.compute_logits(out)
        step_logits = _StepLogits(step, sample_index, logits)
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
        """Drop the model, the batch and anything in flight; safe to call twice."""
        if self._pending_tokens is not None:
            self._pending_tokens.event.synchronize()
        self._pending_tokens = None
        self._step_logits = None
        self.release_kv_cache()
        self.model = None
        self.batch = None
        self._inputs = None

    # sampling -------------------------------------------------------------------------

    def _sample(
        self, step_logits: _StepLogits, grammar_output: GrammarOutput | None
    ) -> AsyncModelRunnerOutput:
        batch = self._require_batch()
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
        with torch.inference_mode():
            if grammar_output is not None:
                self._apply_grammar(step, index, logits, grammar_output)
            sampled = self.sampler(logits, metadata)
        host_ids, host_logprobs, event = self._to_host(sampled)
        if event is None:
            batch.append_sampled(rows, host_ids.numpy())
        else:
            positions = batch.num_tokens[rows].copy()
            batch.num_tokens[rows] += 1
            self._pending_tokens = _PendingTokens(rows, positions, host_ids, event)
        sampled_index = None if len(index) == len(step) else index
        return AsyncModelRunnerOutput(step.handles, sampled_index, host_ids, host_logprobs, event)

    def _apply_grammar(
        self,
        step: ScheduledRequests,
        sample_index: np.ndarray,
        logits: torch.Tensor,
        grammar: GrammarOutput,
    ) -> None:
        batch = self._require_batch()
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

    def _to_host(
        self, sampled: SamplerOutput
    ) -> tuple[torch.Tensor, _HostLogprobs | None, torch.cuda.Event | None]:
        """The sampled ids and logprobs on the host: as they are on the CPU; on CUDA
        through non_blocking copies into pinned memory, with an event after them."""
        tensors = [sampled.sampled_token_ids]
        if sampled.logprobs is not None:
            assert sampled.logprob_token_ids is not None and sampled.sampled_token_ranks is not None
            tensors += [sampled.logprob_token_ids, sampled.logprobs, sampled.sampled_token_ranks]
        if self.device.type != "cuda":
            host, event = [t.cpu() for t in tensors], None
        else:
            host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for h, t in zip(host, tensors, strict=True):
                h.copy_(t, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        logprobs = (host[1], host[2], host[3]) if len(host) == 4 else None
        return host[0], logprobs, event

    def _flush_pending_tokens(self) -> None:
        """Write the previous step's sampled ids (copied asynchronously) into the token
        table, before anything reads it."""
        pending, self._pending_tokens = self._pending_tokens, None
        if pending is not None:
            pending.event.synchronize()
            token_ids = self._require_batch().token_ids
            token_ids[pending.rows, pending.positions] = pending.host_ids.numpy()

    def _finish_empty_step(
        self, step: ScheduledRequests, sample: bool
    ) -> AsyncModelRunnerOutput | IntermediateTensors | None:
        """A step that computes nothing (it only finishes or preempts requests)."""
        model = self._require_model()
        if not self.state.is_last_stage:
            empty = torch.empty(0, model.hidden_size, dtype=model.dtype, device=self.device)
            return IntermediateTensors({"hidden_states": empty, "residual": empty.clone()})
        logits = torch.empty(0, model.vocab_size, dtype=torch.float32, device=self.device)
        step_logits = _StepLogits(step, np.zeros(0, np.int64), logits)
        if not sample:
            self._step_logits = step_logits
            return None
        return self._sample(step_logits, None)

    # dummy runs -----------------------------------------------------------------------

    def _dummy_forward(
        self, query_lens: np.ndarray, context_lens: np.ndarray, own_cache: bool
    ) -> torch.Tensor | None:
        """Run the model on zero tokens of the given lengths, every request reading the
        same blocks. Returns the last position's hidden state of each request on the last
        stage. own_cache uses the runner's KV cache when it has enough blocks."""
        model = self._require_model()
        assert self._inputs is not None
        num_reqs = len(query_lens)
        seq_lens = context_lens + query_lens
        max_seq = int(seq_lens.max())
        num_blocks = -(-max_seq // self.block_size)
        tokens = np.zeros((num_reqs, max_seq), np.int32)
        table = np.tile(np.arange(num_blocks, dtype=np.int32), (num_reqs, 1))
        inputs = self._inputs.build(
            tokens, table, np.arange(num_reqs), context_lens, query_lens, int(query_lens.sum())
        )
        caches = self.kv_caches
        if not (own_cache and caches and caches[0].shape[1] >= num_blocks):
            # One throwaway cache that every layer overwrites: a dummy run needs no
            # layer's keys afterwards, and one layer's worth adds little to the peak.
            spec = self.get_kv_cache_spec()
            cache = allocate_kv_cache(
                num_blocks,
                self.block_size,
                spec.num_kv_heads,
                spec.head_size,
                torch_dtype(spec.dtype),
                self.device,
            )
            caches = [cache] * len(spec.layer_names)
        input_ids, hidden_in = inputs.input_ids, None
        if not self.state.is_first_stage:
            hidden = torch.zeros(
                len(inputs.positions), model.hidden_size, dtype=model.dtype, device=self.device
            )
            input_ids, hidden_in = None, {"hidden_states": hidden, "residual": hidden.clone()}
        with torch.inference_mode():
            out = model(input_ids, inputs.positions, caches, inputs.attn_metadata, hidden_in)
        if not self.state.is_last_stage:
            return None
        last = torch.from_numpy(inputs.query_start_loc[1:] - 1).to(self.device, torch.int64)
        return out[last]

    def _dummy_sample(self, hidden: torch.Tensor, greedy: bool) -> None:
        model = self._require_model()
        n = hidden.shape[0]
        vocab = model.vocab_size
        num_logprobs = -1 if greedy else min(_PROFILE_NUM_LOGPROBS, vocab)
        with torch.inference_mode():
            logits = model.compute_logits(hidden)
            metadata = SamplingMetadata.build(
                temperature=np.full(n, 0.0 if greedy else 1.0, np.float32),
                top_k=np.full(n, 0 if greedy else max(1, vocab // 2), np.int32),
                top_p=np.full(n, 1.0 if greedy else 0.9, np.float32),
                min_p=np.full(n, 0.0 if greedy else 0.01, np.float32),
                num_logprobs=np.full(n, num_logprobs, np.int32),
                generators={},
                vocab_size=vocab,
                device=self.device,
            )
            self.sampler(logits, metadata)

    # helpers --------------------------------------------------------------------------

    def _intermediate_inputs(
        self, intermediate: IntermediateTensors | None, so: SchedulerOutput
    ) -> dict[str, torch.Tensor] | None:
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
            tensors[name] = tensor.to(self.device, copy=True)
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

    def _require_model(self) -> nn.Module:
        if self.model is None:
            raise RuntimeError("the model is not loaded: call load_model first")
        return self.model

    def _require_batch(self) -> InputBatch:
        if self.batch is None:
            raise RuntimeError("the model is not loaded: call load_model first")
        return self.batch


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
