"""A full weight update from the engine's process (LLM.update_weights), against the floor
of copying the same bytes once, measured in the same run.

CPU (default): the embedded model (float32), CPU tensors through shared memory; floor: a
memcpy of the same bytes (copy_ into tensors made beforehand). Target: the update's
bandwidth >= 0.5x the memcpy's.
CUDA (--device cuda): Llama-3-8B's shape on dummy weights (bfloat16), CUDA tensors in
this process through CUDA IPC; floor: a device copy of the same bytes. Target: <= 0.3 s.
Each update is checked: greedy tokens after it are those of its weights (the same
weights pushed twice give the same tokens). Writes bench/results/weight_update.json.

    python -m bench.weight_update [--device cuda] [--repeats 5] [--chunk-mib 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.common import print_table, write_results
from bench.live_weights import (
    DTYPES,
    add_model_args,
    full_update,
    model_folder,
    nbytes,
    open_llm,
    settings,
)
from messages import SamplingParams


def copy_floor_s(weights: list[tuple[str, torch.Tensor]], repeats: int) -> float:
    """Median seconds to copy every tensor once into tensors made beforehand."""
    targets = [torch.empty_like(t) for _, t in weights]
    times = []
    for _ in range(repeats + 1):
        if weights[0][1].is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for dst, (_, src) in zip(targets, weights, strict=True):
            dst.copy_(src)
        if weights[0][1].is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    del targets
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chunk-mib", type=int, default=64, help="shared-memory chunks (CPU)")
    args = parser.parse_args()
    dtype, load_format = settings(args)
    with model_folder(args) as folder, open_llm(args, folder) as llm:
        weights = full_update(folder, args.device, DTYPES[dtype])
        size = nbytes(weights)
        chunk = args.chunk_mib << 20
        greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        prompt = [[1, 2, 3, 4, 5, 6, 7, 8]]
        llm.update_weights(weights, chunk)  # the first: segments made, pages mapped
        first = llm.generate(prompt, greedy)[0].token_ids
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            llm.update_weights(weights, chunk)
            times.append(time.perf_counter() - start)
        assert llm.generate(prompt, greedy)[0].token_ids == first
        update_s = statistics.median(times)
        floor_s = copy_floor_s(weights, args.repeats)
    floor_name = "device copy" if args.device == "cuda" else "memcpy"
    rows = [
        {"what": f"{floor_name} of the same bytes (floor)", "s": floor_s},
        {"what": "LLM.update_weights", "s": update_s},
    ]
    for row in rows:
        row["GB/s"] = size / row["s"] / 1e9
    summary = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "model": args.model or (args.shape if args.device == "cuda" else "embedded"),
        "dtype": dtype,
        "load_format": load_format,
        "bytes": size,
        "tensors": len(weights),
        "chunk_bytes": chunk,
        "update_s": times,
        "rows": rows,
        "update_over_floor_bandwidth": floor_s / update_s,
    }
    print_table(rows, precision=3)
    target = "update <= 0.3 s" if args.device == "cuda" else "bandwidth >= 0.5x memcpy"
    print(
        f"{size / 1e9:.2f} GB in {len(weights)} tensors: update {update_s:.3f} s, "
        f"{summary['update_over_floor_bandwidth']:.2f}x the floor's bandwidth ({target})"
    )
    name = "weight_update_cuda" if args.device == "cuda" else "weight_update"
    print(f"wrote {write_results(name, summary, args.out)}")


if __name__ == "__main__":
    main()
