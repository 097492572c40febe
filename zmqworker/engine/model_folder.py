"""A checkpoint folder as the engine reads it: config.json before any worker starts, to
check the architecture and the layout and to size the KV cache, and the safetensors
headers, to refuse a quantized checkpoint (models/quantization.py); and the text side
(the tokenizer, through transformers; generation_config.json's defaults and EOS ids),
loaded while the workers start.

config.json is read as plain JSON (msgspec), not through transformers: for a local folder
PretrainedConfig's reader is that same JSON read behind transformers' import (which
brings torch's), and anything before the workers are spawned is on the critical path of
start-up (docs/architecture.md, "Start-up"). The engine needs six numbers, with
LlamaConfig's defaults where config.json leaves them out; the workers build the model's
own config (AutoConfig) themselves.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import psutil

from messages import CacheConfig, KVCacheSpec, SamplingParams
from messages.sampling import INT32_MAX
from zmqworker.cdiv import cdiv
from zmqworker.engine.prompts import check_text
from zmqworker.models.architectures import supported_architecture
from zmqworker.models.checkpoint_files import read_json
from zmqworker.models.expert_split import check_expert_split, moe_sizes
from zmqworker.models.hf_config import load_hf_config
from zmqworker.models.quantization import refuse_quantized

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# The tokenizer's JSON files, read whole before anything starts, each as strictly as what
# loads it does: tokenizers' serde_json, transformers' json (NaN, lone surrogates).
_TOKENIZER_JSON = {
    "tokenizer.json": msgspec.json.decode,
    "tokenizer_config.json": json.loads,
    "special_tokens_map.json": json.loads,
}
# generation_config.json keys that set a SamplingParams default, and the field they set.
_GENERATION_DEFAULTS = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


@dataclass(frozen=True)
class TextSide:
    """What turns text into tokens and back, and the model's own generation defaults."""

    tokenizer: Any  # a transformers tokenizer, or None when the folder has none
    default_sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    # generation_config.json's max_new_tokens, which bounds a server's max_tokens (vLLM's
    # rule), or None when it sets none.
    max_new_tokens: int | None = None

    def chat_prompt(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[dict[str, Any]] | None = None,
        chat_template: str | None = None,
    ) -> list[int]:
        """The token ids of a conversation, ending where the assistant's reply starts
        (add_generation_prompt=False: after the last message; continue_final_message:
        inside it, for the model to go on with it). The template writes the special
        tokens itself: add_special_tokens adds the tokenizer's (a BOS) again.
        template_kwargs: more variables for the template (vLLM's chat_template_kwargs,
        such as enable_thinking); as in vLLM they may set add_generation_prompt and
        continue_final_message too, but no other argument of apply_chat_template's.
        tools: the functions the model may call, in OpenAI's shape, for the template to
        write out (a template that knows no tools leaves them out, as transformers does).
        chat_template: a Jinja template to use instead of the tokenizer's (vLLM's)."""
        if self.tokenizer is None or (
            chat_template is None and not getattr(self.tokenizer, "chat_template", None)
        ):
            raise ValueError("the model's tokenizer has no chat template")
        check_conversation(messages)
        extra = dict(template_kwargs or {})
        for option in ("add_generation_prompt", "continue_final_message"):
            if not isinstance(extra.get(option, False), bool):
                raise ValueError(f"chat_template_kwargs: {option} must be true or false")
        add_generation_prompt = extra.pop("add_generation_prompt", add_generation_prompt)
        continue_final_message = extra.pop("continue_final_message", continue_final_message)
        if add_generation_prompt and continue_final_message:
            raise ValueError(
                "continue_final_message and add_generation_prompt cannot both be true: the "
                "reply either continues the last message or starts a new one"
            )
        if reserved := sorted(extra.keys() & TEMPLATE_ARGUMENTS):
            raise ValueError(
                f"chat_template_kwargs: {reserved[0]!r} is an argument of the chat template's "
                "rendering, not a template variable"
            )
        from jinja2 import TemplateError

        try:
            text = self.tokenizer.apply_chat_template(
                list(messages),
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=None if tools is None else list(tools),
                chat_template=chat_template,
                tokenize=False,
                **extra,
            )
        except (TemplateError, TypeError) as exc:  # the template refused this conversation
            raise ValueError(f"the chat template: {type(exc).__name__}: {exc}") from None
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))


# apply_chat_template's own arguments: not template variables a request may set.
TEMPLATE_ARGUMENTS = frozenset(
    {"conversation", "tools", "documents", "chat_template", "tokenize", "padding",
     "truncation", "max_length", "return_tensors", "return_dict",
     "return_assistant_tokens_mask", "tokenizer_kwargs", "messages"}
)  # fmt: skip


def check_conversation(messages: Sequence[dict[str, Any]]) -> None:
    """Refuse a conversation the chat template cannot take (needs no tokenizer)."""
    if not messages:
        raise ValueError("the conversation has no messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise ValueError(f"message {i}: expected {{'role': ..., 'content': str}}")
        if message.get("role") not in ("system", "user", "assistant", "tool"):
            raise ValueError(
                f"message {i}: role must be system, user, assistant or tool, got "
                f"{message.get('role')!r}"
            )
        check_text(message["content"], f"message {i}'s content")


class ModelFolder:
    """A Hugging Face checkpoint folder and its config."""

    def __init__(self, path: Path, config: dict[str, Any]) -> None:
        self.path = path
        self.config = config  # config.json as it is

    @classmethod
    def open(cls, model: str | None) -> ModelFolder:
        """The folder named by model (None: the embedded model), with its config read."""
        if model is None:
            from zmqworker.models.embedded import default_model_path

            model = default_model_path()
        path = Path(model).expanduser()
        if path.is_file():
            raise NotADirectoryError(_a_file(model, path))
        if not path.is_dir():
            raise FileNotFoundError(f"model folder {model!r} does not exist")
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"model folder {model!r} has no config.json: not a Hugging Face checkpoint"
            )
        try:
            config = msgspec.json.decode((path / "config.json").read_bytes(), type=dict[str, Any])
        except (OSError, msgspec.DecodeError) as exc:
            raise ValueError(f"cannot read {path / 'config.json'}: {exc}") from exc
        try:  # before the Llama-shaped fields: another family names them otherwise
            supported_architecture(config.get("architectures"), config.get("model_type"))
        except ValueError as exc:
            raise ValueError(f"{path / 'config.json'}: {exc}") from None
        for key in ("num_hidden_layers", "num_attention_heads", "hidden_size"):
            if not isinstance(config.get(key), int) or config[key] < 1:
                raise ValueError(f"{path / 'config.json'}: {key} must be a positive int")
        refuse_quantized(path, config)  # safetensors headers only: no tensor is read
        for name, parse in _TOKENIZER_JSON.items():  # one cut short: named now, not later
            if (path / name).is_file():
                try:
                    parse((path / name).read_bytes())
                except (OSError, ValueError) as exc:  # msgspec.DecodeError is a ValueError
                    raise ValueError(f"cannot read {path / name}: {exc}") from None
        return cls(path.resolve(), config)

    @property
    def num_layers(self) -> int:
        return self.config["num_hidden_layers"]

    @property
    def num_heads(self) -> int:
        return self.config["num_attention_heads"]

    @property
    def num_kv_heads(self) -> int:
        return int(self._filled("num_key_value_heads", self.num_heads))

    @property
    def head_dim(self) -> int:
        return int(self._filled("head_dim", self.config["hidden_size"] // self.num_heads))

    @property
    def vocab_size(self) -> int | None:
        return self.config.get("vocab_size")

    def pages_per_block(self, tp: int, pp: int) -> int:
        """The (layer, KV head) pages of one block on the worker holding the most: the
        layers of the largest of pp stages, the KV heads of a rank of tp."""
        return cdiv(self.num_layers, pp) * (self.num_kv_heads // tp)

    def tensor_parallel_sizes(self) -> list[int]:
        """The tensor-parallel sizes the model can be cut into."""
        return [n for n in range(1, self.num_kv_heads + 1) if self._splits(n)]

    def check_layout(self, tp: int, pp: int, expert_parallel: bool = False) -> None:
        """Refuse a layout the model cannot be cut into, before any process starts."""
        if not self._splits(tp):
            raise ValueError(
                f"tensor_parallel_size={tp} must divide the model's {self.num_heads} attention "
                f"heads and {self.num_kv_heads} KV heads: it can be "
                f"{' or '.join(map(str, self.tensor_parallel_sizes()))}"
            )
        if pp > self.num_layers:
            raise ValueError(
                f"pipeline_parallel_size={pp} is more than the model's {self.num_layers} layers"
            )
        sizes = moe_sizes(self.config)
        if sizes is not None:  # one data-parallel replica: the EP group is the TP group
            check_expert_split(sizes, tp, tp if expert_parallel else 1)

    def max_model_len(self, requested: int | None) -> int:
        limit = self.config.get("max_position_embeddings")
        if requested is None:
            if limit is None:
                raise ValueError("config.json has no max_position_embeddings: give max_model_len")
            return int(limit)
        if limit is not None and requested > limit:
            raise ValueError(
                f"max_model_len={requested} is more than the model's "
                f"max_position_embeddings={limit}"
            )
        return requested

    @property
    def has_tokenizer(self) -> bool:
        return any((self.path / name).is_file() for name in _TOKENIZER_FILES)

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the defaults generation_config.json sets. Read as plain
        JSON, as config.json is: transformers' GenerationConfig leaves these keys None
        unless the file sets them, so its to_diff_dict() would give the same values."""
        generation = self._generation_config()
        overrides = {
            field: generation[key]
            for key, field in _GENERATION_DEFAULTS.items()
            if generation.get(key) is not None
        }
        try:
            return msgspec.convert(
                {"type": "SamplingParams", **overrides}, SamplingParams, strict=False
            )
        except (msgspec.ValidationError, ValueError) as exc:
            raise ValueError(f"{self.path / 'generation_config.json'}: {exc}") from None

    def load_text_side(self) -> TextSide:
        tokenizer = None
        if self.has_tokenizer:
            from transformers import AutoTokenizer

            try:
                tokenizer = AutoTokenizer.from_pretrained(str(self.path))
            except Exception as exc:  # transformers' and tokenizers' errors name no file
                raise ValueError(
                    f"{self.path}: its tokenizer does not load: {type(exc).__name__}: {exc}"
                ) from exc
        ids: set[int] = set()
        sources = [self.config.get("eos_token_id"), self._generation_config().get("eos_token_id")]
        if tokenizer is not None:
            sources.append(tokenizer.eos_token_id)
        for source in sources:
            if isinstance(source, int):
                ids.add(source)
            elif isinstance(source, list):
                ids.update(t for t in source if isinstance(t, int))
        # An id the model cannot sample ends nothing, and one outside the wire's token
        # ids would make every request undecodable at the engine core.
        vocab = min(self.vocab_size or INT32_MAX + 1, INT32_MAX + 1)
        if outside := sorted(t for t in ids if not 0 <= t < vocab):
            logger.warning(
                "%s: end-of-sequence ids %s outside the vocabulary [0, %d) ignored",
                self.path, outside, vocab,
            )  # fmt: skip
            ids.difference_update(outside)
        defaults = self.default_sampling_params()
        bounded = self._generation_config().get("max_new_tokens") is not None
        return TextSide(
            tokenizer, defaults, frozenset(ids), defaults.max_tokens if bounded else None
        )

    def _filled(self, key: str, default: Any) -> Any:
        """config.json's value of key; where it has none, the model_type's default as
        transformers fills it in, which the workers build from (Qwen3's head_dim is 128,
        not hidden_size / heads; Mistral's 8 kv heads, not one per head); else default."""
        value = self.config.get(key)
        if value is None:
            value = getattr(load_hf_config(str(self.path)), key, None)
        return default if value is None else value

    def _generation_config(self) -> dict[str, Any]:
        return read_json(self.path / "generation_config.json")

    def _splits(self, tp: int) -> bool:
        return self.num_heads % tp == 0 and self.num_kv_heads % tp == 0


def cache_config_for(
    folder: ModelFolder,
    cache: CacheConfig,
    num_blocks: int,
    fill: bool,
    dtype: str,
    tp: int,
    pp: int,
    local_cpu: bool,
    replicas: int = 1,
) -> CacheConfig:
    """cache, with kv_cache_bytes set for CPU workers on this host (local_cpu) unless the
    user set it: num_blocks blocks, at most cpu_memory_fraction of the memory available
    now (shared by the ranks of every data-parallel replica); all of that when fill. The
    workers then skip profiling. Elsewhere the workers profile and fill their budget."""
    if cache.kv_cache_bytes is not None or not local_cpu:
        return cache
    page = KVCacheSpec(cache.block_size, 1, folder.head_dim, dtype, []).page_size_bytes
    block_bytes = page * folder.pages_per_block(tp, pp)
    cap = int(psutil.virtual_memory().available * cache.cpu_memory_fraction / (tp * pp * replicas))
    size = num_blocks * block_bytes
    if fill or size > cap:
        logger.info(
            "KV cache: %s of memory per worker (cpu_memory_fraction=%g)",
            _gib(cap),
            cache.cpu_memory_fraction,
        )
        size = cap
    return msgspec.structs.replace(cache, kv_cache_bytes=size)


def _a_file(model: str, path: Path) -> str:
    """What to give instead of the file path."""
    if path.suffix.lower() == ".gguf":
        return (
            f"model {model!r} is a GGUF file: GGUF is not loaded directly; convert it into a "
            "checkpoint folder with transformers (AutoModelForCausalLM.from_pretrained(folder, "
            "gguf_file=name).save_pretrained(out), the tokenizer likewise), as the embedded "
            "model is"
        )
    here = (
        f", here perhaps {str(path.parent)!r}" if path.suffix in (".json", ".safetensors") else ""
    )
    return (
        f"model {model!r} is a file, not a checkpoint folder: give the folder that holds "
        f"config.json and the *.safetensors weights{here}"
    )


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"
