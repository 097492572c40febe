"""sleep(1) and wake_up() of a loaded model, and the memory it holds asleep, against the
floor of copying the weights' bytes to the host and back (one copy per tensor), in the
same run.

CPU (default): the embedded model (float32); floor: memcpy. CUDA (--device cuda):
Llama-3-8B's shape on dummy weights (bfloat16); floor: device to pinned host memory and
back. Targets on CUDA: sleep(1) <= 1.0 s, wake_up() <= 1.0 s (the weights, then the KV
cache and the CUDA graphs captured again), device memory asleep <= 1 GiB more than
before the LLM started. The first sleep, which makes the host pool, is reported apart.
Writes bench/results/sleep.json (sleep_cuda.json on CUDA).

    python -m bench.sleep [--device cuda] [--cycles 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import psutil
import torch

from bench.common import print_table, write_results
from bench.live_weights import DTYPES, add_model_args, full_update, model_folder, nbytes, open_llm
from bench.live_weights import settings as model_settings
from messages import SamplingParams


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def copy_floor(weights: list[tuple[str, torch.Tensor]], device: str, repeats: int) -> tuple:
    """Median seconds to copy every tensor to host memory (pinned on CUDA), and back."""
    hosts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=device == "cuda") for _, t in weights]
    out_s, back_s = [], []
    for _ in range(repeats + 1):
        sync(device)
        start = time.perf_counter()
        for host, (_, t) in zip(hosts, weights, strict=True):
            host.copy_(t, non_blocking=True)
        sync(device)
        middle = time.perf_counter()
        for host, (_, t) in zip(hosts, weights, strict=True):
            t.copy_(host, non_blocking=True)
        sync(device)
        out_s.append(middle - start)
        back_s.append(time.perf_counter() - middle)
    return statistics.median(out_s[1:]), statistics.median(back_s[1:])


def memory_in_use(device: str) -> int:
    """CUDA: bytes in use on the device (every process); CPU: this process's children's RSS."""
    if device == "cuda":
        free, total = torch.cuda.mem_get_info()
        return total - free
    children = psutil.Process().children(recursive=True)
    return sum(p.memory_info().rss for p in children)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser)
    parser.add_argument("--cycles", type=int, default=3)
    args = parser.parse_args()
    dtype, load_format = model_settings(args)
    device = args.device
    before = memory_in_use(device) if device == "cuda" else 0
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = [[1, 2, 3, 4, 5, 6, 7, 8]]
    with model_folder(args) as folder, open_llm(args, folder) as llm:
        expected = llm.generate(prompt, greedy)[0].token_ids
        awake = memory_in_use(device)
        first_sleep_s = timed(lambda: llm.sleep(1))
        llm.wake_up()
        cycles = []
        for _ in range(args.cycles):
            sleep_s = timed(lambda: llm.sleep(1))
            asleep = memory_in_use(device)
            weights_s = timed(lambda: llm.wake_up(["weights"]))
            kv_s = timed(lambda: llm.wake_up(["kv_cache"]))
            assert llm.generate(prompt, greedy)[0].token_ids == expected
            cycles.append({"sleep_s": sleep_s, "wake_weights_s": weights_s, "wake_kv_s": kv_s})
        level2 = timed(lambda: llm.sleep(2))
        asleep2 = memory_in_use(device)
        level2_wake = timed(llm.wake_up)
        llm.reload_weights()
        assert llm.generate(prompt, greedy)[0].token_ids == expected
        weights = full_update(folder, device, DTYPES[dtype])
        out_s, back_s = copy_floor(weights, device, args.cycles)
        size = nbytes(weights)
    sleep_s = statistics.median(c["sleep_s"] for c in cycles)
    wake_s = statistics.median(c["wake_weights_s"] + c["wake_kv_s"] for c in cycles)
    wake_weights_s = statistics.median(c["wake_weights_s"] for c in cycles)
    wake_kv_s = statistics.median(c["wake_kv_s"] for c in cycles)
    rows = [
        {"what": "floor: weights to the host", "s": out_s},
        {"what": "sleep(1)", "s": sleep_s},
        {"what": "sleep(1), the first (makes the pool)", "s": first_sleep_s},
        {"what": "floor: weights from the host", "s": back_s},
        {"what": "wake_up() after sleep(1)", "s": wake_s},
        {"what": "  of which the weights", "s": wake_weights_s},
        {"what": "  of which the KV cache and graphs", "s": wake_kv_s},
        {"what": "sleep(2)", "s": level2},
        {"what": "wake_up() after sleep(2), weights not loaded", "s": level2_wake},
    ]
    memory = {
        "before_llm": before,
        "awake": awake,
        "asleep_level1": asleep,
        "asleep_level2": asleep2,
        "asleep_over_before_gib": (asleep - before) / 2**30,
    }
    summary = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "model": args.model or (args.shape if device == "cuda" else "embedded"),
        "dtype": dtype,
        "load_format": load_format,
        "weight_bytes": size,
        "rows": rows,
        "cycles": cycles,
        "memory_bytes": memory,
        "sleep_over_floor": sleep_s / out_s,
        "wake_weights_over_floor": wake_weights_s / back_s,
    }
    print_table(rows, precision=3)
    what = "device memory in use" if device == "cuda" else "workers' RSS"
    print(
        f"{size / 1e9:.2f} GB of weights; {what}: {awake / 2**30:.2f} GiB awake, "
        f"{asleep / 2**30:.2f} GiB asleep (level 1), {asleep2 / 2**30:.2f} GiB (level 2); "
        f"before the LLM: {before / 2**30:.2f} GiB"
    )
    name = "sleep_cuda" if device == "cuda" else "sleep"
    print(f"wrote {write_results(name, summary, args.out)}")


if __name__ == "__main__":
    main()
