"""The decode step's kernels alone, against the bytes they must move (CUDA only).

Decode attention (Triton, with its tile and split settings varied; rotary and the write
of the step's key and value included) over a paged cache of random data, and the linear
layers of the decode step (cuBLAS) at several batch sizes, each timed from a CUDA graph
of its launches (triton.testing.do_bench_cudagraph), against the time its bytes take at
the device-to-device bandwidth measured in the same run. The rows show where a decode
step's time goes, and which kernel settings pay. --long: decode attention alone over
long histories (8B's heads, 8,192 and 32,768 positions, batches 1 and 4) at each split
count, the chosen one (triton_metadata.decode_splits) marked.

    python -m bench.attention_kernels [--long] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import triton
import triton.testing

from bench.common import print_table, write_results
from bench.gpu_decode import hbm_bandwidth
from zmqworker.attention import triton_attention
from zmqworker.attention.kv_cache import allocate_kv_cache
from zmqworker.attention.triton_metadata import (
    FEW_SPLITS,
    TARGET_DECODE_PROGRAMS,
    TritonAttentionMetadata,
    decode_splits,
    tile_size,
)
from zmqworker.cdiv import cdiv

BLOCK_SIZE = 16
CONTEXT = 552
# name: (num_heads, num_kv_heads, head_dim, hidden, intermediate)
MODELS = {
    "smollm2-135m": (9, 3, 64, 576, 1536),
    "llama-3.2-1b": (32, 8, 64, 2048, 8192),
    "llama-3-8b": (32, 8, 128, 4096, 14336),
    "qwen2.5-1.5b": (12, 2, 128, 1536, 8960),
    # MLP shapes of other small models, for the projections' tile sweeps.
    "qwen2.5-0.5b": (14, 2, 64, 896, 4864),
    "qwen3-1.7b": (16, 8, 128, 2048, 6144),
    "qwen2.5-3b": (16, 2, 128, 2048, 11008),
    "llama-3.2-3b": (24, 8, 128, 3072, 8192),
}


def decode_case(
    model: str,
    batch: int,
    splits: int,
    warps: int,
    stages: int,
    tile: int | None = None,
    context: int = CONTEXT,
):
    """tile: history positions per tile, in place of the cache's own (tile_size)."""
    heads, kv_heads, head_dim, _, _ = MODELS[model]
    blocks_per_req = cdiv(context, BLOCK_SIZE)
    num_blocks = batch * blocks_per_req
    cache = allocate_kv_cache(num_blocks, BLOCK_SIZE, kv_heads, head_dim, torch.bfloat16, "cuda")
    cache.normal_()
    tables = torch.randperm(num_blocks, device="cuda", dtype=torch.int32).view(batch, -1)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    # The step's token at the last position of each request: rotated and written there.
    last = context - 1
    slots = tables[:, last // BLOCK_SIZE] * BLOCK_SIZE + last % BLOCK_SIZE
    meta = TritonAttentionMetadata(
        batch,
        batch,
        1,
        True,
        splits,
        slots.to(torch.int32),
        torch.full((batch,), last, dtype=torch.int32, device="cuda"),
        torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
        seq_lens,
        tables,
    )
    qkv = torch.randn(batch, heads + 2 * kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    cos_sin = torch.randn(context, head_dim, dtype=torch.bfloat16, device="cuda")
    saved = triton_attention.DECODE_LAUNCH, triton_attention.tile_size
    triton_attention.DECODE_LAUNCH = {"num_warps": warps, "num_stages": stages}
    if tile is not None:
        triton_attention.tile_size = lambda block_size: tile
    try:
        fn = lambda: triton_attention.decode_attention(  # noqa: E731
            qkv, heads, cos_sin, cache, meta, head_dim**-0.5
        )
        fn()
        ms = triton.testing.do_bench_cudagraph(fn, rep=50)
    finally:
        triton_attention.DECODE_LAUNCH, triton_attention.tile_size = saved
    kv_bytes = batch * context * kv_heads * head_dim * 2 * 2
    return ms, kv_bytes


def linear_case(model: str, batch: int):
    """The four linear layers of one decoder layer at `batch` tokens."""
    heads, kv_heads, head_dim, hidden, inter = MODELS[model]
    shapes = [
        (hidden, (heads + 2 * kv_heads) * head_dim),
        (heads * head_dim, hidden),
        (hidden, 2 * inter),
        (inter, hidden),
    ]
    weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") for k, n in shapes]
    xs = [torch.randn(batch, k, dtype=torch.bfloat16, device="cuda") for k, _ in shapes]

    def fn() -> None:
        for x, w in zip(xs, weights, strict=True):
            torch.nn.functional.linear(x, w)

    fn()
    ms = triton.testing.do_bench_cudagraph(fn, rep=50)
    return ms, sum(w.numel() * 2 for w in weights)


def long_rows(bandwidth: float) -> list[dict]:
    """8B's decode attention over 8,192 and 32,768 positions at batches 1 and 4, at each
    split count; the one a runner of max_model_len 32,768 + 256 picks is marked."""
    rows = []
    for context in (8192, 32768):
        for batch in (1, 4):
            chosen = decode_splits(batch, 8, 32768 + 256, tile_size(BLOCK_SIZE))
            for splits in (16, FEW_SPLITS, 64, 128, 256):
                ms, nbytes = decode_case("llama-3-8b", batch, splits, 2, 2, context=context)
                floor = nbytes / bandwidth * 1e3
                rows.append(
                    {
                        "what": f"llama-3-8b attention at {context}",
                        "batch": batch,
                        "setting": f"s{splits}" + (" (chosen)" if splits == chosen else ""),
                        "splits": splits,
                        "us": ms * 1e3,
                        "floor_us": floor * 1e3,
                        "x_floor": ms / floor,
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--long", action="store_true", help="long histories only")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    bandwidth = hbm_bandwidth()
    if args.long:
        rows = long_rows(bandwidth)
        print(f"\nHBM {bandwidth / 1e12:.2f} TB/s; one decoder layer's decode attention")
        print_table(rows, precision=2)
        write_results("attention_long", {"hbm_bytes_per_s": bandwidth, "rows": rows}, args.out)
        return
    rows = []
    for model, batches in (
        ("smollm2-135m", (1, 32, 256)),
        ("llama-3.2-1b", (1, 64)),
        ("llama-3-8b", (1, 64, 256)),
    ):
        for batch in batches:
            ms, nbytes = linear_case(model, batch)
            floor = nbytes / bandwidth * 1e3
            rows.append(
                {
                    "what": f"{model} linears",
                    "batch": batch,
                    "setting": "cublas",
                    "us": ms * 1e3,
                    "floor_us": floor * 1e3,
                    "x_floor": ms / floor,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
            kv_heads = MODELS[model][1]
            # Today's setting (2 warps, 2 stages, the cache's tiles, a target of
            # TARGET_DECODE_PROGRAMS programs), and its neighbours.
            for warps, stages in ((2, 2), (4, 2)):
                for tile in (tile_size(BLOCK_SIZE), 64):
                    for programs in (TARGET_DECODE_PROGRAMS // 2, TARGET_DECODE_PROGRAMS, 1536):
                        want = cdiv(programs, batch * kv_heads)
                        splits = 1
                        while splits * 2 <= min(want, FEW_SPLITS):  # a short history's
                            splits *= 2
                        ms, nbytes = decode_case(model, batch, splits, warps, stages, tile)
                        floor = nbytes / bandwidth * 1e3
                        rows.append(
                            {
                                "what": f"{model} attention",
                                "batch": batch,
                                "setting": f"w{warps} s{stages} p{programs} t{tile}",
                                "splits": splits,
                                "us": ms * 1e3,
                                "floor_us": floor * 1e3,
                                "x_floor": ms / floor,
                            }
                        )
                        print(json.dumps(rows[-1]), flush=True)
    print(f"\nHBM {bandwidth / 1e12:.2f} TB/s; each row: one decoder layer's kernels")
    print_table(rows, precision=2)
    # Decode settings by the geometric mean of their time over the cases.
    by_setting: dict[str, list[float]] = {}
    for row in rows:
        if row["what"].endswith("attention"):
            by_setting.setdefault(row["setting"], []).append(row["us"])
    ranking = sorted(
        (math.exp(sum(map(math.log, us)) / len(us)), setting) for setting, us in by_setting.items()
    )
    for mean, setting in ranking:
        print(f"{setting}: geometric mean {mean:.2f} us")
    result = {
        "hbm_bytes_per_s": bandwidth,
        "rows": rows,
        "decode_ranking": [{"setting": s, "geomean_us": m} for m, s in ranking],
    }
    write_results("attention_kernels", result, args.out)


if __name__ == "__main__":
    main()
