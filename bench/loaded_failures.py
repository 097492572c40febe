"""Failures in the middle of real work: the embedded model at PP=2 with both stages busy
on a large batch (64 prompts of 256 tokens, chunked at 1024 tokens a step, seconds per
step on a CPU), then a process is killed or stopped. bench.failure_latency reports them.

- engine SIGKILL (the LLM's process): the time until every worker has exited, watched
  through their pidfds (its engine core leaves first, then they do); its floor is the
  same watch on a bare child that only asked for a parent-death signal.
- worker SIGSTOP: the time until generate() raises the engine core's WorkerStuckError
  (the default bound).
- worker SIGKILL under `zmqworker generate`: the time until the CLI process has exited.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from messages import SamplingParams
from zmqworker.frontend.errors import EngineCoreError

ROOT = Path(__file__).resolve().parent.parent
NUM_PROMPTS, PROMPT_LEN, CHUNK = 64, 256, 1024
BUSY_S = 1.5  # from the first step to the fault: both stages are inside a step by then
PROMPT = list(range(100, 100 + PROMPT_LEN))

ENGINE_SCRIPT = textwrap.dedent(
    f"""
    from messages import SamplingParams
    from zmqworker.frontend.llm import LLM
    llm = LLM(pipeline_parallel_size=2, max_num_batched_tokens={CHUNK})
    print(*llm.worker_pids, flush=True)
    params = SamplingParams(max_tokens=512, ignore_eos=True)
    llm.generate([{PROMPT!r}] * {NUM_PROMPTS}, params)
    """
)

BARE_CHILD_SCRIPT = textwrap.dedent(
    """
    import subprocess, sys
    child = subprocess.Popen([sys.executable, "-c", (
        "import os, signal, time\\n"
        "from zmqworker.runtime.parent_death import exit_with_parent\\n"
        "signal.signal(signal.SIGHUP, lambda *a: os._exit(0))\\n"
        "exit_with_parent(os.getppid())\\n"
        "print('armed', flush=True)\\n"
        "time.sleep(600)\\n"
    )], stdout=subprocess.PIPE, text=True)
    child.stdout.readline()
    print(child.pid, flush=True)
    import time; time.sleep(600)
    """
)


def engine_killed_mid_step() -> float:
    return kill_engine(ENGINE_SCRIPT, busy_s=BUSY_S)


def bare_child_of_killed_parent() -> float:
    return kill_engine(BARE_CHILD_SCRIPT, busy_s=0.0)


def worker_stopped_mid_step() -> float:
    """Seconds from a worker's SIGSTOP to WorkerStuckError out of generate()."""
    from zmqworker.frontend.llm import LLM

    caught: list[BaseException] = []
    with LLM(pipeline_parallel_size=2, max_num_batched_tokens=CHUNK) as llm:
        pid = llm.worker_pids[1]
        params = SamplingParams(max_tokens=512, ignore_eos=True)

        def run() -> None:
            try:
                llm.generate([PROMPT] * NUM_PROMPTS, params)
            except BaseException as e:  # the thread's outcome, read below
                caught.append(e)

        thread = threading.Thread(target=run)
        thread.start()
        time.sleep(BUSY_S)
        start = time.perf_counter()
        os.kill(pid, signal.SIGSTOP)
        thread.join(60)
        took = time.perf_counter() - start
    stuck = (
        caught
        and isinstance(caught[0], EngineCoreError)
        and caught[0].exc_type == "WorkerStuckError"
    )
    if not stuck:
        raise RuntimeError(f"generate() did not fail with WorkerStuckError: {caught}")
    return took


def cli_after_worker_killed() -> float:
    """Seconds from a worker's SIGKILL to the exit of `zmqworker generate`."""
    prompts = ["the quick brown fox " * 50] * 16
    argv = [sys.executable, "-m", "zmqworker", "generate", *prompts, "--pp", "2"]
    cli = subprocess.Popen(
        [*argv, "--max-tokens", "512"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        for line in cli.stderr:
            if line.startswith("zmqworker: ready"):
                break
        else:
            raise RuntimeError(f"the CLI ended before it was ready (exit {cli.wait()})")
        time.sleep(BUSY_S)
        [core] = _children(cli.pid)  # the engine core; the workers are its children
        workers = _children(core)
        if len(workers) != 2:
            raise RuntimeError(f"expected the engine core's 2 workers, found {workers}")
        start = time.perf_counter()
        os.kill(workers[1], signal.SIGKILL)
        status = cli.wait(60)
        took = time.perf_counter() - start
        if status == 0:
            raise RuntimeError("the CLI exited 0 after one of its workers was killed")
        return took
    finally:
        cli.kill()
        cli.wait()


def kill_engine(script: str, busy_s: float) -> float:
    """Run script (it prints its workers' pids), wait busy_s, SIGKILL it: the seconds
    until its workers have exited."""
    engine = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    try:
        pids = [int(p) for p in engine.stdout.readline().split()]
        if not pids:
            raise RuntimeError(f"the engine script failed (exit {engine.wait()})")
        fds = [os.pidfd_open(pid) for pid in pids]
        time.sleep(busy_s)
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


def _children(pid: int) -> list[int]:
    """The child processes of pid (any of its threads may have spawned them)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return sorted(found)
