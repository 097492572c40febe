"""Decode steps with penalties on every request against the same steps without, on real
shapes with dummy weights: the issue's target is <= 1.1x on an H200.

A model runner per shape (SmolLM2-135M's and Llama-3-8B's config.json, load_format
"dummy"; bf16 on CUDA with its decode graphs, float32 on the CPU) runs batches of
requests whose prompts are random tokens. Each batch is decoded with four settings, and
each setting's steps are timed pipelined (issued while the previous step's ids are on
their way, as async scheduling runs them), wall time over --steps steps; the settings
take turns --repeats times, each turn with new requests, and each keeps its best turn (a
shared machine's load comes and goes):
- greedy: the decode graph's argmax is the sample, no sampler runs (the floor);
- greedy+penalties: repetition 1.1, frequency 0.3, presence 0.2 and a 4-token logit_bias
  on every request: the sampler runs after the graph, with the penalties' kernels and the
  counts' update;
- sampled and sampled+penalties: temperature 0.8, top_p 0.95, without and with them.
Writes bench/results/penalties.json (penalties_cuda.json on CUDA, or --out).

    python -m bench.penalties [--device cuda] [--shapes smollm2-135m,llama-3-8b]
        [--batches 1,64,256]
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import transformers

from bench.common import pin_threads, print_table, write_results
from bench.gpu_decode import SHAPES
from messages import (
    CacheConfig,
    CachedRequestData,
    ModelConfig,
    NewRequestData,
    SamplingParams,
    SchedulerConfig,
    SchedulerOutput,
    WorkerConfig,
    make_kv_cache_config,
)
from messages.step import HANDLE, NUM_COLUMNS, NUM_COMPUTED, NUM_SCHEDULED
from zmqworker.cdiv import cdiv
from zmqworker.distributed.parallel_state import single_rank_state
from zmqworker.model_runner import ModelRunner
from zmqworker.worker.host_malloc import keep_freed_memory

BLOCK_SIZE = 16
MAX_BATCHED = 8192
PENALTIES = {
    "repetition_penalty": 1.1,
    "frequency_penalty": 0.3,
    "presence_penalty": 0.2,
    "logit_bias": {11: 1.0, 12: -1.0, 13: 2.0, 14: -2.0},
}
SETTINGS = {
    "greedy": SamplingParams(temperature=0.0),
    "greedy+penalties": SamplingParams(temperature=0.0, **PENALTIES),
    "sampled": SamplingParams(temperature=0.8, top_p=0.95),
    "sampled+penalties": SamplingParams(temperature=0.8, top_p=0.95, **PENALTIES),
}


class Runner:
    """A model runner with KV blocks for max_batch requests of prompt_len + steps tokens."""

    def __init__(
        self, folder: Path, device: torch.device, max_batch: int, prompt_len: int, steps: int
    ) -> None:
        self.device = device
        self.prompt_len = prompt_len
        self.per_req = cdiv(prompt_len + steps + BLOCK_SIZE, BLOCK_SIZE)
        config = WorkerConfig(
            model=ModelConfig(
                path=str(folder),
                dtype="bfloat16" if device.type == "cuda" else "float32",
                max_model_len=self.per_req * BLOCK_SIZE,
                load_format="dummy",
            ),
            cache=CacheConfig(block_size=BLOCK_SIZE),
            scheduler=SchedulerConfig(max_num_seqs=max_batch, max_num_batched_tokens=MAX_BATCHED),
        )
        self.runner = ModelRunner(config, single_rank_state(device))
        spec = self.runner.get_kv_cache_spec()
        blocks = max_batch * self.per_req
        self.runner.initialize_kv_cache(make_kv_cache_config([spec], blocks))
        self.runner.warm_up([size for size in (1, 8) if size <= max_batch])
        if device.type == "cpu":
            keep_freed_memory()  # as a CPU worker does once warmed up (host_malloc.py)
        gc.collect()
        gc.freeze()
        self.vocab = self.runner.model.vocab_size
        self.next_handle = 0
        self.live: list[int] = []

    def start(self, batch: int, params: SamplingParams, rng: np.random.Generator) -> list[int]:
        """Prefill batch new requests with params (the previous ones finish first)."""
        handles = list(range(self.next_handle, self.next_handle + batch))
        self.next_handle += batch
        finished, self.live = self.live, handles
        pending = list(enumerate(handles))
        while pending:
            new, budget = [], MAX_BATCHED
            while pending and budget >= self.prompt_len:
                i, handle = pending.pop(0)
                prompt = rng.integers(0, self.vocab, self.prompt_len).astype(np.int32)
                blocks = np.arange(i * self.per_req, (i + 1) * self.per_req, dtype=np.int32)
                new.append(
                    NewRequestData(f"r{handle}", handle, prompt, params, blocks, self.prompt_len)
                )
                budget -= self.prompt_len
            so = SchedulerOutput(new, CachedRequestData.empty(), MAX_BATCHED - budget, finished)
            finished = []
            self.runner.execute_model(so).get_output()
        return handles

    def decode_steps(self, handles: list[int], n: int) -> list[SchedulerOutput]:
        columns = np.zeros((NUM_COLUMNS, len(handles)), np.int32)
        columns[HANDLE], columns[NUM_SCHEDULED] = handles, 1
        steps = []
        for k in range(n):
            columns[NUM_COMPUTED] = self.prompt_len + k
            steps.append(SchedulerOutput([], CachedRequestData(columns.copy()), len(handles)))
        return steps

    def pipelined(self, steps: list[SchedulerOutput]) -> float:
        """Seconds a step, each issued before the previous one's output is read."""
        self.sync()
        start = time.perf_counter()
        previous = None
        for so in steps:
            out = self.runner.execute_model(so)
            if previous is not None:
                previous.get_output()
            previous = out
        assert previous is not None
        previous.get_output()
        self.sync()
        return (time.perf_counter() - start) / len(steps)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def run_shape(shape: str, batches: list[int], device: torch.device, args) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        folder = Path(tmp)
        transformers.LlamaConfig(**SHAPES[shape], bos_token_id=1, eos_token_id=2).save_pretrained(
            folder
        )
        total = args.warm_steps + args.steps
        runner = Runner(folder, device, max(batches), args.prompt_len, total)
        rng = np.random.default_rng(0)
        for batch in batches:
            ms = dict.fromkeys(SETTINGS, float("inf"))
            for _ in range(args.repeats):
                for name, params in SETTINGS.items():
                    steps = runner.decode_steps(runner.start(batch, params, rng), total)
                    runner.pipelined(steps[: args.warm_steps])
                    turn = runner.pipelined(steps[args.warm_steps :]) * 1e3
                    ms[name] = min(ms[name], turn)
            row = {"shape": shape, "batch": batch, **{f"{k}_ms": v for k, v in ms.items()}}
            row["greedy_ratio"] = ms["greedy+penalties"] / ms["greedy"]
            row["sampled_ratio"] = ms["sampled+penalties"] / ms["sampled"]
            print(row, flush=True)
            rows.append(row)
        runner.runner.shutdown()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--shapes", default=None, help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--batches", default=None, help="default: 1,64,256 (CUDA), 1,16 (CPU)")
    parser.add_argument("--prompt-len", type=int, default=None, help="512 (CUDA), 64 (CPU)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps: 64 (CUDA), 8")
    parser.add_argument("--warm-steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch threads on the CPU")
    parser.add_argument("--tmp", default=None, help="folder for the config.json")
    parser.add_argument("--out", default=None, help="result file (default bench/results/)")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA device")
    if not cuda:
        pin_threads(args.threads)
    shapes = args.shapes or ("smollm2-135m,llama-3-8b" if cuda else "smollm2-135m")
    batches = [int(b) for b in (args.batches or ("1,64,256" if cuda else "1,16")).split(",")]
    args.prompt_len = args.prompt_len or (512 if cuda else 64)
    args.steps = args.steps or (64 if cuda else 8)
    device = torch.device(args.device)
    rows = []
    for shape in shapes.split(","):
        rows += run_shape(shape, batches, device, args)
    print_table(rows, precision=2)
    name = "penalties_cuda" if cuda else "penalties"
    settings = {k: str(v) for k, v in SETTINGS.items()}
    data = {"device": args.device, "settings": settings, "rows": rows}
    path = write_results(name, data, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
