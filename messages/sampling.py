"""Per-request sampling parameters (the subset a worker needs plus the engine's stop rules)."""

from __future__ import annotations

import msgspec


class SamplingParams(msgspec.Struct, tag=True, frozen=True, omit_defaults=True):
    """Sampling settings of one request.

    temperature 0 means greedy. top_k <= 0 and top_p >= 1 and min_p <= 0 disable those
    filters. With a seed, the request's tokens depend only on the seed and its own logits,
    never on what else is in the batch. logprobs asks for the top-n log probabilities of
    each sampled position (plus the sampled token's own).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None

    def validate(self) -> None:
        """Raise ValueError naming the first field that is out of range."""
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
