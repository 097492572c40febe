"""How soon failures are noticed, against the bounds issue 5 sets (measured, not tested).

- worker killed: two echo workers each run a 30 s step (three calls in flight); rank 1
  is SIGKILLed; the time until every pending call has failed with WorkerDiedError, and
  then the time a new call takes to fail. Bound: 1 s.
- engine killed: an engine process with two echo workers is SIGKILLed; the time until
  both workers have exited by themselves, watched through their pidfds. Bound: 2 s.

Each is repeated; the table gives the median and the worst, and the worst as a fraction
of its bound (percent). Writes bench/results/failure_latency.json.

    python -m bench.failure_latency [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from bench.common import print_table, write_results
from bench.rpc_latency import echo_config
from zmqworker.executor.errors import WorkerDiedError
from zmqworker.executor.multiproc import MultiprocExecutor

ROOT = Path(__file__).resolve().parent.parent
WORKER_KILLED_BOUND_S = 1.0
ENGINE_KILLED_BOUND_S = 2.0

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
    engine = subprocess.Popen(
        [sys.executable, "-c", ENGINE_SCRIPT],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        pids = [int(p) for p in engine.stdout.readline().split()]
        fds = [os.pidfd_open(pid) for pid in pids]
        try:
            return _until_gone(engine, fds, pids)
        finally:
            for fd in fds:
                os.close(fd)
    finally:
        engine.kill()
        engine.wait()


def _until_gone(engine: subprocess.Popen, fds: list[int], pids: list[int]) -> float:
    """Kill the engine; the seconds until every pidfd in fds says its process exited."""
    watch = select.poll()
    for fd in fds:
        watch.register(fd, select.POLLIN)
    start = time.perf_counter()
    engine.kill()
    engine.wait()
    gone: set[int] = set()
    while len(gone) < len(fds):
        left_ms = 30_000 - (time.perf_counter() - start) * 1000
        if left_ms <= 0:
            raise RuntimeError(f"workers {pids} outlived their engine by 30 s")
        for fd, _ in watch.poll(left_ms):
            gone.add(fd)
            watch.unregister(fd)
    return time.perf_counter() - start


def summary(case: str, samples_s: list[float], bound_s: float) -> dict:
    worst = max(samples_s)
    return {
        "case": case,
        "median_ms": statistics.median(samples_s) * 1000,
        "worst_ms": worst * 1000,
        "bound_ms": bound_s * 1000,
        "worst_pct_of_bound": 100 * worst / bound_s,
        "samples_ms": [round(s * 1000, 2) for s in samples_s],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    os.environ["PYTHONPATH"] = str(ROOT)
    killed = [worker_killed() for _ in range(args.repeats)]
    engine = [engine_killed() for _ in range(args.repeats)]
    rows = [
        summary("worker killed: pending calls fail", [p for p, _ in killed],
                WORKER_KILLED_BOUND_S),
        summary("worker killed: a later call fails", [c for _, c in killed],
                WORKER_KILLED_BOUND_S),
        summary("engine killed: workers exit", engine, ENGINE_KILLED_BOUND_S),
    ]  # fmt: skip
    print_table([{k: v for k, v in r.items() if k != "samples_ms"} for r in rows])
    print(f"wrote {write_results('failure_latency', {'rows': rows})}")


if __name__ == "__main__":
    main()
