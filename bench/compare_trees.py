"""This tree against another checkout (an older commit) on the same machine, in the same
run: the round trip of bench.rpc_latency (no-op and step, 1, 2 and 4 workers),
bench.end_to_end (tp=1 pp=1 with async scheduling off, pp=2), bench.pipeline (decode
at depth 1 and 2, the channel's bandwidth), and bench.engine_step (the engine core's turn
at 1, 64 and 256 decoding requests; engine_step_structured: the same at 256 with and
without a JSON schema each, by this tree's bench code). Each measurement runs in a fresh process of
one tree, the trees taking turns round after round (in alternating order), so that the
machine's slow and fast moments fall on both; the medians of the rounds are compared.
Each tree's own benchmark code does the measuring. Writes bench/results/compare_trees.json
(or --out).

    git worktree add /tmp/old-tree OLD_COMMIT
    python -m bench.compare_trees /tmp/old-tree [--rounds 4] [--what rpc,e2e,pipeline]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

from bench.common import print_table, write_results

ROOT = Path(__file__).resolve().parent.parent
# What each measurement reports, and whether more is better (rates) or less (latencies).
HIGHER_IS_BETTER = {
    "rpc": False,
    "e2e": True,
    "pipeline": True,
    "engine_step": False,
    "engine_step_structured": False,
}


def measure_rpc(iters: int = 1000) -> dict[str, float]:
    """p50 microseconds of collective_rpc no-op and the 256-request step."""
    from bench.rpc_latency import echo_config
    from messages.examples import decode_step
    from zmqworker.executor.multiproc import MultiprocExecutor

    out, step = {}, decode_step()
    for workers in (1, 2, 4):
        ex = MultiprocExecutor(echo_config(workers), env={"PYTHONPATH": os.getcwd()})
        try:
            calls = {
                "noop": partial(ex.collective_rpc, "noop"),
                "step": partial(ex.execute_model, step),
            }
            for name, call in calls.items():
                for _ in range(50):
                    call()
                times = []
                for _ in range(iters):
                    start = time.perf_counter()
                    call()
                    times.append(time.perf_counter() - start)
                out[f"{name} {workers} workers p50_us"] = 1e6 * statistics.median(times)
        finally:
            ex.shutdown()
    return out


def measure_e2e() -> dict[str, float]:
    """Output tokens per second of bench.end_to_end's workload."""
    import transformers

    from bench import end_to_end
    from zmqworker.models.embedded import default_model_path

    path = default_model_path()
    batch = end_to_end.prompts(transformers.AutoTokenizer.from_pretrained(path))
    # Trees from before async scheduling take no such argument and schedule synchronously.
    sync = (
        [False] if "async_scheduling" in inspect.signature(end_to_end.run_ours).parameters else []
    )
    return {
        "pp=1 sync tok_s": end_to_end.run_ours(path, batch, 1, 2, "cpu", *sync)["tok_s"],
        "pp=2 tok_s": end_to_end.run_ours(path, batch, 2, 2, "cpu")["tok_s"],
    }


def measure_pipeline() -> dict[str, float]:
    """bench.pipeline's decode at depth 1 and 2 (tokens/s) and its channel (GB/s)."""
    import torch

    from bench import pipeline

    torch.set_num_threads(1)
    # bench.pipeline's model, spelled out here: older trees have no helper that makes it.
    with tempfile.TemporaryDirectory(prefix="zmqworker-compare-") as folder:
        path = pipeline.make_tiny_checkpoint(
            folder,
            num_layers=8,
            hidden_size=1024,
            num_heads=16,
            num_kv_heads=4,
            intermediate_size=2816,
            vocab_size=4096,
        )
        speed = pipeline.pipeline_speedup(path, 20)
    out = {"depth 1 tok_s": speed["depth1_tok_s"], "depth 2 tok_s": speed["depth2_tok_s"]}
    for mib, repeats in ((1.0, 50), (16.0, 10)):
        row = pipeline.channel_bandwidth(mib, repeats)
        out[f"{mib:g} MiB shm GB/s"] = row["gb_s"]
        out[f"{mib:g} MiB frames GB/s"] = row["frames_gb_s"]
    return out


def measure_engine_step() -> dict[str, float]:
    """bench.engine_step: microseconds per step of each phase of the engine core's turn
    (a tree older than that bench needs a copy of bench/engine_step.py)."""
    from bench import engine_step

    results = engine_step.run([1, 64, 256], 300)
    return {f"{n} {phase}": value for n, row in results.items() for phase, value in row.items()}


def measure_engine_step_structured() -> dict[str, float]:
    """bench.engine_step --json-schema: the engine core's turn with 256 decoding requests,
    without and with a JSON schema each, measured by this tree's copy of the bench (older
    trees lack it)."""
    import importlib.util

    path = Path(__file__).resolve().with_name("engine_step_structured.py")
    spec = importlib.util.spec_from_file_location("engine_step_structured", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = {}
    for name, constrained in (("plain", False), ("schema", True)):
        for key, value in module.measure(256, 150, constrained).items():
            out[f"{name} {key}"] = value
    return out


MEASURES = {
    "rpc": measure_rpc,
    "e2e": measure_e2e,
    "pipeline": measure_pipeline,
    "engine_step": measure_engine_step,
    "engine_step_structured": measure_engine_step_structured,
}


def run_child(tree: Path, what: str) -> dict[str, float]:
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--child", what],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if proc.returncode:
        raise RuntimeError(f"{what} in {tree} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def compare(other: Path, what: list[str], rounds: int) -> list[dict]:
    trees = {"this": ROOT, "other": other}
    rows = []
    for kind in what:
        samples: dict[str, dict[str, list[float]]] = {name: {} for name in trees}
        for r in range(rounds):
            for name in list(trees) if r % 2 == 0 else list(trees)[::-1]:
                for key, value in run_child(trees[name], kind).items():
                    samples[name].setdefault(key, []).append(value)
            print(f"{kind}: round {r + 1} of {rounds}", flush=True)
        for key, values in samples["this"].items():
            ours, theirs = statistics.median(values), statistics.median(samples["other"][key])
            faster = ours / theirs if HIGHER_IS_BETTER[kind] else theirs / ours
            rows.append({"bench": kind, "measure": key, "this": ours, "other": theirs,
                         "this_speed_vs_other": faster})  # fmt: skip
    return rows


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        sys.path.insert(0, os.getcwd())  # the tree being measured, not this one
        print(json.dumps(MEASURES[sys.argv[2]]()))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("other", type=Path, help="the other checkout's root folder")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--what", default="rpc,e2e,pipeline")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    what = args.what.split(",")
    unknown = [w for w in what if w not in MEASURES]
    if unknown or not (args.other / "zmqworker").is_dir():
        parser.error(f"unknown --what {unknown}" if unknown else f"{args.other}: no zmqworker/")
    rows = compare(args.other.resolve(), what, args.rounds)
    print_table(rows)
    print("this_speed_vs_other: above 1, this tree is faster")
    other_commit = subprocess.run(
        ["git", "-C", str(args.other), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    result = {"other": other_commit or str(args.other), "rounds": args.rounds, "rows": rows}
    print(f"wrote {write_results('compare_trees', result, args.out)}")


if __name__ == "__main__":
    main()
