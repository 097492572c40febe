"""Pipeline parallelism: how much of PP=2's ideal 2x the batch queue recovers, and how
fast the stage-to-stage channel moves tensors, each against its floor in the same run.

Efficiency: two worker processes (one torch thread each) hold the two halves of a model
large enough that compute dominates (8 layers, hidden 1024); a decode batch of 32 runs
with one step in flight (depth 1) and with two disjoint batches in flight (depth 2).
Channel: IntermediateTensors of 1 and 16 MiB from one process to another as stages move
them: PipelineSender -> PipelineReceiver, the receiving process posting for each step's
tensors, taking them (nothing else is touched) and forgetting the step. Two paths: shared
memory (gb_s: what same-host stages use; one copy into a ring slot that the receiver
reads in place, handed back by the forget) and ZMQ frames over ipc:// (frames_gb_s: tcp://
peers and ZMQWORKER_PP_SHM=0). The floor is a memcpy of the same size into a freshly
allocated buffer (what a receiver of frames must fill); a memcpy into a buffer already in
place is reported beside it.
Writes bench/results/pipeline.json; --channel-only measures the channel alone and
replaces the rows of an existing results file.

    python -m bench.pipeline [--steps 20] [--channel-only]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch
import zmq

from bench.common import RESULTS_DIR, print_table, write_results
from messages import (
    CacheConfig,
    CachedRequestData,
    DeviceConfig,
    IntermediateTensors,
    ModelConfig,
    NewRequestData,
    ParallelConfig,
    SamplingParams,
    SchedulerConfig,
    SchedulerOutput,
    WorkerConfig,
    make_kv_cache_config,
)
from tests.tiny import make_tiny_checkpoint
from zmqworker.cdiv import cdiv
from zmqworker.distributed.pp_receiver import PipelineReceiver
from zmqworker.distributed.pp_sender import PipelineSender
from zmqworker.executor.multiproc import MultiprocExecutor

ROOT = Path(__file__).resolve().parent.parent
BATCH = 32
PROMPT = 16
BLOCK = 16
GREEDY = SamplingParams(temperature=0.0)


class Group:
    """One batch of BATCH requests that the driver steps on its own."""

    def __init__(self, first_handle: int, max_len: int) -> None:
        blocks_each = cdiv(max_len, BLOCK)
        self.handles = list(range(first_handle, first_handle + BATCH))
        self.blocks = {
            h: np.arange(h * blocks_each, (h + 1) * blocks_each, dtype=np.int32)
            for h in self.handles
        }
        self.computed = 0
        self.last_tokens: list[int] = []

    def prefill(self) -> SchedulerOutput:
        new = [
            NewRequestData(
                req_id=f"r{h}",
                req_handle=h,
                prompt_token_ids=np.arange(PROMPT, dtype=np.int32) + h % 7,
                sampling_params=GREEDY,
                block_ids=self.blocks[h],
                num_scheduled_tokens=PROMPT,
            )
            for h in self.handles
        ]
        return SchedulerOutput(new, CachedRequestData.empty(), PROMPT * BATCH)

    def decode(self) -> SchedulerOutput:
        # Every stage gets the sampled tokens: the first one embeds them.
        cached = CachedRequestData.build(
            self.handles,
            [self.computed] * BATCH,
            [1] * BATCH,
            new_token_ids=[[t] for t in self.last_tokens],
        )
        return SchedulerOutput([], cached, BATCH)

    def advance(self, output, scheduled: int) -> None:
        self.computed += scheduled
        self.last_tokens = output.sampled_token_ids.tolist()


def decode_throughput(ex: MultiprocExecutor, groups: list[Group], steps: int) -> float:
    """Tokens per second with len(groups) steps kept in flight."""
    for g in groups:
        g.advance(ex.execute_model(g.prefill()), PROMPT)
    start = time.perf_counter()
    in_flight = [(g, ex.execute_model(g.decode(), non_block=True)) for g in groups]
    for _ in range(steps * len(groups) - len(groups)):
        g, future = in_flight.pop(0)
        g.advance(future.result(), 1)
        in_flight.append((g, ex.execute_model(g.decode(), non_block=True)))
    for g, future in in_flight:
        g.advance(future.result(), 1)
    elapsed = time.perf_counter() - start
    finished = [h for g in groups for h in g.handles]
    ex.execute_model(
        SchedulerOutput([], CachedRequestData.empty(), 0, finished_req_handles=finished)
    )
    return steps * len(groups) * BATCH / elapsed


def pipeline_speedup(path: str, steps: int) -> dict:
    max_len = PROMPT + 4 * steps + 8
    config = WorkerConfig(
        model=ModelConfig(path=path, max_model_len=max_len),
        parallel=ParallelConfig(pipeline_parallel_size=2),
        cache=CacheConfig(block_size=BLOCK, kv_cache_bytes=1 << 30),
        device=DeviceConfig(num_threads=1),
        scheduler=SchedulerConfig(
            max_num_seqs=2 * BATCH,
            max_num_batched_tokens=2 * BATCH * PROMPT,
            warmup_batch_sizes=[BATCH],
        ),
    )
    with MultiprocExecutor(config, env={"PYTHONPATH": str(ROOT)}) as ex:
        specs = ex.get_kv_cache_specs()
        ex.initialize_from_config(make_kv_cache_config(specs, 4 * BATCH * cdiv(max_len, BLOCK)))
        ex.compile_or_warm_up_model()
        depth1 = decode_throughput(ex, [Group(0, max_len)], steps)
        depth2 = decode_throughput(ex, [Group(BATCH, max_len), Group(2 * BATCH, max_len)], steps)
    return {"depth1_tok_s": depth1, "depth2_tok_s": depth2, "speedup": depth2 / depth1}


RUN_ID = "bench-pipeline-run"


def receiver(address: str, count: int) -> None:
    """The far end of the channel, as a stage: a PipelineReceiver driven by an event loop
    thread; this thread posts for each step's tensors, takes them and forgets the step.
    Says so after every count steps."""
    ctx = zmq.Context.instance()
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    pipe = PipelineReceiver(ctx, address + ".data", rank=1)
    pipe.admit(RUN_ID, 0)
    loop.call_soon_threadsafe(pipe.start, loop)
    done = ctx.socket(zmq.PUSH)
    done.connect(address + ".done")
    call_ids = itertools.count(1)
    while True:
        for _ in range(count):
            call_id = next(call_ids)
            pipe.note_call(call_id + count)  # as a worker sent the calls
            pipe.expect(call_id, 0).wait()
            pipe.forget(call_id)
        done.send(b"ok")


def channel_bandwidth(mib: float, repeats: int, rounds: int = 5) -> dict:
    size = int(mib * (1 << 20))
    hidden = torch.randn(size // 4 // 1024, 1024)
    tensors = IntermediateTensors({"hidden_states": hidden})
    best = {True: float("inf"), False: float("inf")}  # shared memory or frames: seconds
    with tempfile.TemporaryDirectory(prefix="zmqworker-pp-") as folder:
        base = f"ipc://{folder}/chan"
        ctx = zmq.Context.instance()
        done = ctx.socket(zmq.PULL)
        done.bind(base + ".done")
        child = subprocess.Popen(
            [sys.executable, "-m", "bench.pipeline", "--receiver", base, str(repeats)], cwd=ROOT
        )
        senders = {shm: PipelineSender(ctx, base + ".data", 0, RUN_ID, shm) for shm in best}
        call_ids = itertools.count(1)  # one sequence across both senders, as the child's
        try:
            for _ in range(rounds):  # the paths alternate, so that noise hits both
                for shm, sender in senders.items():
                    start = time.perf_counter()
                    for _ in range(repeats):
                        sender.send(next(call_ids), tensors)
                    done.recv()
                    best[shm] = min(best[shm], time.perf_counter() - start)
        finally:
            for sender in senders.values():
                sender.close()
            child.kill()
            child.wait()
            done.close(linger=0)
    gb_s = {shm: size * repeats / t / 1e9 for shm, t in best.items()}
    # The floor: a memcpy into a freshly allocated buffer, which is what the receiving
    # process must fill (its pages fault in as they are written); the copy into a buffer
    # already in place is reported beside it.
    fresh, warm = [], []
    dst = torch.empty_like(hidden)
    for _ in range(20):
        start = time.perf_counter()
        torch.empty_like(hidden).copy_(hidden)
        fresh.append(time.perf_counter() - start)
        start = time.perf_counter()
        dst.copy_(hidden)
        warm.append(time.perf_counter() - start)
    memcpy = size / min(fresh) / 1e9
    return {
        "mib": mib,
        "gb_s": gb_s[True],
        "frames_gb_s": gb_s[False],
        "memcpy_gb_s": memcpy,
        "memcpy_warm_gb_s": size / min(warm) / 1e9,
        "ratio": gb_s[True] / memcpy,
        "frames_ratio": gb_s[False] / memcpy,
    }


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--receiver":
        receiver(sys.argv[2], int(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="decode steps per batch")
    parser.add_argument(
        "--channel-only", action="store_true", help="measure the stage-to-stage channel alone"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [channel_bandwidth(1.0, 50), channel_bandwidth(16.0, 10)]
    print_table(rows)
    print("ratios to memcpy: " + ", ".join(
        f"{r['mib']:g} MiB shm {r['ratio']:.2f} frames {r['frames_ratio']:.2f}" for r in rows
    ))  # fmt: skip
    if args.channel_only:
        previous = RESULTS_DIR / "pipeline.json"
        if not previous.exists():
            print("no results file to update: run without --channel-only")
            return
        results = {**json.loads(previous.read_text()), "rows": rows}
    else:
        with tempfile.TemporaryDirectory(prefix="zmqworker-pp-model-") as folder:
            path = make_tiny_checkpoint(
                folder,
                num_layers=8,
                hidden_size=1024,
                num_heads=16,
                num_kv_heads=4,
                intermediate_size=2816,
                vocab_size=4096,
            )
            speed = pipeline_speedup(path, args.steps)
        print_table([speed])
        results = {"speedup_depth2_over_depth1": speed["speedup"], **speed, "rows": rows}
    print(f"wrote {write_results('pipeline', results)}")


if __name__ == "__main__":
    main()
