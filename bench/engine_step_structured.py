"""The engine core's turn when every request has a JSON schema, against the same requests
without: python -m bench.engine_step --json-schema (see bench/engine_step.py)."""

from __future__ import annotations

import statistics
import time
from concurrent.futures import Future
from typing import Any

import numpy as np

from bench.engine_step import BLOCK_SIZE, EOS, PROMPT_LEN, STOP, InstantExecutor
from messages import (
    Encoder,
    EngineCoreStats,
    GrammarOutput,
    ModelRunnerOutput,
    RpcRequest,
    SamplingParams,
    SchedulerConfig,
    SchedulerOutput,
    StructuredOutputsParams,
)
from zmqworker.engine.client_outputs import client_outputs
from zmqworker.engine.core import EngineCore
from zmqworker.engine.grammar_compiler import GrammarCompiler
from zmqworker.engine.request import Request
from zmqworker.engine.structured_outputs import StructuredOutputs

VOCAB = 49152  # SmolLM2's logits (its tokenizer is the embedded model's)


def _answered(value: Any, non_block: bool) -> Any:
    if not non_block:
        return value
    future: Future[Any] = Future()
    future.set_result(value)
    return future


def allowed_tokens(bitmask: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A token each row of bitmask allows: a random one where it allows that (as a model
    mid-string would pick one of many), else the lowest it allows from 256 on (below are
    the special tokens, the stop tokens among them), else the lowest."""
    n = len(bitmask)
    tokens = rng.integers(256, VOCAB, n)
    words = bitmask[np.arange(n), tokens >> 5]
    for row in np.flatnonzero(((words >> (tokens & 31)) & 1) == 0).tolist():
        words = np.flatnonzero(bitmask[row])
        word = int(words[words >= 256 // 32][0] if (words >= 256 // 32).any() else words[0])
        bits = int(bitmask[row, word]) & 0xFFFFFFFF
        tokens[row] = 32 * word + (bits & -bits).bit_length() - 1
    return tokens


class GrammarExecutor(InstantExecutor):
    """InstantExecutor that also takes a step as its forward (sample=False) then
    sample_tokens, whose bitmask rows pick the constrained requests' tokens."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self._pending: ModelRunnerOutput | None = None
        self._rng = np.random.default_rng(1)
        self._forward_at = 0.0  # when the last forward without sampling was sent
        self.waits: list[float] = []  # from each such forward's send to its sample's

    def execute_model(
        self, so: SchedulerOutput, sample: bool = True, non_block: bool = False
    ) -> Any:
        output = super().execute_model(so)
        if sample:
            return _answered(output, non_block)
        self._pending = output
        self._forward_at = time.perf_counter()
        return _answered(None, non_block)

    def sample_tokens(self, grammar: GrammarOutput | None, non_block: bool = False) -> Any:
        self.call_id += 1
        self.encoder.encode(RpcRequest(self.call_id, "sample_tokens", [grammar], {}))
        output, self._pending = self._pending, None
        assert output is not None, "sample_tokens without a forward"
        if grammar is not None:
            row_of = {h: i for i, h in enumerate(output.req_handles.tolist())}
            rows = [row_of[h] for h in grammar.req_handles.tolist()]
            tokens = output.sampled_token_ids.copy()
            tokens[rows] = allowed_tokens(np.asarray(grammar.grammar_bitmask), self._rng)
            output = ModelRunnerOutput(output.req_handles, tokens)
        self.waits.append(time.perf_counter() - self._forward_at)
        return _answered(output, non_block)


def measure(num_requests: int, num_steps: int, constrained: bool) -> dict[str, float]:
    """Median microseconds per decode step of the engine's turn (step() and the client
    outputs), and when constrained (the long schema on every request) of its part from
    the forward's send to sample_tokens'."""
    from bench.end_to_end import LONG_SCHEMA
    from zmqworker.models.embedded import default_model_path

    max_model_len = PROMPT_LEN + 2 * num_steps + 64
    num_blocks = (num_requests + 1) * max_model_len // BLOCK_SIZE
    executor = GrammarExecutor(num_blocks)
    config = SchedulerConfig(max_num_seqs=num_requests, max_num_batched_tokens=8192)
    structured = StructuredOutputs(GrammarCompiler(str(default_model_path()), VOCAB))
    core = EngineCore(executor, max_model_len, config, async_scheduling=True, structured=structured)
    constraint = StructuredOutputsParams(json=LONG_SCHEMA) if constrained else None
    params = SamplingParams(
        max_tokens=2 * num_steps, stop_token_ids=[STOP], structured_outputs=constraint
    )
    rng = np.random.default_rng(0)
    for i in range(num_requests):
        prompt = rng.integers(2, 30000, PROMPT_LEN).tolist()
        core.add_request(Request(f"r{i}", prompt, params, eos_token_ids=[EOS]))
    encoder = Encoder()
    stats = EngineCoreStats(num_requests, 0, num_blocks, 0, 0, 0)

    def turn() -> None:
        requests = {request.req_id: request for request in core.step()}
        encoder.encode(client_outputs(0, requests.values(), stats))

    deadline = time.monotonic() + 300
    while len(core.scheduler.running) < num_requests:  # grammars compiled, prefills run
        turn()
        assert time.monotonic() < deadline, "the requests never all started"
    for _ in range(8):
        turn()
    turns, thread_cpu, process_cpu = [], [], []
    executor.waits.clear()
    for _ in range(num_steps):
        start, thread, process = time.perf_counter(), time.thread_time(), time.process_time()
        turn()
        turns.append(time.perf_counter() - start)
        thread_cpu.append(time.thread_time() - thread)
        process_cpu.append(time.process_time() - process)
    assert len(core.scheduler.running) == num_requests, "a request finished in the timed steps"
    core.shutdown()
    result = {
        "turn_us": 1e6 * statistics.median(turns),
        # CPU time, which a busy machine inflates less than wall time: the engine's own
        # thread, and all of the process's (the bitmask threads too).
        "turn_thread_cpu_us": 1e6 * statistics.median(thread_cpu),
        "turn_process_cpu_us": 1e6 * statistics.median(process_cpu),
    }
    if constraint is not None:
        waits = executor.waits
        assert len(waits) >= num_steps - 2, "not every step was sent as forward then sample"
        result["forward_to_sample_us"] = 1e6 * statistics.median(waits)
    return result


def run(num_requests: int, num_steps: int, rounds: int) -> dict[str, Any]:
    """Rounds alternating plain and schema runs; the medians over rounds, and the ratio."""
    samples: dict[str, list[float]] = {}
    for _ in range(rounds):
        for name, constrained in (("plain", False), ("schema", True)):
            for key, value in measure(num_requests, num_steps, constrained).items():
                samples.setdefault(f"{name} {key}", []).append(value)
    result: dict[str, Any] = {k: statistics.median(v) for k, v in samples.items()}
    result["schema_over_plain_turn"] = result["schema turn_us"] / result["plain turn_us"]
    result["requests"], result["steps"], result["rounds"] = num_requests, num_steps, rounds
    return result
