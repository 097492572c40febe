"""The client's share of a step: LLM.generate over an engine core whose workers answer
at once (bench/engine_step.py's stand-in executor), so that what is left is the engine
core's turn and the client's handling of each step's outputs.

256 requests (130-token prompts, as the issue's workload) decode 64 greedy tokens each,
ignore_eos, with the embedded model's tokenizer (their text is made, as a user's would
be). The engine core runs in a thread of this process (an executor factory), so engine
and client share one interpreter: reported are the whole generate per decode step, and
the client's part of it (EngineCoreClient.drain, which reads and decodes, and
Frontend._handle, which applies the outputs), in microseconds per step; medians of
--repeats runs.

--compare OLD_TREE runs this file's measurement in fresh processes of each tree in turn
(PYTHONPATH set to the tree; the older tree's bench/engine_step.py supplies its stand-in),
round after round, and reports both with their ratio. Writes
bench/results/client_outputs.json (or --out).

    python -m bench.client_outputs [--compare /work/main] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REQUESTS, PROMPT_LEN, OUTPUT_LEN = 256, 130, 64
HERE = Path(__file__).resolve()


def measure(repeats: int) -> dict[str, float]:
    """Microseconds per decode step: generate in all, and the client's part."""
    import numpy as np

    from bench.engine_step import BLOCK_SIZE, InstantExecutor
    from messages import SamplingParams
    from zmqworker.frontend.llm import LLM
    from zmqworker.models.embedded import default_model_path

    max_model_len = PROMPT_LEN + OUTPUT_LEN + 16
    num_blocks = REQUESTS * (max_model_len // BLOCK_SIZE + 1) + 64
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 30000, PROMPT_LEN).tolist() for _ in range(REQUESTS)]
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    client_s = [0.0]

    def timed(fn: Any) -> Any:
        def wrapper(*args: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                client_s[0] += time.perf_counter() - start

        return wrapper

    totals, clients = [], []
    with LLM(
        default_model_path(),
        executor=lambda config: InstantExecutor(num_blocks),
        max_num_seqs=REQUESTS,
        max_num_batched_tokens=REQUESTS * PROMPT_LEN,
        max_model_len=max_model_len,
        block_size=BLOCK_SIZE,
    ) as llm:
        llm.client.drain = timed(llm.client.drain)  # type: ignore[method-assign]
        llm._handle = timed(llm._handle)  # type: ignore[method-assign]
        llm.generate(prompts[:8], SamplingParams(temperature=0.0, max_tokens=8))  # warm
        for _ in range(repeats):
            client_s[0] = 0.0
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            totals.append(time.perf_counter() - start)
            clients.append(client_s[0])
            assert sum(len(o.token_ids) for o in outs) == REQUESTS * OUTPUT_LEN
    return {
        "generate_us_per_step": 1e6 * statistics.median(totals) / OUTPUT_LEN,
        "client_us_per_step": 1e6 * statistics.median(clients) / OUTPUT_LEN,
    }


def run_tree(tree: str, repeats: int) -> dict[str, float]:
    """measure() in a fresh process of tree."""
    env = {**os.environ, "PYTHONPATH": tree}
    out = subprocess.run(
        [sys.executable, str(HERE), "--one", "--repeats", str(repeats)],
        env=env,
        cwd=tree,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", default=None, help="an older tree to run in turns")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--one", action="store_true", help="measure this tree; JSON out")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.repeats)))
        return
    from bench.common import print_table, write_results

    trees = {"this": str(HERE.parent.parent)}
    if args.compare:
        trees["old"] = str(Path(args.compare).resolve())
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for round_ in range(args.rounds):
        order = list(trees) if round_ % 2 == 0 else list(reversed(trees))
        for name in order:
            runs[name].append(run_tree(trees[name], args.repeats))
            print(name, runs[name][-1], flush=True)
    rows = []
    for name, results in runs.items():
        keys = results[0].keys()
        rows.append({"tree": name, **{k: statistics.median(r[k] for r in results) for k in keys}})
    print_table(rows)
    summary: dict[str, Any] = {"trees": trees, "rows": rows, "runs": runs}
    if "old" in trees:
        this, old = rows
        for key in ("generate_us_per_step", "client_us_per_step"):
            summary[f"old_over_this_{key}"] = old[key] / this[key]
            print(f"{key}: {old[key]:.0f} -> {this[key]:.0f} ({old[key] / this[key]:.2f}x)")
    print(f"wrote {write_results('client_outputs', summary, args.out)}")


if __name__ == "__main__":
    main()
