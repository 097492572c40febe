"""bench.gpu_decode's rows of steps that are not plain decodes: a request's first step
(its whole prompt and its sample: all of its time to first token on the worker) at
several prompt lengths, a mixed step (one prompt among many decodes), and the prefill
row (PREFILL's requests in one step, as a share of the matmul peak).

A step's floor is the larger of its bytes over the measured bandwidth (every weight
once, every history it attends; of a mixture of experts' experts only those the step's
tokens chose, measured in an eager run of the same step: moe_floor.py) and its matrix
products' FLOPs over the measured bf16 peak (projections of every token, each through
its top k experts, attention over each token's history, the LM head of the rows that
sample).
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from bench.gpu_runner import BLOCK_SIZE, PREFILL, Ours, floor_bytes
from bench.moe_floor import active_expert_params, eager_steps, experts_chosen, unread_expert_bytes
from messages import CachedRequestData, SchedulerOutput
from messages.step import HANDLE, NUM_COLUMNS, NUM_COMPUTED, NUM_SCHEDULED

REPEATS = 12  # timed steps of each row; the first two are left out


def step_flops(model: torch.nn.Module, query_lens: list[int], contexts: list[int]) -> float:
    """Matrix-product FLOPs of a step whose request r computes query_lens[r] tokens over
    contexts[r] cached ones, each request sampling once (a mixture of experts' tokens
    each multiply their top k experts)."""
    cfg = model.hf_config
    linear = sum(p.numel() for n, p in model.named_parameters() if "layers" in n and p.dim() == 2)
    linear += active_expert_params(model)
    # QK^T and PV: each query over its cached history and the causal half of its own.
    pairs = sum(q * c + q * (q + 1) / 2 for q, c in zip(query_lens, contexts, strict=True))
    attention = 2 * 2 * pairs * model.head_dim * cfg.num_attention_heads * cfg.num_hidden_layers
    lm_head = 2 * cfg.vocab_size * cfg.hidden_size * len(query_lens)
    return 2 * linear * sum(query_lens) + attention + lm_head


def floor_ms(
    ours: Ours,
    query_lens: list[int],
    contexts: list[int],
    chosen: list[int],
    bandwidth: float,
    peak: float,
) -> tuple[float, str]:
    """A step's floor in ms, and what sets it ("bytes" or "flops"). chosen: the experts
    the step's tokens chose, per MoE layer (experts_chosen; empty for a dense model)."""
    model = ours.runner.model
    spec = ours.runner.get_kv_cache_spec()
    # The weights once (embedding rows: one per token), each request's history once.
    nbytes = floor_bytes(model, sum(query_lens), 0, spec) - unread_expert_bytes(model, chosen)
    nbytes += sum(c * spec.page_size_bytes // BLOCK_SIZE for c in contexts) * len(spec.layer_names)
    by_bytes = nbytes / bandwidth * 1e3
    by_flops = step_flops(model, query_lens, contexts) / peak * 1e3
    return max(by_bytes, by_flops), "bytes" if by_bytes >= by_flops else "flops"


def _timed(ours: Ours, so: SchedulerOutput, chosen: list[int] | None = None) -> float:
    """One step's wall time to its sampled tokens on the host. chosen: run it eagerly
    and collect the experts its tokens chose there (a step left out of the median)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    if chosen is None:
        ours.runner.execute_model(so).get_output()
    else:
        with eager_steps(ours.runner), experts_chosen(ours.runner.model) as seen:
            ours.runner.execute_model(so).get_output()
        chosen += seen
    return time.perf_counter() - start


def first_step_rows(
    ours: Ours,
    shape: str,
    prompt_lens: list[int],
    bandwidth: float,
    peak: float,
    rng: np.random.Generator,
) -> list[dict]:
    """One new request per step (the previous one finishes in it), its prompt of each
    length: the step's wall time from the scheduler output to the sampled token on the
    host, median of the steps after the first two (the first runs eagerly, for the
    experts chosen)."""
    rows = []
    for prompt_len in prompt_lens:
        times: list[float] = []
        chosen: list[int] = []
        for k in range(REPEATS):
            handle = ours.next_handle
            ours.next_handle += 1
            new = ours.new_request(handle, 0, prompt_len, rng)
            so = SchedulerOutput([new], CachedRequestData.empty(), prompt_len, ours.live)
            ours.live = [handle]
            times.append(_timed(ours, so, chosen if k == 0 else None))
        ms = statistics.median(times[2:]) * 1e3
        floor, bound = floor_ms(ours, [prompt_len], [0], chosen, bandwidth, peak)
        rows.append(
            {
                "shape": shape,
                "step": "first",
                "tokens": prompt_len,
                "ours_ms": ms,
                "floor_ms": floor,
                "x_floor": ms / floor,
                "floor_by": bound,
            }
        )
    return rows


def mixed_row(
    ours: Ours,
    shape: str,
    decodes: int,
    prompt_len: int,
    context: int,
    bandwidth: float,
    peak: float,
    rng: np.random.Generator,
) -> dict:
    """`decodes` requests at a history of `context` tokens decode while a new request's
    prompt of prompt_len tokens is computed in the same step (the one before finishes in
    it): the step's wall time to its sampled tokens on the host, median after two (the
    first runs eagerly, for the experts chosen)."""
    handles = ours.start(decodes, context, rng)
    columns = np.zeros((NUM_COLUMNS, decodes), np.int32)
    columns[HANDLE], columns[NUM_SCHEDULED] = handles, 1
    times: list[float] = []
    chosen: list[int] = []
    previous: list[int] = []
    for k in range(REPEATS):
        columns[NUM_COMPUTED] = context + k
        handle = ours.next_handle
        ours.next_handle += 1
        new = ours.new_request(handle, decodes * ours.blocks_per_request(context), prompt_len, rng)
        cached = CachedRequestData(columns.copy())
        so = SchedulerOutput([new], cached, decodes + prompt_len, previous)
        previous = [handle]
        times.append(_timed(ours, so, chosen if k == 0 else None))
    ours.live = handles + previous
    ms = statistics.median(times[2:]) * 1e3
    query_lens = [1] * decodes + [prompt_len]
    contexts = [context + REPEATS // 2] * decodes + [0]
    floor, bound = floor_ms(ours, query_lens, contexts, chosen, bandwidth, peak)
    return {
        "shape": shape,
        "step": f"mixed: {prompt_len} + {decodes} decodes",
        "tokens": prompt_len + decodes,
        "ours_ms": ms,
        "floor_ms": floor,
        "x_floor": ms / floor,
        "floor_by": bound,
    }


def prefill_row(ours: Ours, rng: np.random.Generator, peak: float, shape: str) -> dict:
    """PREFILL's requests in one step: median time and the share of peak."""
    requests, length = PREFILL
    times = []
    for _ in range(4):
        torch.cuda.synchronize()
        start = time.perf_counter()
        ours.start(requests, length, rng)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times[1:])
    flops = step_flops(ours.runner.model, [length] * requests, [0] * requests)
    return {
        "shape": shape,
        "tokens": requests * length,
        "ours_ms": seconds * 1e3,
        "mfu": flops / seconds / peak,
    }
