"""The MLP's gate/up projection and activation at decode-sized steps: cuBLAS then the
SiLU-and-multiply kernel, against the one skinny Triton kernel (CUDA only).

Each model's every layer, with its own weights as in a step (so they stream from HBM, not
L2), timed from a CUDA graph of the whole stack (triton.testing.do_bench_cudagraph),
against the floor: the weights' bytes at the device-to-device bandwidth measured in the
same run.

    python -m bench.skinny_gate_up [--out FILE] [--models a,b] [--sweep] [--sweep-rows 1,16]

--sweep also times the kernel under other tile settings at --sweep-rows rows.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
import triton
import triton.testing

from bench.attention_kernels import MODELS
from bench.common import print_table, write_results
from bench.gpu_decode import hbm_bandwidth
from zmqworker.models.layers.row_tiles import MAX_ROWS, ROW_TILES
from zmqworker.models.layers.skinny_gate_up import gate_up_silu
from zmqworker.models.layers.triton_ops import silu_and_mul

LAYERS = {"smollm2-135m": 30, "llama-3.2-1b": 16, "llama-3-8b": 32, "qwen2.5-1.5b": 28,
          "qwen2.5-0.5b": 24, "qwen3-1.7b": 28, "qwen2.5-3b": 36, "llama-3.2-3b": 28}  # fmt: skip
# What runs without --models: the shapes the kernels' settings were first measured on.
DEFAULT_MODELS = "smollm2-135m,llama-3.2-1b,llama-3-8b,qwen2.5-1.5b"
BATCHES = (1, 4, 8, *ROW_TILES)
SWEEP = [
    (n, k, w, s) for n in (16, 32, 64) for k in (64, 128, 256) for w, s in ((4, 3), (4, 4), (8, 4))
]


def stack_weights(model: str) -> list[torch.Tensor]:
    hidden, inter = MODELS[model][3:]
    return [
        torch.randn(2 * inter, hidden, dtype=torch.bfloat16, device="cuda") / hidden**0.5
        for _ in range(LAYERS[model])
    ]


def eager(x: torch.Tensor, weights: list[torch.Tensor]) -> Callable[[], None]:
    return lambda: [silu_and_mul(torch.nn.functional.linear(x, w)) for w in weights]


def fused(x: torch.Tensor, weights: list[torch.Tensor], tiles=None) -> Callable[[], None]:
    return lambda: [gate_up_silu(x, w, tiles=tiles) for w in weights]


def timed_us(fn: Callable[[], None], rep: int = 50) -> float:
    fn()
    return triton.testing.do_bench_cudagraph(fn, rep=rep) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--models", default=DEFAULT_MODELS)
    parser.add_argument("--sweep-rows", default="1,16")
    args = parser.parse_args()
    sweep_rows = [int(r) for r in args.sweep_rows.split(",")]
    bandwidth = hbm_bandwidth()
    rows, sweep = [], []
    for model in args.models.split(","):
        weights = stack_weights(model)
        hidden = weights[0].shape[1]
        floor = sum(w.numel() * 2 for w in weights) / bandwidth * 1e6
        x0 = torch.randn(MAX_ROWS, hidden, dtype=torch.bfloat16, device="cuda")
        check = (gate_up_silu(x0, weights[0]) - silu_and_mul(x0 @ weights[0].T)).abs().max()
        for batch in BATCHES:
            x = x0[:batch]
            eager_us, fused_us = timed_us(eager(x, weights)), timed_us(fused(x, weights))
            rows.append(
                {
                    "model": model,
                    "batch": batch,
                    "eager_us": eager_us,
                    "fused_us": fused_us,
                    "floor_us": floor,
                    "eager_x_floor": eager_us / floor,
                    "fused_x_floor": fused_us / floor,
                    "fused_vs_eager": eager_us / fused_us,
                    "max_abs_diff": float(check),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
        for batch in sweep_rows if args.sweep else ():
            x = x0[:batch]
            timed = []
            for tiles in SWEEP:
                try:
                    timed.append((timed_us(fused(x, weights, tiles), 20), tiles))
                except triton.runtime.errors.OutOfResources:
                    continue  # wide tiles at many rows outgrow shared memory
            timed.sort()
            sweep.append(
                {
                    "model": model,
                    "batch": batch,
                    "best_x_floor": timed[0][0] / floor,
                    "best": [f"n{n} k{k} w{w} s{st}: {us:.1f}" for us, (n, k, w, st) in timed[:4]],
                }
            )
            print(json.dumps(sweep[-1]), flush=True)
    print(f"\nHBM {bandwidth / 1e12:.2f} TB/s; each row: every layer's gate/up and activation")
    print_table(rows, precision=2)
    print_table(sweep, precision=2)
    result = {"hbm_bytes_per_s": bandwidth, "rows": rows, "sweep": sweep}
    write_results("skinny_gate_up", result, args.out)


if __name__ == "__main__":
    main()
