"""The decode step before and after its CUDA graphs are captured again, in one process.

A worker captures its graphs more than once: start-up's memory probe captures and drops
them before the real capture, and every wake-up captures them anew. Each capture must
replay as fast as the first. SmolLM2-135M's shape with dummy weights (bf16), 256 requests
of 128 prompt tokens, 200 pipelined decode steps a measure (bench.gpu_runner's harness),
two measures after the first capture, after each of three captures again (the last
after cuBLAS's workspaces were given back, as sleep does before a wake-up captures
again), and with a second runner made in the process after the first is closed. The floor is
the first capture's step, measured in the same run. Writes bench/results/graph_recapture.json
(or --out).

    python -m bench.graph_recapture [--requests 256] [--prompt-len 128] [--steps 200]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers

from bench.common import print_table, write_results
from bench.gpu_runner import SHAPES, Ours

SHAPE = "smollm2-135m"


def step_ms(ours: Ours, requests: int, prompt_len: int, steps: int) -> float:
    """The best of two measures of `steps` pipelined decode steps, in ms a step."""
    rng = np.random.default_rng(0)
    best = float("inf")
    for _ in range(2):
        handles = ours.start(requests, prompt_len, rng)
        best = min(best, ours.pipelined(ours.decode_steps(handles, prompt_len, steps)))
    return 1e3 * best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", default=None, help="result file (default bench/results/)")
    args = parser.parse_args()
    measure = (args.requests, args.prompt_len, args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        transformers.LlamaConfig(**SHAPES[SHAPE], bos_token_id=1, eos_token_id=2).save_pretrained(
            folder
        )
        ours = Ours(
            folder, dummy=True, loads=[(args.requests, args.prompt_len)], decodes=args.steps
        )
        first = step_ms(ours, *measure)
        rows = [{"capture": "first", "step_ms": first, "x_first": 1.0}]
        for again in ("again", "again", "workspaces gone"):
            ours.runner.path.release_buffers()
            torch.cuda.synchronize()
            if again == "workspaces gone":  # as sleep gives them back before a wake-up
                torch._C._cuda_clearCublasWorkspaces()
                torch.cuda.empty_cache()
            ours.runner.capture_graphs()
            ms = step_ms(ours, *measure)
            rows.append({"capture": again, "step_ms": ms, "x_first": ms / first})
        ours.close()
        # A benchmark runs shapes one after another in one process: the next runner's
        # graphs are captures again too.
        ours = Ours(
            folder, dummy=True, loads=[(args.requests, args.prompt_len)], decodes=args.steps
        )
        ms = step_ms(ours, *measure)
        rows.append({"capture": "a second runner", "step_ms": ms, "x_first": ms / first})
        ours.close()
    print_table(rows, precision=3)
    summary = {
        "shape": SHAPE,
        "device": torch.cuda.get_device_name(),
        "requests": args.requests,
        "prompt_len": args.prompt_len,
        "steps": args.steps,
        "rows": rows,
        "worst_x_first": max(row["x_first"] for row in rows),
    }
    print(f"wrote {write_results('graph_recapture', summary, args.out)}")


if __name__ == "__main__":
    main()
