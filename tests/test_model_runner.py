"""The model runner end to end on tiny checkpoints: greedy tokens equal transformers'
through a small scheduler (chunked prefill, mixed batches, joins, finishes, preemption,
shuffled blocks), PP=2 in one process, seeds, logprobs, split mode with grammar, bad steps
and the KV cache life cycle. Every message crosses the real codec, so the runner sees
read-only arrays as a worker does. ZMQWORKER_TEST_DEVICE=cuda runs the runners on a GPU
(transformers, the reference, stays on the CPU)."""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass, field

import msgspec
import numpy as np
import pytest
import torch
import transformers

from messages import (
    CacheConfig,
    CachedRequestData,
    Decoder,
    Encoder,
    GrammarOutput,
    IntermediateTensors,
    KVCacheConfig,
    ModelConfig,
    ModelRunnerOutput,
    NewRequestData,
    PipelineTensors,
    RpcRequest,
    SamplingParams,
    SchedulerConfig,
    SchedulerOutput,
    WorkerConfig,
    make_kv_cache_config,
)
from tests.tiny import cached_tiny_checkpoint
from zmqworker.attention.kv_cache import kv_cache_shape
from zmqworker.distributed.parallel_state import ParallelState, single_rank_state
from zmqworker.model_runner import AsyncModelRunnerOutput, ModelRunner

DEVICE = torch.device(os.environ.get("ZMQWORKER_TEST_DEVICE", "cpu"))
# Decoded tensors are read-only message memory (the runner copies them); torch warns.
pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")
BLOCK = 4
NUM_BLOCKS = 96
GREEDY = SamplingParams(temperature=0.0)


def wire(msg):
    """msg after an encode/decode round trip through separate byte frames."""
    return Decoder().decode([bytes(f) for f in Encoder().encode(msg)])


def checkpoint(family: str = "llama") -> str:
    return cached_tiny_checkpoint(
        family=family, num_layers=4, tie_word_embeddings=family == "qwen3"
    )


def make_runner(
    path: str, state: ParallelState | None = None, max_seqs: int = 8, max_tokens: int = 32
) -> ModelRunner:
    config = WorkerConfig(
        model=ModelConfig(path=path, max_model_len=256),
        cache=CacheConfig(block_size=BLOCK),
        scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=max_tokens),
    )
    runner = ModelRunner(config, state or single_rank_state(DEVICE))
    runner.load_model()
    runner.initialize_kv_cache(make_kv_cache_config([runner.get_kv_cache_spec()], NUM_BLOCKS))
    return runner


def pp_state(pp_rank: int) -> ParallelState:
    return ParallelState(pp_rank, 2, 0, 1, pp_rank, 2, None, None, DEVICE)


class Pipeline:
    """Runners of consecutive pipeline stages in one process; tensors pass through the codec."""

    def __init__(self, runners: list[ModelRunner]) -> None:
        self.runners = runners

    def execute(self, so: SchedulerOutput, sample: bool = True):
        so = wire(RpcRequest(0, "execute_model", [so])).args[0]
        tensors = None
        for runner in self.runners[:-1]:
            out = runner.execute_model(so, tensors)
            assert isinstance(out, IntermediateTensors)
            on_host = IntermediateTensors({k: v.cpu() for k, v in out.tensors.items()})
            tensors = wire(PipelineTensors(0, 0, on_host)).tensors
        return self.runners[-1].execute_model(so, tensors, sample=sample)

    def step(self, so: SchedulerOutput) -> ModelRunnerOutput:
        out = self.execute(so)
        assert isinstance(out, AsyncModelRunnerOutput)
        result = out.get_output()
        assert out.is_ready()
        return result


@functools.cache
def hf_model(path: str) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@functools.cache
def hf_greedy(path: str, prompt: tuple[int, ...], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    gen = transformers.GenerationConfig(
        do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=0
    )
    out = hf_model(path).generate(ids, generation_config=gen, attention_mask=torch.ones_like(ids))
    return out[0, len(prompt) :].tolist()


# a small scheduler ---------------------------------------------------------------------


@dataclass
class Req:
    req_id: str
    handle: int
    prompt: list[int]
    max_tokens: int
    params: SamplingParams = GREEDY
    outputs: list[int] = field(default_factory=list)
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    state: str = "waiting"  # waiting | running | resume | readd | done
    scheduled: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.outputs


class MiniScheduler:
    """Just enough of a vLLM v1 scheduler: a token budget, running requests first, then
    waiting ones; chunked prefill; blocks from a shuffled pool; preemption on request."""

    def __init__(self, budget: int, seed: int = 0, send_tokens: bool = False) -> None:
        self.budget = budget
        self.send_tokens = send_tokens  # new_token_ids for non-last pipeline stages
        self.free = [int(b) for b in np.random.default_rng(seed).permutation(NUM_BLOCKS)]
        self.reqs: list[Req] = []
        self.finished: list[int] = []
        self.preempted: list[int] = []

    def add(
        self, req_id: str, prompt: list[int], max_tokens: int, params: SamplingParams = GREEDY
    ) -> Req:
        req = Req(req_id, len(self.reqs) + 100, list(prompt), max_tokens, params)
        self.reqs.append(req)
        return req

    def preempt(self, req: Req, how: str) -> None:
        """how: 'resume' (comes back as a resumed cached request) or 'readd' (as new)."""
        assert req.state == "running"
        self.free += req.blocks
        req.blocks, req.computed, req.state = [], 0, how
        self.preempted.append(req.handle)

    def _blocks_for(self, req: Req, end: int) -> list[int]:
        need = -(-end // BLOCK) - len(req.blocks)
        new, self.free = self.free[:need], self.free[need:]
        req.blocks += new
        return new

    def schedule(self) -> SchedulerOutput:
        budget = self.budget
        cached: dict[str, list] = {k: [] for k in ("h", "c", "s", "b", "t")}
        resumed, new = [], []
        preempted_now = set(self.preempted)
        for req in self.reqs:
            req.scheduled = 0
            if budget == 0 or req.handle in preempted_now or req.state in ("done",):
                continue
            s = min(len(req.tokens) - req.computed, budget)
            if req.state in ("running", "resume"):
                if req.state == "resume":
                    resumed.append(req.handle)
                cached["h"].append(req.handle)
                cached["c"].append(req.computed)
                cached["s"].append(s)
                cached["b"].append(self._blocks_for(req, req.computed + s))
                cached["t"].append(req.tokens[req.computed : req.computed + s])
            else:  # waiting, or preempted and re-added as new with all its tokens
                new.append(
                    NewRequestData(
                        req.req_id,
                        req.handle,
                        np.array(req.tokens, np.int32),
                        req.params,
                        np.array(self._blocks_for(req, s), np.int32),
                        s,
                    )
                )
            req.state, req.scheduled = "running", s
            budget -= s
        so = SchedulerOutput(
            new,
            CachedRequestData.build(
                cached["h"],
                cached["c"],
                cached["s"],
                cached["b"],
                cached["t"] if self.send_tokens else None,
                resumed,
            ),
            self.budget - budget,
            self.finished,
            self.preempted,
        )
        self.finished, self.preempted = [], []
        return so

    def update(self, out: ModelRunnerOutput) -> None:
        by_handle = {r.handle: r for r in self.reqs}
        assert sorted(out.req_handles.tolist()) == sorted(
            r.handle for r in self.reqs if r.scheduled
        )
        for handle, token in zip(
            out.req_handles.tolist(), out.sampled_token_ids.tolist(), strict=True
        ):
            req = by_handle[handle]
            req.computed += req.scheduled
            assert (token >= 0) == (req.computed == len(req.tokens)), (handle, token)
            if token >= 0:
                req.outputs.append(token)
                if len(req.outputs) == req.max_tokens:
                    req.state = "done"
                    self.free += req.blocks
                    self.finished.append(handle)

    def busy(self) -> bool:
        return any(r.state != "done" for r in self.reqs)


def run_scenario(path: str, pipeline: Pipeline, send_tokens: bool = False) -> dict[str, list[int]]:
    """Six requests with different lengths joining at different steps; chunked prefill
    under a 20-token budget; one preempted and resumed, one preempted and re-added."""
    rng = np.random.default_rng(1)
    vocab = hf_model(path).config.vocab_size
    prompts = {
        name: rng.integers(3, vocab, n).tolist()
        for name, n in [("a", 21), ("b", 45), ("c", 7), ("d", 13), ("e", 30), ("f", 9)]
    }
    sched = MiniScheduler(budget=20, seed=2, send_tokens=send_tokens)
    reqs = {"a": sched.add("a", prompts["a"], 32), "b": sched.add("b", prompts["b"], 20)}
    step = 0
    while sched.busy():
        if step == 2:
            reqs["c"] = sched.add("c", prompts["c"], 12)
        if step == 5:
            reqs["d"] = sched.add("d", prompts["d"], 6)
            reqs["e"] = sched.add("e", prompts["e"], 16)
        if step == 9:
            reqs["f"] = sched.add("f", prompts["f"], 10)
            sched.preempt(reqs["a"], "resume")
        if step == 14:
            sched.preempt(reqs["b"], "readd")
        sched.update(pipeline.step(sched.schedule()))
        step += 1
        assert step < 200
    return {name: req.outputs for name, req in reqs.items()} | {"_prompts": prompts}


def expected(path: str, result: dict) -> dict[str, list[int]]:
    return {
        name: hf_greedy(path, tuple(p), len(result[name])) for name, p in result["_prompts"].items()
    }


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_greedy_tokens_match_transformers(family: str) -> None:
    path = checkpoint(family)
    result = run_scenario(path, Pipeline([make_runner(path)]))
    assert [len(result[n]) for n in "abcdef"] == [32, 20, 12, 6, 16, 10]
    assert {n: result[n] for n in "abcdef"} == expected(path, result)


def test_pipeline_parallel_two_stages_match_one() -> None:
    path = checkpoint("llama")
    stages = [make_runner(path, pp_state(0)), make_runner(path, pp_state(1))]
    assert stages[0].model.layer_names == [f"model.layers.{i}.self_attn" for i in (0, 1)]
    assert stages[1].get_kv_cache_spec().layer_names == [
        f"model.layers.{i}.self_attn" for i in (2, 3)
    ]
    result = run_scenario(path, Pipeline(stages), send_tokens=True)
    single = run_scenario(path, Pipeline([make_runner(path)]), send_tokens=True)
    assert {n: result[n] for n in "abcdef"} == {n: single[n] for n in "abcdef"}
    assert {n: result[n] for n in "abcdef"} == expected(path, result)


# sampling through the runner ----------------------------------------------------------


def sampled_tokens(
    runner: ModelRunner, target: SamplingParams, companions: list[SamplingParams], steps: int = 12
) -> list[int]:
    """The target request's tokens, with companions joining one per step."""
    sched = MiniScheduler(budget=32, seed=5)
    rng = np.random.default_rng(3)
    req = sched.add("target", rng.integers(3, 200, 9).tolist(), steps, target)
    pipeline = Pipeline([runner])
    i = 0
    while req.state != "done":
        if i < len(companions):
            sched.add(f"companion-{i}", rng.integers(3, 200, 5 + i).tolist(), 4, companions[i])
        sched.update(pipeline.step(sched.schedule()))
        i += 1
    while sched.busy():
        sched.update(pipeline.step(sched.schedule()))
    pipeline.step(sched.schedule())  # let the last ones finish
    return req.outputs


def test_seeded_request_ignores_its_batch_companions() -> None:
    path = checkpoint("llama")
    seeded = SamplingParams(temperature=1.5, top_k=40, seed=11)
    alone = sampled_tokens(make_runner(path), seeded, [])
    crowd = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.8, seed=5),
        GREEDY,
        SamplingParams(temperature=2.0, top_p=0.9),
    ]
    crowded = sampled_tokens(make_runner(path), seeded, crowd)
    assert alone == crowded
    other = sampled_tokens(
        make_runner(path), SamplingParams(temperature=1.5, top_k=40, seed=12), []
    )
    assert other != alone


def test_logprobs_match_transformers_log_softmax() -> None:
    path = checkpoint("qwen2")
    runner = make_runner(path)
    params = SamplingParams(temperature=0.0, logprobs=3)
    prompt = list(range(10, 30))
    new = [
        NewRequestData(
            "lp", 1, np.array(prompt, np.int32), params, np.array([4, 2, 9, 7, 11], np.int32), 12
        ),
        NewRequestData(
            "other",
            2,
            np.array([5, 6], np.int32),
            SamplingParams(temperature=0.0, logprobs=1),
            np.array([1], np.int32),
            2,
        ),
    ]
    out = Pipeline([runner]).step(SchedulerOutput(new, CachedRequestData.empty(), 14))
    # request 1 is mid prefill: no token and a row of placeholders; request 2 sampled
    assert out.sampled_token_ids[0] == -1 and out.sampled_token_ids[1] >= 0
    lp = out.logprobs
    assert lp is not None and lp.logprob_token_ids.shape == (2, 2) and lp.logprobs.shape == (2, 2)
    assert (lp.logprob_token_ids[0] == -1).all() and np.isneginf(lp.logprobs[0]).all()
    assert lp.logprob_token_ids[1, 0] == out.sampled_token_ids[1] and lp.sampled_token_ranks[1] == 1
    cached = CachedRequestData.build([1, 2], [12, 2], [8, 1])
    out = Pipeline([runner]).step(SchedulerOutput([], cached, 9))
    lp = out.logprobs
    assert lp is not None and lp.logprob_token_ids.shape == (2, 4)  # the widest request wins
    with torch.no_grad():
        logits = hf_model(path)(torch.tensor([prompt])).logits[0, -1]
    reference = torch.log_softmax(logits, -1)
    token = int(out.sampled_token_ids[0])
    assert token == int(reference.argmax()) and lp.sampled_token_ranks[0] == 1
    assert lp.logprob_token_ids[0].tolist() == [token, *reference.topk(3).indices.tolist()]
    np.testing.assert_allclose(lp.logprobs[0, 0], reference[token].item(), atol=1e-4)
    np.testing.assert_allclose(lp.logprobs[0, 1:], reference.topk(3).values.numpy(), atol=1e-4)


def test_split_mode_applies_the_grammar_bitmask() -> None:
    path = checkpoint("llama")
    runner = make_runner(path)
    vocab = runner.model.vocab_size
    prompt = [7, 8, 9, 10, 11]
    greedy = hf_greedy(path, tuple(prompt), 1)[0]
    allowed = [3, 17, 40, 200]
    assert greedy not in allowed
    words = np.zeros((1, -(-vocab // 32)), np.uint32)
    for t in allowed:
        words[0, t // 32] |= np.uint32(1 << (t % 32))
    new = [
        NewRequestData("g", 5, np.array(prompt, np.int32), GREEDY, np.array([0, 1], np.int32), 5)
    ]
    so = SchedulerOutput(new, CachedRequestData.empty(), 5)
    with pytest.raises(RuntimeError, match="sample_tokens without"):
        runner.sample_tokens(None)
    assert runner.execute_model(wire(RpcRequest(0, "x", [so])).args[0], sample=False) is None
    with pytest.raises(RuntimeError, match="before sample_tokens"):
        runner.execute_model(SchedulerOutput([], CachedRequestData.empty(), 0))
    grammar = wire(
        RpcRequest(0, "x", [GrammarOutput(np.array([5], np.int32), words.view(np.int32))])
    )
    out = runner.sample_tokens(grammar.args[0]).get_output()
    with torch.no_grad():
        logits = hf_model(path)(torch.tensor([prompt])).logits[0, -1]
    assert int(out.sampled_token_ids[0]) == allowed[int(logits[allowed].argmax())]
    # the sampled token joined the request: the next decode step continues from it
    cached = CachedRequestData.build([5], [5], [1])
    assert runner.execute_model(SchedulerOutput([], cached, 1), sample=False) is None
    with pytest.raises(ValueError, match="handle 99: grammar bitmask for a request not in"):
        runner.sample_tokens(GrammarOutput(np.array([99], np.int32), words.view(np.int32)))
    # the rejected grammar output left the logits pending; without a grammar, greedy
    first = int(out.sampled_token_ids[0])
    out = runner.sample_tokens(None).get_output()
    assert int(out.sampled_token_ids[0]) == hf_greedy_from(path, [*prompt, first])


def hf_greedy_from(path: str, tokens: list[int]) -> int:
    with torch.no_grad():
        return int(hf_model(path)(torch.tensor([tokens])).logits[0, -1].argmax())


# bad input and life cycle --------------------------------------------------------------


def test_bad_steps_are_rejected_and_generation_continues() -> None:
    path = checkpoint("mistral")
    runner = make_runner(path)
    pipeline = Pipeline([runner])
    sched = MiniScheduler(budget=16, seed=4)
    req = sched.add("victim", list(range(20, 40)), 12)
    bad_steps = [
        (SchedulerOutput([], CachedRequestData.build([999], [0], [1]), 1), "request handle 999"),
        (
            SchedulerOutput([], CachedRequestData.build([req.handle], [0], [99]), 99),
            "request 'victim' (handle 100)",
        ),
        (
            SchedulerOutput([], CachedRequestData.build([req.handle], [0], [1], [[NUM_BLOCKS]]), 1),
            f"request 'victim' (handle 100): block id {NUM_BLOCKS}",
        ),
    ]
    step = 0
    while sched.busy():
        if step in (2, 5, 8):
            bad, message = bad_steps[(step - 2) // 3]
            with pytest.raises(ValueError, match=re.escape(message)):
                pipeline.execute(bad)
        sched.update(pipeline.step(sched.schedule()))
        step += 1
    assert req.outputs == hf_greedy(path, tuple(range(20, 40)), 12)


def test_kv_cache_life_cycle_profile_and_warm_up() -> None:
    path = checkpoint("llama")
    config = WorkerConfig(
        model=ModelConfig(path=path),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
    )
    runner = ModelRunner(config, pp_state(1))
    assert runner.model is None and runner.kv_caches == []
    with pytest.raises(RuntimeError, match="load_model"):
        runner.get_kv_cache_spec()
    runner.load_model()
    runner.profile_run()
    assert runner.kv_caches == []  # profiling needs no KV cache
    spec = runner.get_kv_cache_spec()
    other = msgspec.structs.replace(
        spec, layer_names=["model.layers.0.self_attn", "model.layers.1.self_attn"]
    )
    config_all = make_kv_cache_config([other, spec], 10)
    runner.initialize_kv_cache(config_all)  # the other stage's layers are ignored
    assert [tuple(c.shape) for c in runner.kv_caches] == [kv_cache_shape(10, 16, 2, 16)] * 2
    runner.warm_up([1, 4])
    with pytest.raises(ValueError, match="warm-up batch size 5"):
        runner.warm_up([5])
    only_other = make_kv_cache_config([other], 10)
    with pytest.raises(ValueError, match="no tensor or group for layer 'model.layers.2"):
        runner.initialize_kv_cache(only_other)
    runner.release_kv_cache()
    assert runner.kv_caches == []
    so = SchedulerOutput(
        [NewRequestData("x", 1, np.array([1], np.int32), GREEDY, np.array([0], np.int32), 1)],
        CachedRequestData.empty(),
        1,
    )
    with pytest.raises(RuntimeError, match="initialize_kv_cache"):
        runner.execute_model(so, IntermediateTensors({}))
    runner.shutdown()
    assert runner.model is None


def test_empty_step_and_async_output() -> None:
    path = checkpoint("llama")
    runner = make_runner(path)
    new = [
        NewRequestData("x", 3, np.array([1, 2, 3], np.int32), GREEDY, np.array([5], np.int32), 3)
    ]
    out = runner.execute_model(SchedulerOutput(new, CachedRequestData.empty(), 3))
    assert isinstance(out, AsyncModelRunnerOutput)
    assert out.is_ready() or DEVICE.type == "cuda"  # on the CPU there is nothing to wait for
    assert out.get_output() is out.get_output() and out.is_ready()
    assert out.get_output().req_handles.tolist() == [3]
    empty = runner.execute_model(SchedulerOutput([], CachedRequestData.empty(), 0, [3]))
    result = empty.get_output()
    assert len(result.req_handles) == 0 and len(result.sampled_token_ids) == 0
    assert len(runner.batch) == 0


def test_kv_cache_config_of_another_shape_is_rejected() -> None:
    runner = make_runner(checkpoint("llama"))
    spec = runner.get_kv_cache_spec()
    wrong = msgspec.structs.replace(spec, block_size=8)
    with pytest.raises(ValueError, match="has \\(block_size"):
        runner.initialize_kv_cache(make_kv_cache_config([wrong], 10))
    small = KVCacheConfig(
        10,
        [t for t in make_kv_cache_config([spec], 5).tensors],
        make_kv_cache_config([spec], 10).groups,
    )
    with pytest.raises(ValueError, match="10 blocks need"):
        runner.initialize_kv_cache(small)
