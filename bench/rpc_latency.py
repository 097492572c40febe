"""Round trip of collective_rpc against the bare pyzmq floor, measured in the same run.

Cases: a no-op call on 1, 2 and 4 workers, and a realistic step (the 256-request decode
SchedulerOutput in, a 256-request ModelRunnerOutput back, no model) on 1, 2 and 4, through
MultiprocExecutor ("mp", ipc://), and both on 2 workers over tcp:// with CURVE off and
on: a CURVE-off and a CURVE-on executor live side by side and take turns with the
plain-tcp floor, so that the cost of CURVE is their p50s against each other in the same
rounds; and, where Ray is installed, the no-op on 1 and 2
workers through RayExecutor ("ray", whose data path is tcp:// on 127.0.0.1 here). The
floor is a blocking pyzmq ROUTER/DEALER ping-pong between the same number of processes
with the same payload sizes over the same transport, measured in the same run: the two
take turns in rounds, so that a burst of other work on the machine meets both. Each row
pools the calls of PAIRS fresh pairs of executor and floor: on a 2-core machine the
ratio of one pair moves by 5-10% from one fresh pair to the next (where the processes
happen to land, for as long as they live), and pooling averages that out. Also the
start-up time of a 2-rank layout of the echo worker for each executor (Ray's own start
not counted: it is given separately). Writes bench/results/rpc_latency.json.

    python -m bench.rpc_latency [--iters 3000]
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import zmq

from bench.common import p50_p99_us, print_table, time_calls, write_results
from messages import Encoder, ModelConfig, ParallelConfig, WorkerConfig
from messages.examples import (
    decode_step,
    execute_model_reply,
    execute_model_request,
    model_runner_output,
)
from zmqworker.executor.multiproc import MultiprocExecutor

ROOT = Path(__file__).resolve().parent.parent
ROUNDS = 10  # ours and the floor take turns this many times
PAIRS = 3  # fresh executor-and-floor pairs per row, their calls pooled


def echo_config(workers: int) -> WorkerConfig:
    return WorkerConfig(
        model=ModelConfig(path="unused"),
        parallel=ParallelConfig(tensor_parallel_size=workers),
        worker_cls="bench.echo_worker.EchoWorker",
        worker_extension_cls="bench.echo_worker.EchoExtension",
    )


def floor_child(address: str, reply_bytes: int) -> None:
    """A DEALER that answers every message with reply_bytes bytes."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(address)
    sock.send(b"ready")
    reply = b"r" * reply_bytes
    while (msg := sock.recv_multipart())[0] != b"stop":
        sock.send_multipart([reply] * len(msg) if len(msg) > 1 else [reply])


class Floor:
    """Bare blocking DEALER children (floor_child) behind one ROUTER: ping() sends request
    to each and waits for every answer. A context manager: the children stop at exit."""

    def __init__(
        self, workers: int, request: list[bytes], reply_bytes: int, transport: str = "ipc"
    ) -> None:
        self._folder = tempfile.TemporaryDirectory(prefix="zmqworker-floor-")
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        if transport == "ipc":
            address = f"ipc://{self._folder.name}/floor.sock"
            self._router.bind(address)
        else:
            address = f"tcp://127.0.0.1:{self._router.bind_to_random_port('tcp://127.0.0.1')}"
        self._children = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "bench.rpc_latency",
                    "--floor-child",
                    address,
                    str(reply_bytes),
                ],
                cwd=ROOT,
            )
            for _ in range(workers)
        ]
        self._idents = [self._router.recv_multipart()[0] for _ in range(workers)]
        self._request = request

    def ping(self) -> None:
        for ident in self._idents:
            self._router.send_multipart([ident, *self._request])
        for _ in self._idents:
            self._router.recv_multipart()

    def __enter__(self) -> Floor:
        return self

    def __exit__(self, *exc: object) -> None:
        for ident in self._idents:
            self._router.send_multipart([ident, b"stop"])
        for child in self._children:
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        self._router.close(linger=0)
        self._ctx.term()
        self._folder.cleanup()


def alternate(
    calls: list[Callable[[], Any]], iters: int, rounds: int = ROUNDS
) -> list[list[float]]:
    """iters timed calls of each, in rounds that take turns: a burst of someone else's
    work on this shared machine then falls on every side alike."""
    per_round = max(1, iters // rounds)
    timings = [time_calls(call, per_round) for call in calls]
    for _ in range(rounds - 1):
        for samples, call in zip(timings, calls, strict=True):
            samples += time_calls(call, per_round, warmup=10)
    return timings


NOOP = (lambda ex: partial(ex.collective_rpc, "noop"), [b"x" * 64], 64)


def run(iters: int) -> list[dict]:
    step = decode_step()
    step_request = [bytes(f) for f in Encoder().encode(execute_model_request(step))]
    step_reply_bytes = len(Encoder().encode(execute_model_reply(model_runner_output()))[0])
    cases = {
        "noop": NOOP,
        "step": (lambda ex: partial(ex.execute_model, step), step_request, step_reply_bytes),
    }
    rows = []
    env = {"PYTHONPATH": str(ROOT)}
    for workers in (1, 2, 4):
        make = partial(MultiprocExecutor, echo_config(workers), env=env)
        for case, (ours, floor_s) in pooled_pairs(make, workers, cases, "ipc", iters).items():
            rows.append(row("mp", "ipc", case, workers, p50_p99_us(ours), p50_p99_us(floor_s)))
    for case, (plain, curve, floor_s) in curve_pairs(env, cases, iters).items():
        for transport, ours in (("tcp", plain), ("tcp+curve", curve)):
            rows.append(row("mp", transport, case, 2, p50_p99_us(ours), p50_p99_us(floor_s)))
    return rows


def curve_pairs(
    env: dict[str, str], cases: dict, iters: int
) -> dict[str, tuple[list[float], list[float], list[float]]]:
    """For each case, the timings of a CURVE-off and a CURVE-on executor of 2 workers on
    tcp and of the plain-tcp floor, taking turns in the same rounds; pooled over PAIRS
    fresh sets."""
    pooled: dict[str, tuple[list[float], list[float], list[float]]] = {
        case: ([], [], []) for case in cases
    }
    for _ in range(PAIRS):
        plain = MultiprocExecutor(echo_config(2), env=env, transport="tcp", curve=False)
        try:
            curve = MultiprocExecutor(echo_config(2), env=env, transport="tcp", curve=True)
            try:
                for case, (call, payload, reply_bytes) in cases.items():
                    with Floor(2, payload, reply_bytes, "tcp") as floor:
                        timed = alternate([call(plain), call(curve), floor.ping], iters // PAIRS)
                    for samples, more in zip(pooled[case], timed, strict=True):
                        samples.extend(more)
            finally:
                curve.shutdown()
        finally:
            plain.shutdown()
    return pooled


def curve_cost_pct(rows: list[dict]) -> dict[str, float]:
    """What CURVE adds to each case on tcp: its p50 against CURVE-off's, same rounds."""
    p50 = {(r["transport"], r["case"]): r["p50_us"] for r in rows if r["executor"] == "mp"}
    cases = [case for transport, case in p50 if transport == "tcp+curve"]
    return {case: 100 * (p50["tcp+curve", case] / p50["tcp", case] - 1) for case in cases}


def pooled_pairs(
    make: Callable[[], Any], workers: int, cases: dict, transport: str, iters: int
) -> dict[str, tuple[list[float], list[float]]]:
    """For each case (name -> the call, given an executor; floor request; floor reply
    bytes), ours and the floor's timings, pooled over PAIRS fresh executors (make())
    and floors, iters calls of each in all."""
    pooled: dict[str, tuple[list[float], list[float]]] = {case: ([], []) for case in cases}
    for _ in range(PAIRS):
        ex = make()
        try:
            for case, (call, payload, reply_bytes) in cases.items():
                with Floor(workers, payload, reply_bytes, transport) as floor:
                    ours, floor_s = alternate([call(ex), floor.ping], iters // PAIRS)
                pooled[case][0].extend(ours)
                pooled[case][1].extend(floor_s)
        finally:
            ex.shutdown()
    return pooled


def row(
    executor: str,
    transport: str,
    case: str,
    workers: int,
    ours: tuple[float, float],
    floor: tuple[float, float],
) -> dict:
    return {"executor": executor, "transport": transport, "case": case, "workers": workers,
            "p50_us": ours[0], "p99_us": ours[1], "floor_p50_us": floor[0],
            "ratio": ours[0] / floor[0]}  # fmt: skip


def run_ray(iters: int) -> list[dict]:
    """The no-op on 1 and 2 Ray actors (a local Ray, started by the caller)."""
    from zmqworker.executor.ray_executor import RayExecutor

    rows = []
    for workers in (1, 2):
        make = partial(RayExecutor, echo_config(workers))
        ours, floor_s = pooled_pairs(make, workers, {"noop": NOOP}, "tcp", iters)["noop"]
        rows.append(row("ray", "tcp", "noop", workers, p50_p99_us(ours), p50_p99_us(floor_s)))
    return rows


def startup_seconds(make) -> float:
    """How long make() takes to return a ready executor of 2 echo ranks."""
    start = time.perf_counter()
    ex = make(echo_config(2))
    elapsed = time.perf_counter() - start
    ex.shutdown()
    return elapsed


def start_local_ray() -> float:
    """Start a local Ray sized for these cases; the seconds it took."""
    import ray

    start = time.perf_counter()
    ray.init(
        address="local",
        num_cpus=max(2, os.cpu_count() or 1),
        include_dashboard=False,
        object_store_memory=100 << 20,
        logging_level=logging.WARNING,
    )
    return time.perf_counter() - start


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--floor-child":
        floor_child(sys.argv[2], int(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=3000)
    args = parser.parse_args()
    os.environ["PYTHONPATH"] = str(ROOT)
    rows = run(args.iters)
    startup = {"mp": startup_seconds(MultiprocExecutor)}
    results: dict = {"rows": rows, "startup_s": startup, "curve_cost_pct": curve_cost_pct(rows)}
    if importlib.util.find_spec("ray") is None:
        print("Ray is not installed (pip install 'zmqworker[ray]'): no Ray rows")
    else:
        import ray

        from zmqworker.executor.ray_executor import RayExecutor

        results["ray_init_s"] = start_local_ray()
        try:
            startup["ray"] = startup_seconds(RayExecutor)
            rows += run_ray(args.iters)
        finally:
            ray.shutdown()
    print_table(rows)
    cost = results["curve_cost_pct"]
    print("CURVE on tcp costs " + ", ".join(f"{k} {v:+.1f}%" for k, v in cost.items()))
    print(
        "start-up of 2 ranks (s): "
        + ", ".join(f"{k} {v:.2f}" for k, v in startup.items())
        + (f"; ray.init {results['ray_init_s']:.2f}" if "ray_init_s" in results else "")
    )
    path = write_results("rpc_latency", results)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
