"""Small helpers every benchmark shares: timing, percentiles, a table, a JSON result file."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def time_calls(fn: Callable[[], Any], n: int, warmup: int = 100) -> list[float]:
    """Call fn warmup times untimed, then n times; the n durations in seconds."""
    for _ in range(warmup):
        fn()
    clock = time.perf_counter
    samples = []
    for _ in range(n):
        start = clock()
        fn()
        samples.append(clock() - start)
    return samples


def p50_p99_us(samples: Sequence[float]) -> tuple[float, float]:
    """The median and 99th percentile of samples (seconds), in microseconds."""
    p50, p99 = np.percentile(np.asarray(samples) * 1e6, [50, 99])
    return float(p50), float(p99)


def print_table(rows: Sequence[dict[str, Any]], precision: int = 1) -> None:
    """Print rows (dicts with the same keys) as aligned columns; floats to `precision`
    decimals."""
    if not rows:
        return
    keys = list(rows[0])

    def cell(v: Any) -> str:
        return f"{v:.{precision}f}" if isinstance(v, float) else str(v)

    cells = [[cell(r[k]) for k in keys] for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    # numbers right-aligned, text left-aligned
    numeric = [isinstance(rows[0][k], (int, float)) for k in keys]

    def line(values: Sequence[str]) -> str:
        parts = zip(values, widths, numeric, strict=True)
        return "  ".join(v.rjust(w) if n else v.ljust(w) for v, w, n in parts)

    print(line(keys))
    for c in cells:
        print(line(c))


def write_results(name: str, data: dict[str, Any], out: str | None = None) -> Path:
    """Write data as bench/results/<name>.json (creating the folder), or to out when
    given (a benchmark's --out); the path written."""
    if out is None:
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = Path(out) if out is not None else RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def pin_threads(n: int) -> None:
    """Use n torch intra-op threads, so runs on a shared 2-core machine compare fairly."""
    torch.set_num_threads(n)
