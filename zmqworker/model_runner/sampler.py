"""The sampler: one set of logits per request in, one token (and optional logprobs) out.

Vectorised over the batch: the penalties and biases (penalties.py) first, on the rows
that use them, then greedy, temperature, top-k, top-p and min-p as tensor ops on the whole
[n, vocab] block; a batch of greedy requests without logprobs is a single argmax. Random
sampling uses the exponential race (argmax of probs / Exp(1) noise), so a seeded request
draws its noise from its own generator and gets the same tokens whatever else is in the
batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from zmqworker.model_runner.host_to_device import to_device
from zmqworker.model_runner.penalties import PenaltyStep, apply_penalties

# Temperatures below this count as greedy (the request's temperature is 0).
_GREEDY_EPS = 1e-5


@dataclass
class SamplingMetadata:
    """The sampling settings of the n requests that sample this step, as device tensors.

    A filter's tensor is None when no request uses it, so its cost is skipped entirely.
    """

    all_greedy: bool
    temperature: torch.Tensor | None = None  # float32 [n]; 0 = greedy
    top_k: torch.Tensor | None = None  # int64 [n]; 0 = off
    max_top_k: int = 0  # the largest top_k in use
    top_p: torch.Tensor | None = None  # float32 [n]; 1 = off
    min_p: torch.Tensor | None = None  # float32 [n]; 0 = off
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # row -> generator
    max_num_logprobs: int | None = None  # the largest top-n asked for; None: no logprobs
    penalties: PenaltyStep | None = None  # None: no request samples with any

    @classmethod
    def build(
        cls,
        temperature: np.ndarray,
        top_k: np.ndarray,
        top_p: np.ndarray,
        min_p: np.ndarray,
        num_logprobs: np.ndarray,
        seeds: dict[int, int],
        vocab_size: int,
        device: torch.device,
        penalties: PenaltyStep | None = None,
    ) -> SamplingMetadata:
        """From per-request numpy columns (num_logprobs: -1 for none) and the draw seeds of
        the seeded requests ({row: seed}, InputBatch.sample_seeds)."""
        wants_logprobs = num_logprobs >= 0
        max_num_logprobs = int(num_logprobs.max()) if wants_logprobs.any() else None
        greedy = temperature < _GREEDY_EPS
        if greedy.all():
            return cls(all_greedy=True, max_num_logprobs=max_num_logprobs, penalties=penalties)
        top_k_on = (top_k > 0) & (top_k < vocab_size) & ~greedy
        top_p_on = (top_p < 1.0) & ~greedy
        min_p_on = (min_p > 0.0) & ~greedy

        def tensor(values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return to_device(values, dtype, device)

        return cls(
            all_greedy=False,
            temperature=tensor(temperature, torch.float32),
            top_k=tensor(np.where(top_k_on, top_k, 0), torch.int64) if top_k_on.any() else None,
            max_top_k=int(top_k[top_k_on].max()) if top_k_on.any() else 0,
            top_p=tensor(np.where(top_p_on, top_p, 1.0), torch.float32) if top_p_on.any() else None,
            min_p=tensor(np.where(min_p_on, min_p, 0.0), torch.float32) if min_p_on.any() else None,
            # Only rows that sample at random draw noise: a generator costs microseconds
            # to make, and a greedy row's would go unused.
            generators={
                i: torch.Generator(device=device).manual_seed(seed)
                for i, seed in seeds.items()
                if not greedy[i]
            },
            max_num_logprobs=max_num_logprobs,
            penalties=penalties,
        )


@dataclass
class SamplerOutput:
    """Device tensors: the sampled tokens and, when asked for, their logprobs."""

    sampled_token_ids: torch.Tensor  # int32 [n]
    logprob_token_ids: torch.Tensor | None = None  # int32 [n, k + 1]; column 0 = sampled
    logprobs: torch.Tensor | None = None  # float32 [n, k + 1]
    sampled_token_ranks: torch.Tensor | None = None  # int32 [n]; 1 = the most likely token


class Sampler:
    """Samples one token per row of logits. The logits are float32 [n, vocab] and are
    modified in place (the caller hands over a tensor it no longer needs). fused: the
    penalties through Triton kernels (the CUDA step's), else torch ops."""

    def __init__(self, fused: bool = False) -> None:
        self.fused = fused

    def __call__(
        self, logits: torch.Tensor, metadata: SamplingMetadata, out: torch.Tensor | None = None
    ) -> SamplerOutput:
        """out: an int32 [n] tensor to write the sampled ids into (and return)."""
        if logits.dim() != 2:
            raise ValueError(f"logits must be [num_reqs, vocab], got shape {tuple(logits.shape)}")
        # Logprobs describe the model's distribution, before penalties and filters.
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
        if metadata.penalties is not None:
            apply_penalties(logits, metadata.penalties, self.fused)
        if metadata.all_greedy:
            sampled = _argmax(logits)
        else:
            sampled = _sample_random(logits, metadata)
        ids = sampled.to(torch.int32) if out is None else out.copy_(sampled)
        result = SamplerOutput(ids)
        if raw_logprobs is not None:
            assert metadata.max_num_logprobs is not None
            _gather_logprobs(result, raw_logprobs, sampled, metadata.max_num_logprobs)
        return result


def _sample_random(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    assert metadata.temperature is not None
    temperature = metadata.temperature
    is_greedy = temperature < _GREEDY_EPS
    greedy_tokens = _argmax(logits)
    logits.div_(torch.where(is_greedy, 1.0, temperature).unsqueeze(1))
    if metadata.min_p is not None:  # before top-k and top-p, as vLLM's: they see its cut
        # A token less likely than min_p times the likeliest: its logit below the
        # likeliest's plus log(min_p) (min_p 0: minus infinity, nothing dropped).
        floor = logits.amax(dim=-1, keepdim=True) + metadata.min_p.log().unsqueeze(1)
        logits.masked_fill_(logits < floor, -torch.inf)
    if metadata.top_p is not None:
        logits = _apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
    elif metadata.top_k is not None:
        _apply_top_k(logits, metadata.top_k, metadata.max_top_k)
    probs = logits.softmax(dim=-1, dtype=torch.float32)
    noise = torch.empty_like(probs)
    if len(metadata.generators) < probs.shape[0]:
        noise.exponential_()
    for row, generator in metadata.generators.items():
        noise[row].exponential_(generator=generator)
    sampled = _argmax(probs.div_(noise))
    return torch.where(is_greedy, greedy_tokens, sampled)


def _argmax(values: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax (the first maximum, as torch's). On the CPU through numpy, whose
    vectorised argmax is about ten times faster than torch's at vocabulary sizes."""
    if values.device.type != "cpu" or values.dtype != torch.float32:
        return values.argmax(dim=-1)
    return torch.from_numpy(np.argmax(values.numpy(), axis=-1))


def _apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> None:
    """Keep each row's top_k largest logits (rows with top_k 0 keep everything)."""
    top_values = logits.topk(max_top_k, dim=-1).values
    index = (top_k.clamp(min=1) - 1).unsqueeze(1)
    threshold = top_values.gather(1, index).masked_fill_((top_k == 0).unsqueeze(1), -torch.inf)
    logits.masked_fill_(logits < threshold, -torch.inf)


def _apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor
) -> torch.Tensor:
    """Top-k then top-p on one ascending sort: keep the smallest set of most likely tokens
    whose probability reaches top_p (at least one token)."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[1]
    if top_k is not None:
        kth = (vocab - top_k).clamp(max=vocab - 1).unsqueeze(1)
        threshold = sorted_logits.gather(1, kth).masked_fill_((top_k == 0).unsqueeze(1), -torch.inf)
        sorted_logits.masked_fill_(sorted_logits < threshold, -torch.inf)
    cumulative = sorted_logits.softmax(dim=-1).cumsum_(dim=-1)
    drop = cumulative <= (1.0 - top_p).unsqueeze(1)
    drop[:, -1] = False
    sorted_logits.masked_fill_(drop, -torch.inf)
    return logits.scatter_(1, order, sorted_logits)


def _gather_logprobs(
    out: SamplerOutput, logprobs: torch.Tensor, sampled: torch.Tensor, num_top: int
) -> None:
    sampled = sampled.unsqueeze(1)
    sampled_logprobs = logprobs.gather(1, sampled)
    # Rank 1 is the most likely token: count the tokens strictly more likely.
    out.sampled_token_ranks = ((logprobs > sampled_logprobs).sum(dim=-1) + 1).to(torch.int32)
    if num_top > 0:
        top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)
        out.logprob_token_ids = torch.cat([sampled, top_ids], dim=1).to(torch.int32)
        out.logprobs = torch.cat([sampled_logprobs, top_logprobs], dim=1)
    else:
        out.logprob_token_ids = sampled.to(torch.int32)
        out.logprobs = sampled_logprobs
