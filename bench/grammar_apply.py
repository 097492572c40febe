"""The worker's part of a structured step: applying a step's grammar bitmask to its logits
(model_runner/grammar.py: the host check, the copy to the device, the unpacking, the
masking), 256 rows of SmolLM2's 49,152 tokens, against two floors in the same run: the
masking alone with the banned tokens already unpacked on the device (torch's masked_fill_,
what any apply ends with), and xgrammar's own kernel given the bitmask on the device.
Each call is timed to the device's end (synchronised). Writes
bench/results/grammar_apply.json (or --out).

    python -m bench.grammar_apply [--device cuda] [--rows 256]
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import numpy as np
import torch

from bench.common import print_table, time_calls, write_results
from zmqworker.cdiv import cdiv
from zmqworker.model_runner.grammar import apply_grammar_bitmask

VOCAB = 49152


def measure(device: str, rows: int, iters: int) -> dict[str, Any]:
    """Median microseconds per apply: every row of the logits, and every other row of
    twice as many (the gather path); the floors; the ratios."""
    import xgrammar as xgr

    dev = torch.device(device)
    rng = np.random.default_rng(0)
    allowed = rng.random((rows, VOCAB)) < 0.99  # a JSON string's mask: nearly every token
    bits = np.zeros((rows, cdiv(VOCAB, 32) * 32), bool)
    bits[:, :VOCAB] = allowed
    bitmask = np.packbits(bits, axis=1, bitorder="little").view(np.int32)
    names = [f"r{i}" for i in range(rows)]
    logits = torch.randn(rows, VOCAB, device=dev)
    wide = torch.randn(2 * rows, VOCAB, device=dev)
    banned = torch.from_numpy(~allowed).to(dev)
    every_other = np.arange(0, 2 * rows, 2)

    def synced(fn: Any) -> Any:
        def call() -> None:
            fn()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)

        return call

    def xgrammar_kernel() -> None:
        on_device = torch.from_numpy(bitmask).to(dev, non_blocking=dev.type == "cuda")
        xgr.apply_token_bitmask_inplace(logits, on_device)

    calls = {
        "apply_us": lambda: apply_grammar_bitmask(logits, np.arange(rows), bitmask, names),
        "apply_every_other_row_us": lambda: apply_grammar_bitmask(
            wide, every_other, bitmask, names
        ),
        "floor_masked_fill_us": lambda: logits.masked_fill_(banned, -torch.inf),
        "xgrammar_kernel_us": xgrammar_kernel,
    }
    result: dict[str, Any] = {"device": device, "rows": rows, "vocab": VOCAB}
    for name, fn in calls.items():
        result[name] = 1e6 * statistics.median(time_calls(synced(fn), iters, warmup=5))
    result["apply_over_floor"] = result["apply_us"] / result["floor_masked_fill_us"]
    result["apply_over_xgrammar"] = result["apply_us"] / result["xgrammar_kernel_us"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--iters", type=int, default=None, help="20 on the CPU, 200 on CUDA")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    iters = args.iters or (200 if args.device.startswith("cuda") else 20)
    row = measure(args.device, args.rows, iters)
    print_table([row])
    write_results("grammar_apply", row, args.out)


if __name__ == "__main__":
    main()
