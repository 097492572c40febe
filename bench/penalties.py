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
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers

from bench.common import pin_threads, print_table, write_results
from bench.gpu_runner import SHAPES, Ours
from messages import SamplingParams

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


def run_shape(shape: str, batches: list[int], device: torch.device, args) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        folder = Path(tmp)
        transformers.LlamaConfig(**SHAPES[shape], bos_token_id=1, eos_token_id=2).save_pretrained(
            folder
        )
        total = args.warm_steps + args.steps
        load = (max(batches), args.prompt_len)
        runner = Ours(folder, dummy=True, loads=[load], decodes=total, device=device)
        rng = np.random.default_rng(0)
        for batch in batches:
            ms = dict.fromkeys(SETTINGS, float("inf"))
            for _ in range(args.repeats):
                for name, params in SETTINGS.items():
                    handles = runner.start(batch, args.prompt_len, rng, params=params)
                    steps = runner.decode_steps(handles, args.prompt_len, total)
                    runner.pipelined(steps[: args.warm_steps])
                    turn = runner.pipelined(steps[args.warm_steps :]) * 1e3
                    ms[name] = min(ms[name], turn)
            row = {"shape": shape, "batch": batch, **{f"{k}_ms": v for k, v in ms.items()}}
            row["greedy_ratio"] = ms["greedy+penalties"] / ms["greedy"]
            row["sampled_ratio"] = ms["sampled+penalties"] / ms["sampled"]
            print(row, flush=True)
            rows.append(row)
        runner.close()
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
