"""Test doubles for the engine: small tokenizers built in code, and a fake executor whose
fake workers follow the SchedulerOutput contract over a KV cache of token ids, checking
every delta the engine sends."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from messages import (
    KVCacheConfig,
    KVCacheSpec,
    ModelRunnerOutput,
    SamplingParams,
    SchedulerOutput,
)

CORPUS = [
    "The capital of France is Paris. The end.",
    "Hello world! Héllo wörld, naïve café 😀 日本語 ok",
    "stop here STOP now, and then some more words to merge",
]
SPECIAL = ["<unk>", "<s>", "</s>"]


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """GPT-2 style byte-level BPE (like SmolLM2's): characters split into byte tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIAL,
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 3, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def sentencepiece_tokenizer() -> PreTrainedTokenizerFast:
    """Llama-2 style: "▁" for spaces (dropped at the start of a decode), byte fallback."""
    vocab = {name: i for i, name in enumerate(SPECIAL)}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for char in "▁abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.,!?'":
        vocab.setdefault(char, len(vocab))
    merges = []
    for word in ["▁the", "▁capital", "▁of", "▁France", "▁is", "▁Paris", "▁Hello", "▁world"]:
        for i in range(2, len(word) + 1):
            if word[:i] not in vocab:
                vocab[word[:i]] = len(vocab)
                merges.append((word[: i - 1], word[i - 1]))
    model = models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>")
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
         decoders.Strip(" ", 1, 0)]
    )  # fmt: skip
    tok.add_special_tokens([AddedToken(name, special=True) for name in SPECIAL])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


TokenFn = Callable[[list[int]], int]


def mixing_token_fn(vocab_size: int) -> TokenFn:
    """A deterministic 'model': the next token depends on every token before it."""
    return lambda seq: (sum((i + 1) * t for i, t in enumerate(seq)) * 31 + 7) % vocab_size


def scheduled_handles(so: SchedulerOutput) -> set[int]:
    """The handles of the requests a step computes."""
    new = {r.req_handle for r in so.scheduled_new_reqs}
    return new | set(so.scheduled_cached_reqs.req_handles.tolist())


def reference_tokens(prompt: list[int], num_tokens: int, token_fn: TokenFn) -> list[int]:
    seq = list(prompt)
    for _ in range(num_tokens):
        seq.append(token_fn(seq))
    return seq[len(prompt) :]


@dataclass
class _RequestState:
    req_id: str
    tokens: list[int]
    blocks: list[int]
    num_computed: int
    last_sampled: int = -1  # the position this stage sampled last, for placeholders


@dataclass
class FakeWorker:
    """One pipeline stage. The KV cache stores each position's token id, so attention
    'reads' the sequence back through the block table: a block shared or reused wrongly
    changes the sampled tokens. A stage that does not sample takes new tokens from the
    deltas, as a non-last pipeline stage does."""

    num_blocks: int
    block_size: int
    token_fn: TokenFn
    samples: bool = True
    # Workers ignore unknown finished handles; the engine reports each once, unless it
    # is recovering from a failed step.
    strict_finished: bool = True
    num_host_blocks: int = 0  # host tier slots: copies of kv's blocks
    kv: list[list[int | None]] = field(init=False)
    host: list[list[int | None]] = field(init=False)
    reqs: dict[int, _RequestState] = field(default_factory=dict)
    parked: dict[int, _RequestState] = field(default_factory=dict)  # preempted
    steps: list[SchedulerOutput] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.kv = [[None] * self.block_size for _ in range(self.num_blocks)]
        self.host = [[None] * self.block_size for _ in range(self.num_host_blocks)]

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.steps.append(so)
        copies = so.kv_connector_metadata.host if so.kv_connector_metadata else None
        if copies is not None:  # before the forward: stores, then loads
            for block, slot in zip(copies.store_blocks, copies.store_slots, strict=True):
                self.host[slot] = list(self.kv[block])
            for slot, block in zip(copies.load_slots, copies.load_blocks, strict=True):
                self.kv[block] = list(self.host[slot])
        assert not set(so.finished_req_handles) & set(so.preempted_req_handles)
        for handle in so.finished_req_handles:
            known = handle in self.reqs or handle in self.parked
            assert known or not self.strict_finished, f"finished handle {handle} unknown"
            self.reqs.pop(handle, None)
            self.parked.pop(handle, None)
        for handle in so.preempted_req_handles:
            self.parked[handle] = self.reqs.pop(handle)
        cached = so.scheduled_cached_reqs
        assert not cached.resumed_req_handles, "preemption is by recompute"
        scheduled: list[tuple[int, int]] = []  # (handle, tokens to compute)
        for new in so.scheduled_new_reqs:
            assert new.req_handle not in self.reqs, f"new handle {new.req_handle} is live"
            assert new.req_handle >= 0
            self.parked.pop(new.req_handle, None)  # a preempted request starting over
            state = _RequestState(
                new.req_id,
                new.prompt_token_ids.tolist(),
                new.block_ids.tolist(),
                new.num_computed_tokens,
            )
            self.reqs[new.req_handle] = state
            self._check_context(state)  # prefix-cache hits hold the right tokens
            scheduled.append((new.req_handle, new.num_scheduled_tokens))
        blocks = cached.new_block_ids.tolist() if cached.new_block_ids is not None else []
        tokens = cached.new_token_ids.tolist() if cached.new_token_ids is not None else []
        for i, handle in enumerate(cached.req_handles.tolist()):
            state = self.reqs[handle]
            assert int(cached.num_computed_tokens[i]) == state.num_computed, handle
            num_blocks, num_tokens = int(cached.num_new_blocks[i]), int(cached.num_new_tokens[i])
            assert not set(blocks[:num_blocks]) & set(state.blocks), "block sent twice"
            state.blocks += blocks[:num_blocks]
            del blocks[:num_blocks]
            # Tokens from position num_computed on: append those not held, check the rest.
            for pos, token in enumerate(tokens[:num_tokens], start=state.num_computed):
                if pos < len(state.tokens):
                    assert state.tokens[pos] == token, f"handle {handle}: token {pos} differs"
                else:
                    assert pos == len(state.tokens), f"handle {handle}: gap in new tokens"
                    state.tokens.append(token)
            del tokens[:num_tokens]
            num_scheduled = int(cached.num_scheduled_tokens[i])
            if cached.num_placeholders[i]:
                # The engine has not seen the token: it is this stage's last sample.
                assert self.samples and cached.num_placeholders[i] == 1, handle
                assert state.last_sampled == state.num_computed + num_scheduled - 1, handle
            scheduled.append((handle, num_scheduled))
        assert not blocks and not tokens, "ragged columns do not add up"
        assert sum(n for _, n in scheduled) == so.total_num_scheduled_tokens
        owners = Counter(b for state in self.reqs.values() for b in state.blocks)
        for handle, num in scheduled:
            state = self.reqs[handle]
            end = state.num_computed + num
            assert num >= 1 and end <= len(state.tokens), (handle, state.num_computed, num)
            assert len(state.blocks) * self.block_size >= end, f"handle {handle}: no room"
            for pos in range(state.num_computed, end):
                block = state.blocks[pos // self.block_size]
                assert owners[block] == 1, f"block {block} written while shared"
                self.kv[block][pos % self.block_size] = state.tokens[pos]
            state.num_computed = end
        sampled = []
        for handle, _ in scheduled:
            state = self.reqs[handle]
            if state.num_computed < len(state.tokens):
                sampled.append(-1)
                continue
            self._check_context(state)
            token = self.token_fn(state.tokens)
            if self.samples:
                state.last_sampled = len(state.tokens)
                state.tokens.append(token)
            sampled.append(token)
        return ModelRunnerOutput(
            req_handles=np.array([h for h, _ in scheduled], np.int32),
            sampled_token_ids=np.array(sampled, np.int32),
        )

    def _check_context(self, state: _RequestState) -> None:
        size = self.block_size
        read = [self.kv[state.blocks[p // size]][p % size] for p in range(state.num_computed)]
        assert read == state.tokens[: state.num_computed], f"{state.req_id}: KV cache corrupt"


class _LazyFuture(Future):
    """A step's future that the fake pipeline finishes (with every older step) only when
    someone asks for its result, so one thread can keep several steps in flight."""

    def __init__(self, executor: FakeExecutor) -> None:
        super().__init__()
        self._executor = executor

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        self._executor.complete_through(self)
        return super().result(timeout)


class FakeExecutor:
    """The Executor interface over FakeWorkers (one per pipeline stage; the last samples).

    defer: execute_model(non_block=True) returns futures completed only when waited on,
    oldest first, as a pipeline would; in_flight_at_submit records, for each step sent,
    the handle sets of the steps already in flight then.
    """

    failure = None  # fake workers never die

    def __init__(
        self,
        num_blocks: int = 64,
        block_size: int = 4,
        token_fn: TokenFn | None = None,
        pipeline_parallel_size: int = 1,
        num_layers: int = 2,
        defer: bool = False,
    ) -> None:
        self.num_blocks_offered = num_blocks
        self.block_size = block_size
        self.token_fn = token_fn or mixing_token_fn(50)
        self.pp = pipeline_parallel_size
        self.defer = defer
        self.calls: list[str] = []
        self.specs = [
            KVCacheSpec(block_size, 2, 8, "float32", [f"layers.{stage * num_layers + i}"
                                                     for i in range(num_layers)])
            for stage in range(pipeline_parallel_size)
        ]  # fmt: skip
        self.kv_cache_config: KVCacheConfig | None = None
        self.workers: list[FakeWorker] = []
        self.pending: list[tuple[SchedulerOutput, Future[ModelRunnerOutput]]] = []
        self.in_flight_at_submit: list[list[set[int]]] = []
        self.is_shut_down = False

    @property
    def max_concurrent_batches(self) -> int:
        return self.pp

    def determine_available_memory(self) -> list[int]:
        self.calls.append("determine_available_memory")
        blocks = self.num_blocks_offered
        return [blocks * s.page_size_bytes * len(s.layer_names) for s in self.specs]

    def get_kv_cache_specs(self) -> list[KVCacheSpec]:
        self.calls.append("get_kv_cache_specs")
        return self.specs

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        self.calls.append("initialize_from_config")
        self.kv_cache_config = kv_cache_config
        self.workers = [
            FakeWorker(kv_cache_config.num_blocks, self.block_size, self.token_fn,
                       samples=stage == self.pp - 1,
                       num_host_blocks=kv_cache_config.num_host_blocks)
            for stage in range(self.pp)
        ]  # fmt: skip

    def compile_or_warm_up_model(self) -> list[float]:
        self.calls.append("compile_or_warm_up_model")
        return [0.0] * self.pp

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        self.calls.append("execute_model")
        if not non_block:
            return self._run(scheduler_output)
        self.in_flight_at_submit.append([scheduled_handles(so) for so, _ in self.pending])
        future: Future[ModelRunnerOutput] = _LazyFuture(self) if self.defer else Future()
        self.pending.append((scheduler_output, future))
        if not self.defer:
            self.complete_through(future)
        return future

    def complete_through(self, future: Future[ModelRunnerOutput]) -> None:
        """Run the pending steps in order, up to and including future's."""
        while any(f is future for _, f in self.pending):
            so, oldest = self.pending.pop(0)
            oldest.set_result(self._run(so))

    def check_health(self, timeout: float = 30.0) -> None:
        assert not self.is_shut_down

    def shutdown(self) -> None:
        self.is_shut_down = True

    def forget_transfer_reports(self) -> None:
        """No KV transfer here: nothing to forget."""

    def _run(self, so: SchedulerOutput) -> ModelRunnerOutput:
        outputs = [worker.execute(so) for worker in self.workers]
        last = self.workers[-1]
        for stage in self.workers[:-1]:
            # Earlier stages learn the sampled tokens from the deltas, in time.
            for handle, token in zip(
                outputs[-1].req_handles.tolist(),
                outputs[-1].sampled_token_ids.tolist(),
                strict=True,
            ):
                expected = last.reqs[handle].tokens[: -1 if token >= 0 else None]
                assert stage.reqs[handle].tokens == expected, f"stage tokens differ ({handle})"
        return outputs[-1]


def greedy(max_tokens: int = 10, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def run(core, max_steps: int = 5000) -> None:
    """Step an EngineCore until done; a scheduler that livelocks fails instead of hanging."""
    for _ in range(max_steps):
        if not core.has_work():
            return
        core.step()
    raise AssertionError(f"still busy after {max_steps} steps")
