"""Helpers of the model runner tests: tiny checkpoints, an in-process pipeline whose
messages cross the real codec, transformers' greedy reference and a small scheduler."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import numpy as np
import torch
import transformers

from messages import (
    CacheConfig,
    CachedRequestData,
    Decoder,
    DeviceConfig,
    Encoder,
    IntermediateTensors,
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
from zmqworker.cdiv import cdiv
from zmqworker.distributed.parallel_state import ParallelState, single_rank_state
from zmqworker.model_runner.async_output import AsyncModelRunnerOutput
from zmqworker.model_runner.cuda_graphs import Capture
from zmqworker.model_runner.model_runner import ModelRunner

DEVICE = torch.device(os.environ.get("ZMQWORKER_TEST_DEVICE", "cpu"))
BLOCK = 4
NUM_BLOCKS = 96
GREEDY = SamplingParams(temperature=0.0)
# Penalties of each kind (the prompt bits read or not, a bias, bans), greedy and sampled.
PENALISED = [
    SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.2),
    SamplingParams(temperature=0.0, repetition_penalty=1.3, logit_bias={9: 1.0, 3: -2.0}),
    SamplingParams(
        temperature=0.7, min_tokens=2, stop_token_ids=[4], bad_words_token_ids=[[5, 6], [7]]
    ),
]


def wire(msg):
    """msg after an encode/decode round trip through separate byte frames."""
    return Decoder().decode([bytes(f) for f in Encoder().encode(msg)])


def checkpoint(family: str = "llama") -> str:
    return cached_tiny_checkpoint(
        family=family, num_layers=4, tie_word_embeddings=family == "qwen3"
    )


def make_runner(
    path: str,
    state: ParallelState | None = None,
    max_seqs: int = 8,
    max_tokens: int = 32,
    kernels: str = "auto",
    enforce_eager: bool = False,
    graph_capture: Capture | None = None,
    graph_sizes: tuple[int, ...] = (),
    max_model_len: int = 256,
) -> ModelRunner:
    """A runner with NUM_BLOCKS blocks, warmed up (graphs captured, where it has any)."""
    config = WorkerConfig(
        model=ModelConfig(path=path, max_model_len=max_model_len, enforce_eager=enforce_eager),
        cache=CacheConfig(block_size=BLOCK),
        scheduler=SchedulerConfig(
            max_num_seqs=max_seqs,
            max_num_batched_tokens=max_tokens,
            warmup_batch_sizes=[1],
            cuda_graph_sizes=list(graph_sizes),
        ),
        device=DeviceConfig(kernels=kernels),
    )
    runner = ModelRunner(config, state or single_rank_state(DEVICE), graph_capture)
    runner.initialize_kv_cache(make_kv_cache_config([runner.get_kv_cache_spec()], NUM_BLOCKS))
    runner.warm_up(list(config.scheduler.warmup_batch_sizes))
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
        need = cdiv(end, BLOCK) - len(req.blocks)
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
                        num_output_tokens=len(req.outputs),
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
