"""Per-request sampling parameters (the subset a worker needs plus the engine's stop rules)."""

from __future__ import annotations

import math
from typing import Annotated

import msgspec
from msgspec import Meta


class SamplingParams(msgspec.Struct, tag=True, frozen=True, omit_defaults=True):
    """Sampling settings of one request.

    With a seed, the request's tokens depend only on the seed and its own logits, never on
    what else is in the batch. Every field is checked when the struct is made or decoded;
    a bad value is a ValueError (msgspec.ValidationError) that names the field.
    """

    temperature: Annotated[
        float, Meta(ge=0, description="sampling temperature; 0 is greedy; finite")
    ] = 1.0
    top_k: Annotated[
        int, Meta(ge=-1, description="keep the k most likely tokens; 0 or -1: all")
    ] = 0
    top_p: Annotated[
        float,
        Meta(
            gt=0,
            le=1,
            description="keep the smallest set of tokens whose probabilities sum to p; 1: all",
        ),
    ] = 1.0
    min_p: Annotated[
        float,
        Meta(
            ge=0,
            le=1,
            description="drop tokens less likely than min_p times the most likely; 0: none",
        ),
    ] = 0.0
    seed: Annotated[
        Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)] | None,
        Meta(description="per-request sampling seed (reproducible sampling); an int64"),
    ] = None
    max_tokens: Annotated[int, Meta(ge=1, description="the most tokens to generate")] = 16
    stop: Annotated[
        list[Annotated[str, Meta(min_length=1)]],
        Meta(description="strings that end the output (not included in it)"),
    ] = []
    stop_token_ids: Annotated[
        list[Annotated[int, Meta(ge=0)]],
        Meta(description="token ids that end the output, besides EOS"),
    ] = []
    ignore_eos: Annotated[
        bool, Meta(description="keep generating after the end-of-sequence token")
    ] = False
    logprobs: Annotated[
        Annotated[int, Meta(ge=0)] | None,
        Meta(
            description="return the log probability of each generated token and of the "
            "n most likely ones at its position (n at most the run's max_logprobs)"
        ),
    ] = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError (msgspec.ValidationError) naming the first field out of range.
        Decoding checks the Meta constraints; this makes SamplingParams(...) check them,
        and the one no Meta can say: an infinite temperature (NaN fails its >= 0)."""
        msgspec.convert(msgspec.structs.asdict(self), _Checked)
        if math.isinf(self.temperature):
            raise ValueError("temperature must be finite, got inf")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _unchecked_twin(cls: type[msgspec.Struct]) -> type[msgspec.Struct]:
    """A struct with cls's fields and no __post_init__: converting into it checks the
    constraints without building (and so checking) another cls."""
    fields = [
        (f.name, f.type, msgspec.field(default=f.default, default_factory=f.default_factory))
        for f in msgspec.structs.fields(cls)
    ]
    return msgspec.defstruct(f"_Checked{cls.__name__}", fields, kw_only=True)


_Checked = _unchecked_twin(SamplingParams)
