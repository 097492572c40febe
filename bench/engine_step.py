"""The engine core's own work per step, with workers that answer at once.

The real EngineCore (scheduler, KV block manager, batch queue, async scheduling at its
default depth) drives a stand-in executor that encodes each step as the multiproc
executor's RPC would (the engine's share of sending) and returns a token for every
request that samples, immediately. Once every request decodes, each phase of the
engine's turn is timed per step: schedule, send (batch queue submit: the encode),
update (update_from_output), and outputs (the EngineCoreOutputs columns a client gets,
encoded). Nothing waits on a device, so what is left is
what sets the pace when the device is faster than the engine. Requests never finish in
the timed steps (max_tokens above them); their EOS and a stop token id are checked on
every token, never hit.

    python -m bench.engine_step [--requests 1,64,256] [--steps 400]

With --json-schema, the structured-output step instead: 256 requests (--requests) each
with bench/end_to_end.py's long JSON schema (a string that outlasts the run), compiled
against SmolLM2's tokenizer (the embedded model's, a vocabulary of 49,152), against the
same requests without a schema, in alternating rounds. The stand-in workers take each
constrained step as two calls (the forward, then sample_tokens with the bitmask) and
give each constrained request a token its bitmask allows, so that every matcher stays
in a valid state. Reported per step: the engine's whole turn (step() and the client's
outputs), its CPU time (the engine's thread, and the whole process: the bitmask
threads too), and the time from the forward's send to sample_tokens' (what a device
whose forward is shorter waits for the bitmask). bench/results/engine_step_structured.json
holds one such run.

    python -m bench.engine_step --json-schema [--requests 256] [--steps 200] [--rounds 3]

Compare two trees in one run (bench/results/engine_step_compare.json holds one such run):
python -m bench.compare_trees OLD_TREE --what engine_step --out FILE
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import Future
from typing import Any

import numpy as np

from messages import (
    Encoder,
    EngineCoreStats,
    KVCacheConfig,
    KVCacheSpec,
    ModelRunnerOutput,
    RpcRequest,
    SamplingParams,
    SchedulerConfig,
    SchedulerOutput,
)
from zmqworker.engine.client_outputs import client_outputs
from zmqworker.engine.core import EngineCore
from zmqworker.engine.request import Request

PROMPT_LEN = 130  # the workload
BLOCK_SIZE = 16
EOS, STOP = 0, 1  # never sampled: the stand-in samples 2 and up
PHASES = ("schedule", "send", "update", "outputs")


class InstantExecutor:
    """Workers that answer every step at once: each sampling request gets a token."""

    def __init__(self, num_blocks: int) -> None:
        self.spec = KVCacheSpec(BLOCK_SIZE, 1, 64, "bfloat16", ["layers.0"])
        self.num_blocks = num_blocks
        self.encoder = Encoder()
        self.max_concurrent_batches = 1
        self.call_id = 0

    def determine_available_memory(self) -> list[int]:
        return [self.num_blocks * self.spec.page_size_bytes]

    def get_kv_cache_specs(self) -> list[KVCacheSpec]:
        return [self.spec]

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        pass  # no cache to allocate: the stand-in computes nothing

    def compile_or_warm_up_model(self) -> list[float]:
        return [0.0]

    def execute_model(
        self, so: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        self.call_id += 1
        self.encoder.encode(RpcRequest(self.call_id, "execute_model", [so], {"sample": True}))
        handles = [r.req_handle for r in so.scheduled_new_reqs]
        handles += so.scheduled_cached_reqs.req_handles.tolist()
        ends = [r.num_computed_tokens + r.num_scheduled_tokens for r in so.scheduled_new_reqs]
        lengths = [len(r.prompt_token_ids) for r in so.scheduled_new_reqs]
        cached = so.scheduled_cached_reqs
        n_cached = len(cached)
        # A cached request in a chunked prefill samples nothing; the bench's requests
        # all fit in one chunk, so every cached request decodes.
        tokens = [2 + (e % 97) if e >= n else -1 for e, n in zip(ends, lengths, strict=True)]
        tokens += (2 + (cached.num_computed_tokens % 97)).tolist() if n_cached else []
        output = ModelRunnerOutput(np.array(handles, np.int32), np.array(tokens, np.int32))
        if not non_block:
            return output
        future: Future[ModelRunnerOutput] = Future()
        future.set_result(output)
        return future

    def shutdown(self) -> None:
        pass

    def forget_transfer_reports(self) -> None:
        pass  # no KV transfer


def _timed(fn: Any, samples: list[float]) -> Any:
    clock = time.perf_counter

    def wrapper(*args: Any) -> Any:
        start = clock()
        result = fn(*args)
        samples.append(clock() - start)
        return result

    return wrapper


def measure(num_requests: int, num_steps: int, async_scheduling: bool = True) -> dict[str, float]:
    """Median microseconds per step of each phase, with num_requests decoding."""
    max_model_len = PROMPT_LEN + num_steps + 64  # room for every token the bench samples
    num_blocks = num_requests * max_model_len // BLOCK_SIZE + max_model_len // BLOCK_SIZE
    executor = InstantExecutor(num_blocks)
    config = SchedulerConfig(max_num_seqs=max(num_requests, 1), max_num_batched_tokens=8192)
    core = EngineCore(executor, max_model_len, config, async_scheduling=async_scheduling)
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=num_steps + 32, stop_token_ids=[STOP])
    for i in range(num_requests):
        prompt = rng.integers(2, 30000, PROMPT_LEN).tolist()
        core.add_request(Request(f"r{i}", prompt, params, eos_token_ids=[EOS]))
    encoder = Encoder()
    stats = EngineCoreStats(num_requests, 0, num_blocks, 0, 0, 0)

    def outputs(changed: list[Request]) -> None:
        requests = {request.req_id: request for request in changed}
        encoder.encode(client_outputs(0, requests.values(), stats))

    for _ in range(8):  # prefills, and the steps in flight filled
        outputs(core.step())
    samples: dict[str, list[float]] = {phase: [] for phase in PHASES}
    scheduler, queue = core.scheduler, core.batch_queue
    scheduler.schedule = _timed(scheduler.schedule, samples["schedule"])
    queue.submit = _timed(queue.submit, samples["send"])
    scheduler.update_from_output = _timed(scheduler.update_from_output, samples["update"])
    timed_outputs = _timed(outputs, samples["outputs"])
    for _ in range(num_steps):
        timed_outputs(core.step())
    assert all(len(s) >= num_steps - 2 for s in samples.values()), "not every step decoded"
    result = {f"{phase}_us": 1e6 * statistics.median(samples[phase]) for phase in PHASES}
    result["total_us"] = sum(result.values())
    return result


def run(requests: list[int], steps: int) -> dict[str, dict[str, float]]:
    return {f"{n} requests": measure(n, steps) for n in requests}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", default=None, help="1,64,256; 256 with --json-schema")
    parser.add_argument("--steps", type=int, default=None, help="400; 200 with --json-schema")
    parser.add_argument("--out", default=None)
    parser.add_argument("--json-schema", action="store_true", help="the structured step")
    parser.add_argument("--rounds", type=int, default=3, help="with --json-schema")
    args = parser.parse_args()
    from bench.common import print_table, write_results

    if args.json_schema:
        from bench import engine_step_structured

        requests, steps = int(args.requests or 256), args.steps or 200
        row = engine_step_structured.run(requests, steps, args.rounds)
        print_table([row])
        write_results("engine_step_structured", row, args.out)
        return

    requests = [int(n) for n in (args.requests or "1,64,256").split(",")]
    results = run(requests, args.steps or 400)
    print_table([{"requests": name, **row} for name, row in results.items()])
    write_results("engine_step", results, args.out)


if __name__ == "__main__":
    main()
