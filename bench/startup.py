"""Start-up of `zmqworker generate` on the embedded model, as a user waits for it: from
starting the command to the engine being ready (the "ready" line on stderr), with the
phases the engine prints (engine_ready_s: LLM() from its call to ready, the command's own
imports left out; workers and weights, memory profile, KV cache, warm-up).

Measured in the same run: the floor, a Python process that imports torch (every worker
and the engine do at least that), and the reference, a process that loads the same
checkpoint and tokenizer with transformers. Each row is the median of --repeats fresh
processes; the checkpoint is converted beforehand. Writes bench/results/startup.json (or
--out).

    python -m bench.startup [--repeats 3] [--out PATH]
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.common import print_table, write_results
from zmqworker.models.embedded import default_model_path

ROOT = Path(__file__).resolve().parent.parent
PHASES = {
    "engine_ready_s": r"zmqworker: ready: ([\d.]+) s",
    "workers_weights_s": r"workers up, weights loaded: ([\d.]+) s",
    "profile_s": r"memory profile: ([\d.]+) s",
    "kv_cache_s": r"KV cache: .*: ([\d.]+) s",
    "warm_up_s": r"warm-up: ([\d.]+) s",
}
KV_LINE = re.compile(r"KV cache: (\d+) blocks of \d+ tokens = ([\d.]+) MiB")


def time_process(argv: list[str], ready: str | None = None) -> tuple[float, str]:
    """Seconds from spawning argv until a stderr line contains ready (None: until it
    exits), and its stderr."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    lines, elapsed = [], None
    assert proc.stderr is not None
    for line in proc.stderr:
        lines.append(line)
        if elapsed is None and ready is not None and ready in line:
            elapsed = time.perf_counter() - start
    if proc.wait() != 0:
        raise RuntimeError(f"{argv} failed:\n{''.join(lines)[-2000:]}")
    return (elapsed if elapsed is not None else time.perf_counter() - start), "".join(lines)


def generate_row(label: str, options: list[str], repeats: int) -> dict:
    argv = [sys.executable, "-m", "zmqworker", "generate", "Hi", "--max-tokens", "1", *options]
    runs = [time_process(argv, ready="zmqworker: ready:") for _ in range(repeats)]
    row: dict = {"system": label, "ready_s": statistics.median(t for t, _ in runs)}
    for name, pattern in PHASES.items():
        row[name] = statistics.median(float(re.search(pattern, err).group(1)) for _, err in runs)
    blocks, mib = KV_LINE.search(runs[0][1]).groups()
    row["kv_blocks"], row["kv_mib"] = int(blocks), float(mib)
    return row


def process_row(label: str, code: str, repeats: int) -> dict:
    seconds = [time_process([sys.executable, "-c", code])[0] for _ in range(repeats)]
    row = {"system": label, "ready_s": statistics.median(seconds)}
    return row | {name: "-" for name in [*PHASES, "kv_blocks", "kv_mib"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="result file (default bench/results/)")
    args = parser.parse_args()
    path = default_model_path()
    load = (
        "import torch, transformers; "
        f"transformers.AutoModelForCausalLM.from_pretrained({path!r}, dtype=torch.float32); "
        f"transformers.AutoTokenizer.from_pretrained({path!r})"
    )
    rows = [
        generate_row("zmqworker generate (tp=1 pp=1)", [], args.repeats),
        generate_row("zmqworker generate --pp 2", ["--pp", "2"], args.repeats),
        process_row("floor: python -c 'import torch'", "import torch", args.repeats),
        process_row("reference: transformers loads model + tokenizer", load, args.repeats),
    ]
    print_table(rows, precision=2)
    result = {"repeats": args.repeats, "rows": rows}
    print(f"wrote {write_results('startup', result, args.out)}")


if __name__ == "__main__":
    main()
