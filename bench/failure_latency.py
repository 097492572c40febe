"""How soon failures are noticed, against their bounds (measured, not tested).

- worker killed: two echo workers each run a 30 s step (three calls in flight); rank 1
  is SIGKILLed; the time until every pending call has failed with WorkerDiedError, and
  then the time a new call takes to fail. Bound: 1 s.
- engine killed: an engine process with two idle echo workers is SIGKILLed; the time
  until both workers have exited by themselves, watched through their pidfds.
- under load (bench/loaded_failures.py: the embedded model at PP=2, both stages inside
  a step of a large batch): engine SIGKILL -> workers gone (p95 bound 0.3 s, with the
  kernel's own parent-death latency as the floor), worker SIGSTOP -> WorkerStuckError
  (bound 3 s with the default 2 s silence bound), worker SIGKILL -> `zmqworker generate`
  exits (bound 1 s).

Each is repeated; the table gives the median, p95 and worst, and p95 as a fraction of
its bound (percent). Writes bench/results/failure_latency.json.

    python -m bench.failure_latency [--repeats 5] [--loaded-repeats 10] [--skip-loaded]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import textwrap
import time
from pathlib import Path

import numpy as np

from bench import loaded_failures as loaded
from bench.common import print_table, write_results
from bench.loaded_failures import kill_engine
from bench.rpc_latency import echo_config
from zmqworker.executor.errors import WorkerDiedError
from zmqworker.executor.handshake import STUCK_AFTER_S
from zmqworker.executor.multiproc import MultiprocExecutor

ROOT = Path(__file__).resolve().parent.parent
WORKER_KILLED_BOUND_S = 1.0
ENGINE_KILLED_BOUND_S = 0.3
WORKER_STOPPED_BOUND_S = 3.0
CLI_EXIT_BOUND_S = 1.0

ENGINE_SCRIPT = textwrap.dedent(
    """
    import time
    from bench.rpc_latency import echo_config
    from zmqworker.executor.multiproc import MultiprocExecutor
    ex = MultiprocExecutor(echo_config(2))
    print(*ex.pids, flush=True)
    time.sleep(600)
    """
)


def worker_killed() -> tuple[float, float]:
    """Seconds from SIGKILL to the last pending call failing, and for a new call."""
    ex = MultiprocExecutor(echo_config(2))
    try:
        pending = [ex.collective_rpc("sleep_for", (30,), non_block=True) for _ in range(3)]
        time.sleep(0.3)  # the steps are running
        start = time.perf_counter()
        os.kill(ex.pids[1], signal.SIGKILL)
        for call in pending:
            if not isinstance(call.exception(timeout=30), WorkerDiedError):
                raise RuntimeError("a pending call did not fail with WorkerDiedError")
        pending_s = time.perf_counter() - start
        start = time.perf_counter()
        try:
            ex.collective_rpc("noop", timeout=30)
        except WorkerDiedError:
            later_s = time.perf_counter() - start
        else:
            raise RuntimeError("a call after the death succeeded")
    finally:
        ex.shutdown()
    return pending_s, later_s


def engine_killed() -> float:
    """Seconds from the engine's SIGKILL to the exit of the last of its workers."""
    return kill_engine(ENGINE_SCRIPT, busy_s=0.0)


def summary(case: str, samples_s: list[float], bound_s: float, floor_s: float = 0.0) -> dict:
    ms = np.asarray(samples_s) * 1000
    p95 = float(np.percentile(ms, 95))
    return {
        "case": case,
        "runs": len(ms),
        "median_ms": float(np.median(ms)),
        "p95_ms": p95,
        "worst_ms": float(ms.max()),
        "floor_ms": floor_s * 1000,
        "bound_ms": bound_s * 1000,
        "p95_pct_of_bound": 100 * p95 / (bound_s * 1000),
        "samples_ms": [round(float(v), 2) for v in ms],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs of each echo row")
    parser.add_argument("--loaded-repeats", type=int, default=10, help="engine kills under load")
    parser.add_argument("--skip-loaded", action="store_true", help="only the echo rows")
    args = parser.parse_args()
    os.environ["PYTHONPATH"] = str(ROOT)
    n = args.repeats
    killed = [worker_killed() for _ in range(n)]
    rows = [
        summary("worker killed: pending calls fail", [p for p, _ in killed],
                WORKER_KILLED_BOUND_S),
        summary("worker killed: a later call fails", [c for _, c in killed],
                WORKER_KILLED_BOUND_S),
    ]  # fmt: skip
    floor = statistics.median(loaded.bare_child_of_killed_parent() for _ in range(n))
    idle = [engine_killed() for _ in range(n)]
    rows.append(summary("engine killed, workers idle: workers exit", idle,
                        ENGINE_KILLED_BOUND_S, floor))  # fmt: skip
    if not args.skip_loaded:
        busy = [loaded.engine_killed_mid_step() for _ in range(args.loaded_repeats)]
        stopped = [loaded.worker_stopped_mid_step() for _ in range(3)]
        cli = [loaded.cli_after_worker_killed() for _ in range(3)]
        rows += [
            summary("engine killed mid-step: workers exit", busy, ENGINE_KILLED_BOUND_S,
                    floor),
            summary("worker stopped mid-step: WorkerStuckError", stopped,
                    WORKER_STOPPED_BOUND_S, STUCK_AFTER_S),
            summary("worker killed mid-step: the CLI exits", cli, CLI_EXIT_BOUND_S),
        ]  # fmt: skip
    print_table([{k: v for k, v in r.items() if k != "samples_ms"} for r in rows])
    print(f"wrote {write_results('failure_latency', {'rows': rows})}")


if __name__ == "__main__":
    main()
