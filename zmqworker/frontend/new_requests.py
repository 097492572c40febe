"""Prompts and their sampling params as request states, checked before any is sent: a
state per sample (n), with ids unique among the clients of an engine core."""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Sequence

import msgspec

from messages import SamplingParams
from zmqworker.engine.model_folder import TextSide
from zmqworker.engine.prompts import Prompt, kept_tokens, prompt_list, prompt_token_ids
from zmqworker.frontend.detokenizer import IncrementalDetokenizer
from zmqworker.frontend.request_params import for_prompt, request_params
from zmqworker.frontend.request_state import RequestState


class NewRequests:
    """The request states of a client's prompts."""

    def __init__(
        self,
        texts: TextSide,
        vocab_size: int,
        max_model_len: int,
        max_logprobs: int,
        client_index: int,
    ) -> None:
        self.texts = texts
        self.tokenizer = texts.tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_logprobs = max_logprobs
        # Those besides the tokenizer's own, which vLLM reports as a stop token's id.
        self._eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        self._extra_eos = texts.eos_token_ids - {self._eos}
        self._ids = itertools.count()
        # Unique among the clients of an engine core, which keys requests by id alone:
        # independent clients (two servers, an LLM) may share an engine core.
        self._id_prefix = f"req-{secrets.token_hex(4)}-{client_index}-"

    def encode(self, prompt: Prompt, keep: int | None = None) -> list[int]:
        """The prompt's token ids (text goes through the tokenizer), checked against the
        model: not empty, within max_model_len and the vocabulary; keep: only the last
        keep (engine/prompts.kept_tokens)."""
        return prompt_token_ids(prompt, self.tokenizer, self.max_model_len, self.vocab_size, keep)

    def make(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        streamed: bool,
    ) -> list[RequestState]:
        """Validated request states for every prompt, or an error before any is sent;
        streamed: their callers take every output, not only the last."""
        prompts = prompt_list(prompts)
        if isinstance(sampling_params, (dict, str)):  # a sequence, but not of params
            raise ValueError(
                f"sampling_params must be a SamplingParams or one per prompt, not a "
                f"{type(sampling_params).__name__}: SamplingParams(**fields) makes one"
            )
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.texts.default_sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(
                    f"{len(params)} sampling params for {len(prompts)} prompts: give one, "
                    "or one per prompt"
                )
        states = []
        for index, (prompt, param) in enumerate(zip(prompts, params, strict=True)):
            try:
                states.extend(self._samples(prompt, param, streamed))
            except ValueError as exc:
                raise ValueError(f"prompt {index}: {exc}") from None
        return states

    def _samples(
        self, prompt: Prompt, params: SamplingParams, streamed: bool
    ) -> list[RequestState]:
        """A request state per sample (params.n) of the prompt, tokenized once, and params
        resolved for its length (request_params.for_prompt: max_tokens=None as the room it
        leaves), cut to its last truncate_prompt_tokens first (kept_tokens, as the server's
        option is: the engine core gets the kept tokens only). The samples are requests of
        their own (ids "<id>.<i>") with n=1 and, with a seed, seed + i as vLLM's are (the
        one that would be -1, which means no seed, takes seed + n); the
        first computes the prompt, the others share its KV (engine/prompt_sharing.py).
        Prompt logprobs are the same for every sample: only the first asks the engine core
        for them (a request that asks computes its whole prompt, sharing nothing), and
        every sample's outputs carry them."""
        params = request_params(params, self.tokenizer, self.vocab_size, self.max_logprobs)
        token_ids = self.encode(
            prompt, kept_tokens(params.truncate_prompt_tokens, self.max_model_len)
        )
        params = for_prompt(params, len(token_ids), self.max_model_len)  # before n's copies
        request_id = f"{self._id_prefix}{next(self._ids)}"
        if params.n == 1:
            return [self._state(request_id, prompt, token_ids, params, streamed)]
        states = []
        for i in range(params.n):
            seed = params.seed
            if seed is not None:  # seed + i, wrapped to an int64; -1 would be none
                seed = (seed + (i if seed + i != -1 else params.n) + 2**63) % 2**64 - 2**63
            sample = msgspec.structs.replace(params, n=1, seed=seed)
            first = states[0] if states else None
            if first is not None and params.prompt_logprobs is not None:
                sample = msgspec.structs.replace(sample, prompt_logprobs=None)  # the first's
            states.append(
                self._state(f"{request_id}.{i}", prompt, token_ids, sample, streamed, i, first)
            )
        return states

    def _state(
        self,
        request_id: str,
        prompt: Prompt,
        token_ids: list[int],
        params: SamplingParams,
        streamed: bool,
        index: int = 0,
        first: RequestState | None = None,
    ) -> RequestState:
        """first: the prompt's first sample, which this one shares the prompt's KV and
        prompt logprobs with (n > 1)."""
        detokenizer = None  # detokenize=False: token ids only, no text work at all
        if self.tokenizer is not None and params.detokenize:
            detokenizer = IncrementalDetokenizer(
                self.tokenizer, token_ids, params.skip_special_tokens
            )
        asked = first is not None and first.params.prompt_logprobs is not None
        return RequestState(
            request_id,
            prompt if isinstance(prompt, str) else None,
            token_ids,
            params,
            detokenizer,
            index=index,
            shares_prompt_with=None if first is None else first.request_id,
            streamed=streamed,
            prompt_logprobs_from=first if asked else None,
            extra_eos_token_ids=self._extra_eos,
            eos_token_id=self._eos,
        )
