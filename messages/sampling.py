"""Per-request sampling parameters (the subset a worker needs plus the engine's stop rules).

The penalties, logit_bias, min_tokens, bad words and allowed_token_ids are vLLM's
SamplingParams fields, with its ranges and meaning; the workers apply them on the device
(model_runner/penalties.py).
bad_words are text, which only the engine can tokenize: it fills bad_words_token_ids from
them (engine/bad_words.py), and the workers read the token ids alone.
detokenize and truncate_prompt_tokens (vLLM's) are the client's: it skips the text work,
and sends the prompt's last k tokens (frontend/new_requests.py).
"""

from __future__ import annotations

from numbers import Integral, Real
from typing import Annotated

import msgspec
from msgspec import Meta

from messages.structured_outputs import StructuredOutputsParams

# Bounds on bad_words_token_ids, which a worker matches against every step's outputs.
MAX_BAD_WORDS = 1024
MAX_BAD_WORD_TOKENS = 64
# The most samples of one prompt (n): each is a request in the engine core.
MAX_N = 128
# Token ids, top_k, min_tokens and top-n logprobs land in the workers' int32 columns.
INT32_MAX = 2**31 - 1
# The largest float32: the workers keep temperatures and penalties in float32 columns,
# where a larger finite value would be inf (and a masked logit over it NaN).
FLOAT32_MAX = 3.4028234663852886e38
TokenId = Annotated[int, Meta(ge=0, le=INT32_MAX)]


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
        int,
        Meta(
            ge=-1,
            le=INT32_MAX,
            description="keep the k most likely tokens; 0, -1 or more than the vocabulary: all",
        ),
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
        Meta(
            description="per-request sampling seed (reproducible sampling); an int64; -1 "
            "is None (vLLM's)"
        ),
    ] = None
    max_tokens: Annotated[int, Meta(ge=1, description="the most tokens to generate")] = 16
    n: Annotated[
        int,
        Meta(
            ge=1,
            le=MAX_N,
            description="samples to generate from the prompt (its KV computed once); with "
            "a seed, sample i uses seed + i",
        ),
    ] = 1
    stop: Annotated[
        list[Annotated[str, Meta(min_length=1)]],
        Meta(
            description="strings that end the output (not included in it, unless "
            "include_stop_str_in_output)"
        ),
    ] = []
    stop_token_ids: Annotated[
        list[TokenId],
        Meta(description="token ids that end the output, besides EOS (within the vocabulary)"),
    ] = []
    ignore_eos: Annotated[
        bool, Meta(description="keep generating after the end-of-sequence token")
    ] = False
    include_stop_str_in_output: Annotated[
        bool,
        Meta(
            description="keep the stop string, or the text of the stop token, that ended "
            "the output at its end"
        ),
    ] = False
    skip_special_tokens: Annotated[
        bool, Meta(description="leave special tokens out of the output's text")
    ] = True
    detokenize: Annotated[
        bool,
        Meta(
            description="decode the output's text (vLLM's); false: token ids only, no text, "
            "no logprob token texts and no stop strings (the client's: it skips the work)"
        ),
    ] = True
    logprobs: Annotated[
        Annotated[int, Meta(ge=0, le=INT32_MAX)] | None,
        Meta(
            description="return the log probability of each generated token and of the "
            "n most likely ones at its position (n at most the run's max_logprobs)"
        ),
    ] = None
    prompt_logprobs: Annotated[
        Annotated[int, Meta(ge=-1, le=INT32_MAX)] | None,
        Meta(
            description="return, at every prompt position after the first, the log "
            "probability of the prompt's token and of the n most likely ones there (n at "
            "most the run's max_logprobs; vLLM's -1, the whole vocabulary, is refused); "
            "such a request takes no prefix-cache hits"
        ),
    ] = None

    presence_penalty: Annotated[
        float,
        Meta(
            ge=-2,
            le=2,
            description="subtract this from the logit of each token the output already "
            "holds; 0: off",
        ),
    ] = 0.0
    frequency_penalty: Annotated[
        float,
        Meta(
            ge=-2,
            le=2,
            description="subtract this times its count in the output from each token's "
            "logit; 0: off",
        ),
    ] = 0.0
    repetition_penalty: Annotated[
        float,
        Meta(
            gt=0,
            description="divide the positive logits, and multiply the negative ones, of the "
            "tokens in the prompt or the output by this; 1: off; finite",
        ),
    ] = 1.0
    logit_bias: Annotated[
        dict[TokenId, Annotated[float, Meta(ge=-100, le=100)]],
        Meta(
            description="add BIAS, in [-100, 100], to the logit of token ID",
            extra={"metavar": "ID=BIAS"},
        ),
    ] = {}
    min_tokens: Annotated[
        int,
        Meta(
            ge=0,
            le=INT32_MAX,
            description="generate at least this many tokens before EOS, a stop token id or "
            "a stop string may end the output (at most max_tokens)",
        ),
    ] = 0
    bad_words: Annotated[
        list[Annotated[str, Meta(min_length=1)]],
        Meta(
            description="words the output may not hold (the engine bans their tokens, "
            "with and without a leading space)"
        ),
    ] = []
    bad_words_token_ids: Annotated[
        list[Annotated[list[TokenId], Meta(min_length=1, max_length=MAX_BAD_WORD_TOKENS)]],
        Meta(
            max_length=MAX_BAD_WORDS,
            description="token id sequences the output may not hold, each as IDS (1,2,3): "
            "its last token is banned where the output ends with the ones before it; the "
            "engine adds those of bad_words here",
            extra={"metavar": "IDS"},
        ),
    ] = []
    allowed_token_ids: Annotated[
        list[TokenId] | None,
        Meta(
            description="only these token ids may be sampled (every other logit is -inf); "
            "non-empty, each within the vocabulary; None: every token"
        ),
    ] = None
    truncate_prompt_tokens: Annotated[
        Annotated[int, Meta(ge=-1, le=INT32_MAX)] | None,
        Meta(
            description="keep only the prompt's last k tokens (vLLM's); -1: up to "
            "max_model_len; at most max_model_len (the client cuts the prompt)"
        ),
    ] = None

    structured_outputs: Annotated[
        StructuredOutputsParams | None,
        Meta(description="constrain the output to a JSON schema, a regex, a choice or a grammar"),
    ] = None

    def __post_init__(self) -> None:
        _normalise(self)
        self.validate()

    def validate(self) -> None:
        """Raise ValueError (msgspec.ValidationError) naming the first field out of range.
        Decoding checks the Meta constraints; this makes SamplingParams(...) check them,
        and the one no Meta says: a temperature or repetition penalty the workers' float32
        holds as a finite number (NaN fails their lower bounds)."""
        _check_allowed(self.allowed_token_ids)  # before the schema's check: a plainer error
        msgspec.convert(msgspec.structs.asdict(self), _Checked)
        for name in ("temperature", "repetition_penalty"):
            if (value := getattr(self, name)) > FLOAT32_MAX:
                raise ValueError(
                    f"{name} must be finite in float32 (at most {FLOAT32_MAX:.8g}), got {value}"
                )
        if self.prompt_logprobs == -1:
            raise ValueError(
                "prompt_logprobs=-1 (the whole vocabulary at every prompt position) is not "
                "supported: it would hold prompt x vocabulary logprobs; ask for a top-n"
            )
        if self.truncate_prompt_tokens == 0:
            raise ValueError("truncate_prompt_tokens must be -1 or at least 1, got 0")
        if self.stop and not self.detokenize:  # vLLM's refusal: stop strings are text
            raise ValueError(
                "stop strings are only supported when detokenize is True: set "
                "detokenize=True to use stop"
            )
        if self.structured_outputs is not None and self.min_tokens:
            # The grammar's end allows only EOS, which min_tokens would hold back.
            raise ValueError("min_tokens cannot be combined with structured_outputs")
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})"
            )

    def logprobs_over(self, max_logprobs: int) -> tuple[str, int] | None:
        """(field, value) of the first of logprobs and prompt_logprobs that asks for more
        than max_logprobs (-1: no limit); None when neither does."""
        for field in ("logprobs", "prompt_logprobs"):
            value = getattr(self, field)
            if value is not None and 0 <= max_logprobs < value:
                return field, value
        return None

    def for_workers(self) -> SamplingParams:
        """These params as a step carries them to the workers: without what only the
        engine and the client read (stop strings, bad words as text, the structured-output
        constraint, which may be a large JSON schema)."""
        if not (self.stop or self.bad_words or self.structured_outputs is not None):
            return self
        return msgspec.structs.replace(self, stop=[], bad_words=[], structured_outputs=None)

    def token_id_outside(self, vocab_size: int) -> tuple[str, int] | None:
        """(field, id) of the first token id at or above vocab_size in stop_token_ids,
        logit_bias, bad_words_token_ids and allowed_token_ids; None when every one is
        within it."""
        fields = {
            "stop_token_ids": self.stop_token_ids,
            "logit_bias": self.logit_bias,
            "bad_words_token_ids": [t for word in self.bad_words_token_ids for t in word],
            "allowed_token_ids": self.allowed_token_ids or [],
        }
        for field, ids in fields.items():
            outside = [t for t in ids if t >= vocab_size]
            if outside:
                return field, outside[0]
        return None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """True when the repetition, frequency or presence penalty is on."""
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )


# Scalars that may come as numpy's (np.int64, np.float32): made Python numbers.
_NUMBERS = ("temperature", "top_k", "top_p", "min_p", "seed", "max_tokens", "n", "logprobs",
            "prompt_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty",
            "min_tokens", "truncate_prompt_tokens")  # fmt: skip
_LISTS = {"stop": list, "stop_token_ids": list, "bad_words": list, "logit_bias": dict}


def _normalise(params: SamplingParams) -> None:
    """What vLLM's SamplingParams also takes, as the schema's types (no wire change): a
    lone stop string as a list, None for a list or dict field as its default (empty),
    numpy scalars as Python numbers, seed=-1 as None. max_tokens=None (vLLM: up to
    max_model_len, less the prompt) is marked INT32_MAX, more than any context holds: the
    frontend sends each prompt's room instead (frontend/request_params.py, for_prompt),
    and an engine core that gets the mark stops at max_model_len all the same."""
    set_field = msgspec.structs.force_setattr
    if isinstance(params.stop, str):
        set_field(params, "stop", [params.stop])
    for name, empty in _LISTS.items():
        if getattr(params, name) is None:
            set_field(params, name, empty())
    for name in _NUMBERS:
        value = getattr(params, name)
        if type(value) in (int, float) or value is None or isinstance(value, bool):
            continue
        if isinstance(value, Integral):
            set_field(params, name, int(value))
        elif isinstance(value, Real):
            set_field(params, name, float(value))
    if params.stop_token_ids and any(type(t) is not int for t in params.stop_token_ids):
        ids = params.stop_token_ids
        set_field(params, "stop_token_ids", [_int(t) for t in ids])
    allowed = params.allowed_token_ids
    # vLLM's callers may give a tuple, or numpy's ids (a C-speed check: the list may be long).
    if isinstance(allowed, tuple) or (
        isinstance(allowed, list) and set(map(type, allowed)) - {int}
    ):
        set_field(params, "allowed_token_ids", [_int(t) for t in allowed])
    if params.max_tokens is None:
        set_field(params, "max_tokens", INT32_MAX)  # an int on the wire, as the schema says
    if params.seed == -1:  # vLLM's "no seed": clients send it for a random one
        set_field(params, "seed", None)


def _check_allowed(ids: list[int] | None) -> None:
    """vLLM's checks of allowed_token_ids that need no vocabulary, naming the bad id (the
    vocabulary's bound: token_id_outside, where the run is known)."""
    if ids is None or not isinstance(ids, list):
        return  # not a list: the schema's check names it
    if not ids:
        raise ValueError(
            "allowed_token_ids is empty: it would allow no token (None allows every token)"
        )
    try:
        low, high = min(ids), max(ids)  # at C speed: the list may hold the whole vocabulary
    except TypeError:
        return  # not all numbers: the schema's check names the first that is not an int
    for bad in (low, high):
        if isinstance(bad, int) and not 0 <= bad <= INT32_MAX:
            raise ValueError(
                f"allowed_token_ids: token id {bad} is outside the vocabulary (token ids are "
                "in [0, vocabulary size))"
            )


def _int(value: object) -> object:
    """A numpy integer as an int; anything else as it is (for the check to name)."""
    return int(value) if isinstance(value, Integral) and not isinstance(value, bool) else value


def _unchecked_twin(cls: type[msgspec.Struct]) -> type[msgspec.Struct]:
    """A struct with cls's fields and no __post_init__: converting into it checks the
    constraints without building (and so checking) another cls."""
    fields = [
        (f.name, f.type, msgspec.field(default=f.default, default_factory=f.default_factory))
        for f in msgspec.structs.fields(cls)
    ]
    return msgspec.defstruct(f"_Checked{cls.__name__}", fields, kw_only=True)


_Checked = _unchecked_twin(SamplingParams)
