"""The fused mixture of experts alone (CUDA only), on Qwen3-30B-A3B's and Mixtral-8x7B's
expert shapes: decode-sized steps against their floor, prefills against the matmul peak.

A stack of layers, each with its own experts (so they stream from HBM, not L2), routed
by random logits and timed from a CUDA graph of the whole stack. The floor of a step is
the bytes of the experts its tokens chose (their union, per layer, from the same logits)
at the device-to-device bandwidth measured in the same run; a prefill's share of the
bf16 matmul peak counts each token's top k experts.

    python -m bench.fused_moe [--shapes qwen3-30b-a3b,mixtral-8x7b] [--tokens 1,16,64,256,8192]
        [--sweep] [--sweep-tokens 1,64,8192] [--out FILE]

--sweep also times other tile settings (fused_moe.MoeTiles) at --sweep-tokens tokens: the
block rows of the step's regime and the next, each GEMM's tiles in turn (gate/up with the
default down, then down with the best gate/up). What tunes fused_moe._REGIMES.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json

import torch
import triton
import triton.testing

from bench.common import print_table, write_results
from bench.gpu_decode import hbm_bandwidth, matmul_peak
from zmqworker.models.layers.fused_moe import MoeTiles, fused_moe, tiles_for

# hidden, each expert's intermediate size, experts, top k, layers in the stack.
SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8, 8), "mixtral-8x7b": (4096, 14336, 8, 2, 3)}
GEMM_TILES = [
    (n, k, w, s)
    for n, k in ((32, 128), (64, 128), (64, 256), (128, 64))
    for w, s in ((4, 4), (8, 3))
]


def best_tiles(run, default: MoeTiles) -> list[tuple[float, MoeTiles]]:
    """Tile settings around the default by time, fastest first (see the module's doc)."""
    timed: list[tuple[float, MoeTiles]] = []

    def time_all(candidates: list[MoeTiles]) -> None:
        for tiles in candidates:
            try:
                timed.append((timed_us(lambda t=tiles: run(t), 10), tiles))
            except triton.runtime.errors.OutOfResources:
                continue  # wide tiles outgrow shared memory
        timed.sort(key=lambda pair: pair[0])

    for block_m in sorted({default.block_m, min(128, 2 * default.block_m)}):
        base = dataclasses.replace(default, block_m=block_m, chunk=block_m)
        time_all([dataclasses.replace(base, gate_up=g) for g in GEMM_TILES])
        best = timed[0][1]
        time_all([dataclasses.replace(best, down=d) for d in GEMM_TILES])
    return timed


def experts(shape: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    hidden, inter, num_experts, _, layers = SHAPES[shape]
    return [
        (
            torch.randn(num_experts, 2 * inter, hidden, dtype=torch.bfloat16, device="cuda")
            / hidden**0.5,
            torch.randn(num_experts, hidden, inter, dtype=torch.bfloat16, device="cuda")
            / inter**0.5,
        )
        for _ in range(layers)
    ]


def run_stack(stack, x, logits, top_k: int, tiles: MoeTiles | None = None) -> None:
    for (w13, w2), layer_logits in zip(stack, logits, strict=True):
        fused_moe(x, layer_logits, w13, w2, top_k, True, 0, tiles=tiles)


def timed_us(fn, rep: int = 30) -> float:
    fn()
    return triton.testing.do_bench_cudagraph(fn, rep=rep) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--tokens", default="1,16,64,256,8192")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--sweep-tokens", default="1,64,8192")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    bandwidth, peak = hbm_bandwidth(), matmul_peak()
    rows, sweep = [], []
    for shape in args.shapes.split(","):
        hidden, inter, num_experts, top_k, _ = SHAPES[shape]
        stack = experts(shape)
        expert_bytes = 3 * hidden * inter * 2
        for tokens in [int(t) for t in args.tokens.split(",")]:
            x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda")
            logits = [torch.randn(tokens, num_experts, device="cuda") for _ in stack]

            run = functools.partial(run_stack, stack, x, logits, top_k)
            chosen = [int(torch.topk(lg, top_k).indices.unique().numel()) for lg in logits]
            floor_us = sum(chosen) * expert_bytes / bandwidth * 1e6
            flops = 2 * tokens * top_k * expert_bytes / 2 * len(stack)
            us = timed_us(run)
            rows.append(
                {
                    "shape": shape,
                    "tokens": tokens,
                    "block_m": tiles_for(tokens, top_k, num_experts).block_m,
                    "us": us,
                    "floor_us": floor_us,
                    "x_floor": us / floor_us,
                    "mfu": flops / (us / 1e6) / peak,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
            if not args.sweep or str(tokens) not in args.sweep_tokens.split(","):
                continue
            timed = best_tiles(run, tiles_for(tokens, top_k, num_experts))
            sweep.append(
                {
                    "shape": shape,
                    "tokens": tokens,
                    "best_x_floor": timed[0][0] / floor_us,
                    "best": [f"{t}: {us:.1f} us" for us, t in timed[:4]],
                }
            )
            print(json.dumps(sweep[-1]), flush=True)
    print(f"\nHBM {bandwidth / 1e12:.2f} TB/s, bf16 matmul {peak / 1e12:.0f} TFLOP/s")
    print_table(rows, precision=3)
    for row in sweep:
        print(json.dumps(row))
    result = {"hbm_bytes_per_s": bandwidth, "bf16_matmul_flops": peak, "rows": rows}
    print(f"wrote {write_results('fused_moe', {**result, 'sweep': sweep}, args.out)}")


if __name__ == "__main__":
    main()
