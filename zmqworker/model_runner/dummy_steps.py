"""Dummy steps: the forwards that profile peak memory and warm a runner up.

They run through the runner's own forward (the same input path, kernels and sampler as
real steps) over zero tokens, every request reading the same blocks, and never touch the
persistent batch. Profiling uses throwaway KV caches, not the real one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

import numpy as np
import torch

from messages import WorkerConfig
from zmqworker.attention.paged_attention import probe_steps
from zmqworker.cdiv import cdiv
from zmqworker.distributed.parallel_state import ParallelState
from zmqworker.model_runner.batch_update import ScheduledRequests
from zmqworker.model_runner.grammar_upload import BitmaskUpload
from zmqworker.model_runner.input_batch import InputBatch
from zmqworker.model_runner.penalties import count_outputs
from zmqworker.model_runner.sampler import Sampler, SamplingMetadata


class Runner(Protocol):
    """What dummy steps use of the model runner (model_runner.py)."""

    config: WorkerConfig
    state: ParallelState
    device: torch.device
    model: Any
    batch: InputBatch
    sampler: Sampler
    bitmask_upload: BitmaskUpload | None
    fused: bool
    block_size: int
    max_model_len: int
    max_num_reqs: int
    kv_caches: list[torch.Tensor]
    new_cache: Callable[[int], torch.Tensor]
    path: Any  # forward_paths.TorchPath | TritonPath


# The dummy sampling of profiling: every filter and penalty on and this many logprobs, the
# most memory the sampler can need.
_PROFILE_NUM_LOGPROBS = 20


class DummySteps:
    def __init__(self, runner: Runner) -> None:
        self.runner = runner

    def profile(self) -> None:
        """The largest step (max_num_batched_tokens tokens spread over max_num_seqs
        requests) with the sampler at that many requests, then the steps with the
        attention's largest temporaries (paged_attention.probe_steps)."""
        runner = self.runner
        scheduler = runner.config.scheduler
        num_reqs = runner.max_num_reqs
        # No real step is larger: each request holds at most max_model_len tokens.
        num_tokens = min(scheduler.max_num_batched_tokens, num_reqs * runner.max_model_len)
        query_lens = np.full(num_reqs, num_tokens // num_reqs, np.int32)
        query_lens[: num_tokens % num_reqs] += 1
        logits = self._forward(query_lens, np.zeros(num_reqs, np.int32), own_cache=False)
        if logits is not None:
            self._sample(logits, greedy=False)
        limits = (scheduler.max_num_seqs, scheduler.max_num_batched_tokens, runner.max_model_len)
        for probe_query_lens, context_lens in probe_steps(*limits, runner.block_size):
            self._forward(probe_query_lens, context_lens, own_cache=False)

    def warm_up(self, batch_sizes: list[int]) -> None:
        """A step of two short prompts (the prefill kernels) and a prefill of each token
        count that runs kernels of its own, then decode steps (one block of context per
        request, less where max_model_len is shorter) at each batch size and at each size
        that runs kernels of its own, through the model and both sampler paths: what a
        real step runs is compiled before the engine sends one."""
        runner = self.runner
        for size in batch_sizes:
            if not 1 <= size <= runner.max_num_reqs:
                raise ValueError(f"warm-up batch size {size} is outside [1, {runner.max_num_reqs}]")
        num_prompts = min(2, runner.max_num_reqs)
        prompt_len = max(1, min(2, runner.config.scheduler.max_num_batched_tokens // num_prompts))
        prompt_len = min(prompt_len, runner.max_model_len)
        self._forward(
            np.full(num_prompts, prompt_len, np.int32),
            np.zeros(num_prompts, np.int32),
            own_cache=True,
        )
        max_tokens = runner.config.scheduler.max_num_batched_tokens
        for num_tokens in runner.path.prefill_kernel_tokens(runner.max_num_reqs, max_tokens):
            num_prompts = cdiv(num_tokens, runner.max_model_len)
            if num_prompts <= runner.max_num_reqs:  # else no step has that many tokens
                query_lens = np.full(num_prompts, num_tokens // num_prompts, np.int32)
                query_lens[: num_tokens % num_prompts] += 1
                self._forward(query_lens, np.zeros(num_prompts, np.int32), own_cache=True)
        kernel_sizes = runner.path.decode_kernel_sizes(runner.max_num_reqs)
        # A block of context, or all a request can hold when max_model_len is shorter:
        # no position reaches past the rotary table (max_model_len rows).
        context_len = min(runner.block_size, runner.max_model_len) - 1
        for size in sorted(set(batch_sizes) | set(kernel_sizes)):
            context = np.full(size, context_len, np.int32)
            logits = self._forward(np.ones(size, np.int32), context, own_cache=True)
            if logits is not None:
                self._sample(logits.clone(), greedy=True)
                self._sample(logits, greedy=False)

    def _forward(
        self, query_lens: np.ndarray, context_lens: np.ndarray, own_cache: bool
    ) -> torch.Tensor | None:
        """Every request's last-position logits on the last stage, else None. own_cache
        uses the runner's KV cache when it has enough blocks."""
        runner = self.runner
        model = runner.model
        num_reqs = len(query_lens)
        seq_lens = context_lens + query_lens
        max_seq = int(seq_lens.max())
        num_blocks = cdiv(max_seq, runner.block_size)
        tokens = np.zeros((num_reqs, max_seq), np.int32)
        table = np.tile(np.arange(num_blocks, dtype=np.int32), (num_reqs, 1))
        step = ScheduledRequests(
            rows=np.arange(num_reqs),
            handles=np.zeros(num_reqs, np.int32),
            num_computed=context_lens.astype(np.int32),
            num_scheduled=query_lens.astype(np.int32),
            num_tokens=int(query_lens.sum()),
        )
        caches = runner.kv_caches
        if not (own_cache and caches and caches[0].shape[1] >= num_blocks):
            # One throwaway cache that every layer overwrites: a dummy run needs no
            # layer's keys afterwards, and one layer's worth adds little to the peak.
            caches = [runner.new_cache(num_blocks)] * len(model.layer_names)
        hidden_in = None
        if not runner.state.is_first_stage:
            hidden = torch.zeros(
                step.num_tokens, model.hidden_size, dtype=model.dtype, device=runner.device
            )
            hidden_in = {"hidden_states": hidden, "residual": hidden.clone()}
        last = runner.state.is_last_stage
        sample_index = np.arange(num_reqs) if last else np.zeros(0, np.int64)
        forward = runner.path.run(
            tokens, table, step, sample_index, hidden_in, caches, use_graphs=False
        )
        return forward.out if last else None

    def _sample(self, logits: torch.Tensor, greedy: bool) -> None:
        """greedy: the argmax alone; else every filter, penalty and logprobs."""
        runner = self.runner
        n, vocab = logits.shape
        penalties = runner.batch.penalties
        step = None if greedy or penalties is None else penalties.dummy_step(n)
        num_logprobs = -1 if greedy else min(_PROFILE_NUM_LOGPROBS, vocab)
        metadata = SamplingMetadata.build(
            temperature=np.full(n, 0.0 if greedy else 1.0, np.float32),
            top_k=np.full(n, 0 if greedy else max(1, vocab // 2), np.int32),
            top_p=np.full(n, 1.0 if greedy else 0.9, np.float32),
            min_p=np.full(n, 0.0 if greedy else 0.01, np.float32),
            num_logprobs=np.full(n, num_logprobs, np.int32),
            seeds={},
            vocab_size=vocab,
            device=runner.device,
            penalties=step,
        )
        with torch.inference_mode():
            upload = runner.bitmask_upload
            if not greedy and upload is not None:  # a bitmask allowing every token
                from zmqworker.model_runner.grammar_kernel import apply_bitmask

                allowed = np.full((n, upload.words), -1, np.int32)
                apply_bitmask(logits, *upload.upload(np.arange(n), allowed))
            sampled = runner.sampler(logits, metadata)
            if step is not None and step.dense is not None:
                # Counted into a row of its own: the batch's counts stay as they are.
                dense = replace(step.dense, index=step.dense.index[:1], rows=step.dense.rows[:1])
                scratch = torch.zeros(1, vocab, dtype=torch.int32, device=runner.device)
                count_outputs(
                    replace(step, counts=scratch, dense=dense),
                    sampled.sampled_token_ids,
                    runner.fused,
                )
