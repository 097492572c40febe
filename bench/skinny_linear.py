"""The decode step's other projections (q/k/v, o, down) at decode-sized steps: cuBLAS
against the split-K skinny Triton kernel (CUDA only).

Each model's every layer, with its own weights as in a step (so they stream from HBM, not
L2), timed from a CUDA graph of the whole stack (triton.testing.do_bench_cudagraph),
against the floor: the weights' bytes at the device-to-device bandwidth measured in the
same run.

    python -m bench.skinny_linear [--out FILE] [--models a,b] [--sweep] [--sweep-rows 1,16]

--sweep also times the kernel under other tile settings at --sweep-rows rows. Rows say
whether the model's layers of that shape take the kernel at that size
(skinny_linear.row_limit).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
import triton

from bench.attention_kernels import MODELS
from bench.common import print_table, write_results
from bench.gpu_decode import hbm_bandwidth
from bench.skinny_gate_up import DEFAULT_MODELS, LAYERS, timed_us
from zmqworker.models.layers.row_tiles import ROW_TILES
from zmqworker.models.layers.skinny_linear import (
    LARGE_WEIGHT_ROWS,
    MAX_ROWS,
    counter_slots,
    k_splits,
    row_limit,
    skinny_linear,
)

BATCHES = (1, 4, 8, *ROW_TILES)
# (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages); the deeper pipelines and eight warps
# are for the 32- and 64-row tiles.
SWEEP = [
    (n, k, split, w, stages)
    for n in (16, 32, 64, 128)
    for k in (64, 128, 256)
    for split in (1, 2, 4, 8)
    for w, stages in ((2, 3), (4, 3), (4, 4), (8, 3))
]


def op_shapes(model: str) -> dict[str, tuple[int, int]]:
    """name: (out_features, in_features) of one layer's projection."""
    heads, kv_heads, head_dim, hidden, inter = MODELS[model]
    return {
        "qkv": ((heads + 2 * kv_heads) * head_dim, hidden),
        "o": (hidden, heads * head_dim),
        "down": (hidden, inter),
    }


def cublas(x: torch.Tensor, weights: list[torch.Tensor]) -> Callable[[], None]:
    return lambda: [torch.nn.functional.linear(x, w) for w in weights]


def skinny(x, weights, counters, tiles=None) -> Callable[[], None]:
    return lambda: [skinny_linear(x, w, None, counters, tiles) for w in weights]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--models", default=DEFAULT_MODELS)
    parser.add_argument("--sweep-rows", default=f"1,{LARGE_WEIGHT_ROWS}")
    args = parser.parse_args()
    sweep_rows = [int(r) for r in args.sweep_rows.split(",")]
    bandwidth = hbm_bandwidth()
    rows, sweep = [], []
    for model in args.models.split(","):
        for op, (n, k) in op_shapes(model).items():
            weights = [
                torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k**0.5
                for _ in range(LAYERS[model])
            ]
            counters = torch.zeros(counter_slots(n), dtype=torch.int32, device="cuda")
            floor = sum(w.numel() * 2 for w in weights) / bandwidth * 1e6
            x0 = torch.randn(MAX_ROWS, k, dtype=torch.bfloat16, device="cuda")
            check = (skinny_linear(x0, weights[0], None, counters) - x0 @ weights[0].T).abs()
            for batch in BATCHES:
                x = x0[:batch]
                cublas_us, skinny_us = (
                    timed_us(cublas(x, weights)),
                    timed_us(skinny(x, weights, counters)),
                )
                rows.append(
                    {
                        "model": model,
                        "op": op,
                        "batch": batch,
                        "used": batch <= row_limit(n, k),
                        "cublas_us": cublas_us,
                        "skinny_us": skinny_us,
                        "floor_us": floor,
                        "cublas_x_floor": cublas_us / floor,
                        "skinny_x_floor": skinny_us / floor,
                        "skinny_vs_cublas": cublas_us / skinny_us,
                        "max_abs_diff": float(check.max()),
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
            for batch in sweep_rows if args.sweep else ():
                x = x0[:batch]
                timed = []
                for tiles in SWEEP:
                    try:
                        timed.append((timed_us(skinny(x, weights, counters, tiles), 10), tiles))
                    except triton.runtime.errors.OutOfResources:
                        continue
                timed.sort()
                sweep.append(
                    {
                        "model": model,
                        "op": op,
                        "batch": batch,
                        "best_x_floor": timed[0][0] / floor,
                        # s: the splits that ran (k_splits), not those asked.
                        "best": [
                            f"n{bn} k{bk} s{k_splits(k, bk, split)[0]} w{w} st{st}: {us:.1f}"
                            for us, (bn, bk, split, w, st) in timed[:4]
                        ],
                    }
                )
                print(json.dumps(sweep[-1]), flush=True)
            del weights
            torch.cuda.empty_cache()
    print(f"\nHBM {bandwidth / 1e12:.2f} TB/s; each row: every layer's projection")
    print_table(rows, precision=2)
    result = {"hbm_bytes_per_s": bandwidth, "rows": rows, "sweep": sweep}
    write_results("skinny_linear", result, args.out)


if __name__ == "__main__":
    main()
