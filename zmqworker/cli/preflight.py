"""What `zmqworker generate` checks before any worker starts (check_run), and again with
the engine's own tokenizer once it is up, before anything is printed (engine_prompts).

Before the start: each prompt's sampling settings (the model's generation_config.json
defaults, then the options, then its JSONL line's fields, built into SamplingParams),
logprobs against max_logprobs, the token ids they name against the vocabulary (bad_words,
text, are tokenized by the engine), and each completion prompt's tokens: token ids
against the vocabulary, text counted with the checkpoint's tokenizer.json through the
tokenizers library (a fraction of a second; transformers wraps the same tokenizer.json,
but importing it takes seconds, which the engine spends while its workers start). A
prompt (cut to its truncate_prompt_tokens first, as the engine cuts it) and its
max_tokens must fit in max_model_len, as the server requires.
Conversations need the model's chat template, which transformers renders: their tokens
are counted once the engine is up, as every prompt is again there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from messages import SamplingParams
from zmqworker.cli.options import sampling_options
from zmqworker.cli.prompts import PromptItem
from zmqworker.cli.structured import FLAG as STRUCTURED
from zmqworker.engine.grammars import check_grammar
from zmqworker.engine.model_folder import ModelFolder, check_conversation
from zmqworker.engine.prompts import check_text, kept_tokens, prompt_token_ids, template_messages

# The option that sets each SamplingParams field, for messages.
FLAGS = {o.name: o.flags[0] for o in sampling_options()} | {"structured_outputs": STRUCTURED}


@dataclass(frozen=True)
class Job:
    """One prompt of the run, checked: its sampling settings, how the user set them
    (names: --max-tokens, or "max_tokens" on its JSONL line), its conversation for the
    chat template, and its token count when it was counted before the start."""

    item: PromptItem
    params: SamplingParams
    names: dict[str, str]
    conversation: list[dict[str, Any]] | None
    num_tokens: int | None


def check_run(
    items: Sequence[PromptItem],
    options: dict[str, Any],
    *,
    model: str | None,
    max_model_len: int | None,
    max_logprobs: int,
    chat: bool,
    system: str | None,
) -> list[Job]:
    """Every prompt checked, with its settings; options: the sampling options given. The
    other arguments are the LLM's and the command's."""
    if system is not None:
        check_text(system, "--system", from_bytes=True)
    for text in options.get("stop", []):
        check_text(text, "--stop", from_bytes=True)
    folder = ModelFolder.open(model)
    limits = _Limits(
        folder.max_model_len(max_model_len), max_logprobs, folder.vocab_size, folder.has_tokenizer
    )
    base = msgspec.structs.replace(folder.default_sampling_params(), **options)
    limits.check(base, {k: FLAGS[k] for k in options})
    limits.check_room(None, base, {k: FLAGS[k] for k in options})  # before any counting
    counts_text = not chat and any(isinstance(i.prompt, str) for i in items)
    tokenizer_json = folder.path / "tokenizer.json"
    tokenizer = _TokenizerJson(tokenizer_json) if counts_text and tokenizer_json.is_file() else None
    jobs = []
    for index, item in enumerate(items):
        names = {**{k: FLAGS[k] for k in options}, **{k: f'"{k}"' for k in item.sampling}}
        try:
            params = msgspec.structs.replace(base, **item.sampling)
            limits.check(params, names)
            conversation = _conversation(item, chat, system)
            num_tokens = None
            if conversation is not None:
                check_conversation(template_messages(conversation))  # as LLM.chat takes it
            elif tokenizer is not None or isinstance(item.prompt, list) or not folder.has_tokenizer:
                # Without any tokenizer, text is refused here as the engine would refuse it.
                keep = limits.keep(params)
                num_tokens = len(
                    prompt_token_ids(
                        item.prompt, tokenizer, limits.max_model_len, limits.vocab, keep
                    )
                )
            limits.check_room(num_tokens, params, names)
        except ValueError as exc:
            raise ValueError(f"{item.where(index)}: {exc}") from None
        jobs.append(Job(item, params, names, conversation, num_tokens))
    return jobs


def engine_prompts(llm: Any, jobs: Sequence[Job]) -> list[list[int]]:
    """Every prompt's token ids from the engine's own tokenizer (conversations through the
    chat template), checked as before the start: all of them before any runs."""
    limits = _Limits(llm.max_model_len, llm.max_logprobs, llm.vocab_size)
    prompts = []
    for index, job in enumerate(jobs):
        try:
            conversation = job.conversation
            ids = llm.encode(
                job.item.prompt if conversation is None else llm.chat_prompt(conversation),
                limits.keep(job.params),
            )
            limits.check_room(len(ids), job.params, job.names)
        except ValueError as exc:
            raise ValueError(f"{job.item.where(index)}: {exc}") from None
        prompts.append(ids)
    return prompts


class _TokenizerJson:
    """A checkpoint's tokenizer.json, encoding as transformers' tokenizer.encode does
    (special tokens added; no truncation, no padding)."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        try:
            self._tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers' error names no file
            raise ValueError(f"{path} does not load: {exc}") from None
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=True).ids


def _conversation(item: PromptItem, chat: bool, system: str | None) -> list[dict] | None:
    """The messages the chat template gets (None: a completion prompt). With --chat a text
    prompt is the user's message; --system comes first unless the conversation has one."""
    if item.messages is None and not chat:
        return None
    if item.messages is None and not isinstance(item.prompt, str):
        raise ValueError("--chat needs text prompts, not token ids")
    messages = item.messages or [{"role": "user", "content": item.prompt}]
    first = messages[0]
    if system is not None and not (isinstance(first, dict) and first.get("role") == "system"):
        messages = [{"role": "system", "content": system}, *messages]
    return messages


@dataclass(frozen=True)
class _Limits:
    """The run's limits on a prompt's settings and tokens."""

    max_model_len: int
    max_logprobs: int
    vocab: int | None
    has_tokenizer: bool = True

    def check(self, params: SamplingParams, names: dict[str, str]) -> None:
        self.keep(params)  # truncate_prompt_tokens past max_model_len: refused before the start
        # These work on the tokens' text.
        texts = [f for f in ("structured_outputs", "bad_words", "stop") if getattr(params, f)]
        if texts and not self.has_tokenizer:
            name = _name(texts[0], names)
            raise ValueError(f"{name} needs the model's tokenizer, which it lacks")
        if params.structured_outputs is not None:
            try:
                check_grammar(params.structured_outputs)
            except ValueError as exc:
                raise ValueError(f"{_name('structured_outputs', names)}: {exc}") from None
        over = params.logprobs_over(self.max_logprobs)
        if over is not None:
            raise ValueError(
                f"{_name(over[0], names)} {over[1]} is more than max_logprobs="
                f"{self.max_logprobs} (--max-logprobs sets it; -1: no limit)"
            )
        if self.vocab is None:
            return
        outside = params.token_id_outside(self.vocab)
        if outside is not None:
            field, token = outside
            raise ValueError(
                f"{_name(field, names)} {token} is outside the vocabulary [0, {self.vocab})"
            )

    def keep(self, params: SamplingParams) -> int | None:
        """How many of a prompt's last tokens params keep (truncate_prompt_tokens): the
        prompt is counted as the engine will cut it."""
        return kept_tokens(params.truncate_prompt_tokens, self.max_model_len)

    def check_room(self, num_tokens: int | None, params: SamplingParams, names: dict) -> None:
        """The prompt and max_tokens must fit in max_model_len, as the server requires
        (the engine would stop at the model's length, maybe hours later). Not counted yet,
        the prompt has one token at least."""
        room = self.max_model_len - (num_tokens or 1)
        if params.max_tokens <= room:
            return
        max_tokens = f"{_name('max_tokens', names)} {params.max_tokens}"
        if num_tokens is None:
            raise ValueError(
                f"{max_tokens} leaves no room for a prompt in max_model_len="
                f"{self.max_model_len}: at most {room}"
            )
        raise ValueError(
            f"the prompt has {_tokens(num_tokens)}; with {max_tokens} that is "
            f"{num_tokens + params.max_tokens}, more than max_model_len={self.max_model_len}"
            + (f": at most {room} fit after it" if room > 0 else "")
        )


def _name(field: str, names: dict[str, str]) -> str:
    """How the user set field: --max-tokens, "max_tokens" (a JSONL line), or not at all."""
    return names.get(field, f"the default {field}")


def _tokens(n: int) -> str:
    return f"{n} token" + ("" if n == 1 else "s")
