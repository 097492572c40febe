"""The model runner: this rank's model, its paged KV cache and the persistent batch.

Each step: the SchedulerOutput's deltas update the persistent batch (validated first, so a
bad step changes nothing), the step's flat inputs are gathered from it, the model runs,
and on the last pipeline stage the last position of every request that reached the end
of its known tokens is turned into logits and sampled.

The forward runs on one of two paths (forward_paths.py): plain torch on the CPU, Triton
kernels and CUDA graphs on CUDA, where nothing in a step waits for the device.
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
    PromptLogprobs,
    SchedulerOutput,
    WorkerConfig,
)
from zmqworker.distributed.parallel_state import ParallelState
from zmqworker.distributed.pp_channel import PendingTensors
from zmqworker.distributed.shared_cache import SharedKVCache
from zmqworker.model_runner.async_output import AsyncModelRunnerOutput
from zmqworker.model_runner.batch_update import ScheduledRequests, plan_update
from zmqworker.model_runner.cuda_graphs import Capture, StepGraphs
from zmqworker.model_runner.dummy_steps import DummySteps
from zmqworker.model_runner.forward_paths import TorchPath
from zmqworker.model_runner.grammar import apply_grammar_output
from zmqworker.model_runner.grammar_upload import BitmaskUpload
from zmqworker.model_runner.input_batch import InputBatch
from zmqworker.model_runner.kv_cache_config import cache_dtype_name, check_kv_cache_config
from zmqworker.model_runner.kv_cache_memory import make_caches, new_cache
from zmqworker.model_runner.penalties import count_outputs
from zmqworker.model_runner.pipeline_inputs import intermediate_inputs
from zmqworker.model_runner.prompt_logprobs import plan_prompt_logprobs, prompt_logprobs
from zmqworker.model_runner.sampled_tokens import (
    Samples,
    record_samples,
    to_host,
    token_feed,
    write_samples,
)
from zmqworker.model_runner.sampler import Sampler, SamplerOutput, SamplingMetadata
from zmqworker.model_runner.triton_path import TritonPath
from zmqworker.models.registry import build_model

KERNELS = ("auto", "torch", "triton")


@dataclass
class _StepLogits:
    """A step run up to its logits, waiting to be sampled."""

    step: ScheduledRequests
    sample_index: np.ndarray  # positions in step of the requests that sample
    logits: torch.Tensor  # float32 [len(sample_index), vocab]
    greedy_ids: torch.Tensor | None = None  # their argmax, when a graph took it
    prompt: PromptLogprobs | None = None  # of the prompt positions it computed


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
            max_logprobs=config.model.max_logprobs,
            device=self.device,
            samples=state.is_last_stage,
        )
        self.kv_caches: list[torch.Tensor] = []
        self.shared_kv: SharedKVCache | None = None  # the memfd holding kv_caches, if any
        self.sampler = Sampler(fused=self.fused)
        self.bitmask_upload = (
            BitmaskUpload(self.max_num_reqs, self.model.vocab_size, self.device)
            if self.fused and state.is_last_stage
            else None
        )
        self.path: TorchPath | TritonPath
        if self.fused:
            self.path = TritonPath(
                self.model,
                config,
                state,
                self.device,
                self.max_model_len,
                self.batch.max_blocks_per_req,
                graph_capture,
            )
        else:
            self.path = TorchPath(self.model, config, self.device)
        self._stream = (
            torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        )
        self._step_logits: _StepLogits | None = None
        self._samples: Samples | None = None
        self.dummy = DummySteps(self)

    # start-up -------------------------------------------------------------------------

    def get_kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec(
            block_size=self.block_size,
            num_kv_heads=self.model.num_kv_heads,
            head_size=self.model.head_dim,
            dtype=cache_dtype_name(self.config.cache.cache_dtype, self.config.model.dtype),
            layer_names=list(self.model.layer_names),
        )

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        """Allocate kv_cache_config.num_blocks blocks for each of this rank's layers."""
        spec, num_blocks = self.get_kv_cache_spec(), kv_cache_config.num_blocks
        if num_blocks < 1:
            raise ValueError(f"KV cache config has {num_blocks} blocks; at least 1 is needed")
        check_kv_cache_config(kv_cache_config, spec)
        self.check_kv_unused()
        self.batch.check_blocks_within(num_blocks)
        self.release_kv_cache()
        transfer = self.config.kv_transfer
        self.kv_caches, self.shared_kv = make_caches(spec, num_blocks, self.device, transfer)
        self.batch.num_kv_blocks = num_blocks

    def check_kv_unused(self) -> None:
        """RuntimeError naming an unfinished request whose KV lies in the cache: a new
        cache would lose it. Asleep, there is none (their KV went with it: wake_up)."""
        if self.kv_caches:
            self.batch.check_no_requests("initialize_from_config")

    def new_cache(self, num_blocks: int) -> torch.Tensor:
        return new_cache(self.get_kv_cache_spec(), num_blocks, self.device)

    def release_kv_cache(self) -> None:
        """Drop the cache and the buffers sized from it or captured over it (the graphs,
        the attention's gather workspace): sleep and shutdown must give all back."""
        self.path.release_buffers()
        if self.shared_kv is not None:
            self.shared_kv.close()
        self.kv_caches, self.shared_kv = [], None
        self.batch.num_kv_blocks = 0
        self.batch.kv_dropped = set(self.batch.row_of)

    def profile_run(self) -> None:
        """The dummy steps of peak-memory profiling (dummy_steps.py)."""
        self.dummy.profile()

    def warm_up(self, batch_sizes: list[int]) -> None:
        """Dummy decode steps at each batch size (writing blocks 0.. of the real cache:
        refused while requests are unfinished), then the CUDA graphs, if any."""
        self.batch.check_no_requests("compile_or_warm_up_model")
        self.dummy.warm_up(batch_sizes)
        self.capture_graphs()

    @property
    def graphs(self) -> StepGraphs | None:
        """The decode CUDA graphs (the Triton path's, unless enforce_eager; the token
        graphs are path.token_graphs)."""
        return self.path.graphs

    def capture_graphs(self) -> None:
        """Capture the graphs over the current KV cache (again after a wake-up)."""
        if isinstance(self.path, TritonPath) and self.kv_caches:
            self.path.capture_graphs(self.kv_caches)

    def probe_graph_memory(self) -> int:
        """Bytes the graphs hold once captured, measured by capturing them over a one-block
        cache and releasing them: what the KV cache budget must leave free."""
        path = self.path
        if not isinstance(path, TritonPath) or path.graphs is None or self.device.type != "cuda":
            return 0
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free_before = torch.cuda.mem_get_info()[0]
        try:
            path.capture_graphs([self.new_cache(1)] * len(self.model.layer_names))
            torch.cuda.synchronize()
            # The warm-up runs' activations, cached outside the graphs' pool, go back.
            torch.cuda.empty_cache()
            used = free_before - torch.cuda.mem_get_info()[0]
        finally:
            path.release_buffers()
            torch.cuda.empty_cache()
        return max(0, used)

    # steps ----------------------------------------------------------------------------

    def execute_model(
        self,
        scheduler_output: SchedulerOutput,
        intermediate_tensors: IntermediateTensors | PendingTensors | None = None,
        sample: bool = True,
        before_apply: Callable[[], None] | None = None,
    ) -> AsyncModelRunnerOutput | IntermediateTensors | None:
        """Run one step. Non-last pipeline stages return IntermediateTensors; the last
        returns an AsyncModelRunnerOutput, or None with sample=False (then call
        sample_tokens). intermediate_tensors: the previous stage's, maybe still on their
        way. before_apply (the KV connector's copies) runs once the step and those tensors
        are checked whole, before anything changes: a refused step changes nothing."""
        if self._step_logits is not None:
            raise RuntimeError("execute_model before sample_tokens consumed the previous step")
        if scheduler_output.total_num_scheduled_tokens > 0 and not self.kv_caches:
            raise RuntimeError("execute_model before initialize_from_config: no KV cache")
        # Parking a preempted request copies its tokens: they must all be on the host.
        wait = not self.fused or bool(scheduler_output.preempted_req_handles)
        write_samples(self.batch, self._samples, wait=wait)
        plan = plan_update(self.batch, scheduler_output)
        # Waited for before the batch changes: a step the previous stage refused (its
        # refusal comes instead) or whose tensors do not fit leaves the batch as it was.
        model = self.model
        hidden_in = intermediate_inputs(
            intermediate_tensors,
            scheduler_output,
            self.state,
            model.hidden_size,
            model.dtype,
            self.device,
        )
        if before_apply is not None:
            before_apply()
        step = self.batch.apply(plan)
        if len(step) == 0:
            return self._finish_empty_step(step, sample)
        sample_index = self._sample_index(step)
        batch = self.batch
        feed = token_feed(batch, self._samples) if self.fused else None
        plan = plan_prompt_logprobs(batch, step) if self.state.is_last_stage else None
        forward = self.path.run(
            batch.token_ids,
            batch.block_table,
            step,
            sample_index,
            hidden_in,
            self.kv_caches,
            feed,
            keep=None if plan is None else plan.token_index,
        )
        out = forward.out
        if not self.state.is_last_stage:
            assert isinstance(out, dict)
            return IntermediateTensors(out)
        assert isinstance(out, torch.Tensor)
        step_logits = _StepLogits(step, sample_index, out, forward.greedy_ids)
        if plan is not None:
            assert forward.kept is not None
            step_logits.prompt = prompt_logprobs(self.model, forward.kept, plan)
        if not sample:
            self._step_logits = step_logits
            return None
        return self._sample(step_logits, None)

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> AsyncModelRunnerOutput | None:
        """Sample the logits kept by execute_model(sample=False), after applying the
        grammar bitmask of the requests it names. A stage before the last samples nothing:
        None (the engine sends the call to every rank)."""
        if not self.state.is_last_stage:
            return None
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

    # sampling -------------------------------------------------------------------------

    def _sample(
        self, step_logits: _StepLogits, grammar_output: GrammarOutput | None
    ) -> AsyncModelRunnerOutput:
        batch = self.batch
        step, index, logits = step_logits.step, step_logits.sample_index, step_logits.logits
        rows = step.rows[index]
        penalties = None
        if len(rows):
            # The previous samples leave the device buffer: the host must hold them. The
            # bad words are matched against the token table: it holds them all now.
            write_samples(batch, self._samples, wait=True)
            assert batch.penalties is not None  # the last stage keeps them
            penalties = batch.penalties.step(
                rows, batch.num_tokens, batch.num_prompt, batch.token_ids
            )
        metadata = SamplingMetadata.build(
            batch.temperature[rows],
            batch.top_k[rows],
            batch.top_p[rows],
            batch.min_p[rows],
            batch.num_logprobs[rows],
            batch.sample_seeds(rows),
            logits.shape[1],
            self.device,
            penalties,
        )
        out = None
        if isinstance(self.path, TritonPath):
            out = self.path.inputs.sampled[: len(rows)]  # where the token feed reads
        greedy_ids = step_logits.greedy_ids
        if (
            greedy_ids is not None
            and grammar_output is None
            and metadata.all_greedy
            and metadata.max_num_logprobs is None
            and penalties is None
        ):
            sampled = SamplerOutput(greedy_ids)  # the graph's argmax is this step's sample
        else:
            with torch.inference_mode():
                if grammar_output is not None:
                    upload = self.bitmask_upload
                    apply_grammar_output(
                        logits, step.handles, index, grammar_output, batch.describe, upload
                    )
                sampled = self.sampler(logits, metadata, out)
                if penalties is not None:
                    count_outputs(penalties, sampled.sampled_token_ids, self.fused)
        host_ids, host_logprobs, event = to_host(sampled, self._stream)
        if len(rows):
            self._samples = record_samples(batch, rows, host_ids, event)
            write_samples(batch, self._samples, wait=False)
        sampled_index = None if len(index) == len(step) else index
        return AsyncModelRunnerOutput(
            step.handles, sampled_index, host_ids, host_logprobs, event, step_logits.prompt
        )

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
