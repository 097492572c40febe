"""SIGHUP and the worker process (docs/protocol.md, "When the engine goes away"): with
--exit-with-parent it means the engine died, whenever it comes, and the worker leaves
with the engine's files; without, it is not the worker's business, and a live engine's
socket file stays. Real processes and sockets."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import zmq

from tests.test_executor import alive, wait_gone

ROOT = Path(__file__).resolve().parent.parent

# A worker whose start-up is slow at one point: "start" before it looks at its parent,
# "held" after it asked for the parent-death signal and before its handler exists (where
# a large import would be), where it says "asked" once it asked.
SLOW_WORKER = textwrap.dedent(
    """
    import sys, time
    from zmqworker.runtime import main

    slow_at, argv = sys.argv[1], sys.argv[2:]
    real = main.exit_with_parent

    def asked(pid):
        ok = real(pid)
        if slow_at == "held":  # the engine reads this, then dies
            print("asked", flush=True)
            time.sleep(1.0)
        return ok

    main.exit_with_parent = asked
    if slow_at == "start":
        time.sleep(1.0)
    sys.exit(main.main(argv))
    """
)

# An engine that binds its socket in a folder of its own, spawns the slow worker and is
# killed: before the worker looks at its parent, or once it asked for the signal.
ENGINE = textwrap.dedent(
    """
    import os, signal, subprocess, sys, tempfile
    import zmq

    slow_at, worker_script = sys.argv[1], sys.argv[2]
    folder = tempfile.mkdtemp(prefix="zmqworker-")
    router = zmq.Context().socket(zmq.ROUTER)
    router.bind(f"ipc://{folder}/engine.sock")
    worker = subprocess.Popen(
        [sys.executable, "-c", worker_script, slow_at, "--engine",
         f"ipc://{folder}/engine.sock", "--rank", "0", "--exit-with-parent", str(os.getpid())],
        env={**os.environ, "ZMQWORKER_TOKEN": "t"}, stdout=subprocess.PIPE, text=True,
        start_new_session=True,
    )
    print(folder, worker.pid, flush=True)
    if slow_at == "held":
        worker.stdout.readline()
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


@pytest.mark.parametrize("slow_at", ["start", "held"])
def test_an_engine_killed_early_in_start_up_leaves_nothing_behind(slow_at: str) -> None:
    engine = subprocess.Popen(
        [sys.executable, "-c", ENGINE, slow_at, SLOW_WORKER],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    folder, pid = engine.stdout.readline().split()
    engine.wait(timeout=30)
    try:
        assert wait_gone([int(pid)], 10.0), "the worker outlived its engine"
        end = time.monotonic() + 5
        while Path(folder).exists() and time.monotonic() < end:
            time.sleep(0.05)
        assert not Path(folder).exists(), f"left behind: {sorted(Path(folder).iterdir())}"
    finally:
        if alive(int(pid)):
            os.kill(int(pid), signal.SIGKILL)


# A spawner that starts the slow worker (it looks at its parent a second late) and exits
# at once: the worker, orphaned, is init's by the time it looks.
SPAWNER = textwrap.dedent(
    """
    import os, subprocess, sys

    worker_script, engine = sys.argv[1], sys.argv[2]
    worker = subprocess.Popen(
        [sys.executable, "-c", worker_script, "start", "--engine", engine, "--rank", "0",
         "--exit-with-parent", str(os.getpid())],
        env={**os.environ, "ZMQWORKER_TOKEN": "t"}, start_new_session=True,
    )
    print(worker.pid, flush=True)
    """
)


def test_a_worker_whose_parent_is_gone_leaves_a_live_engine_s_socket_alone(
    tmp_path: Path,
) -> None:
    """Its parent died before it looked, so it leaves; but the socket file it would remove
    for a killed engine has a live engine behind it (its spawner was not its engine)."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    path = tmp_path / "engine.sock"
    router.bind(f"ipc://{path}")
    try:
        spawner = subprocess.run(
            [sys.executable, "-c", SPAWNER, SLOW_WORKER, f"ipc://{path}"],
            capture_output=True, text=True, cwd=ROOT, timeout=60,
        )  # fmt: skip
        pid = int(spawner.stdout)
        assert wait_gone([pid], 30.0), "the orphaned worker stayed"
        assert path.exists(), "the live engine's socket file was removed"
        assert not router.poll(0), "the orphan said hello"
    finally:
        router.close(linger=0)
        ctx.term()


def hand_started_worker(address: str, ignore_sighup: bool) -> subprocess.Popen:
    """A worker started by hand (no --exit-with-parent), as under nohup when asked."""
    return subprocess.Popen(
        [sys.executable, "-m", "zmqworker.runtime", "--engine", address, "--rank", "0"],
        env={**os.environ, "ZMQWORKER_TOKEN": "t"},
        stderr=subprocess.DEVNULL,
        # Either way explicitly: the test run itself may have inherited SIG_IGN (nohup).
        preexec_fn=lambda: signal.signal(
            signal.SIGHUP, signal.SIG_IGN if ignore_sighup else signal.SIG_DFL
        ),
        cwd=ROOT,
    )


@pytest.mark.parametrize("ignore_sighup", [True, False], ids=["nohup", "default"])
def test_a_hand_started_worker_keeps_sighup_as_it_inherited_it(
    tmp_path: Path, ignore_sighup: bool
) -> None:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    path = tmp_path / "engine.sock"
    router.bind(f"ipc://{path}")
    worker = hand_started_worker(f"ipc://{path}", ignore_sighup)
    try:
        assert router.poll(60_000), "no Hello from the worker"  # its handlers are set
        router.recv_multipart()
        worker.send_signal(signal.SIGHUP)
        if ignore_sighup:
            with pytest.raises(subprocess.TimeoutExpired):
                worker.wait(timeout=0.5)
            worker.send_signal(signal.SIGTERM)
            assert worker.wait(timeout=10) == 0
        else:
            assert worker.wait(timeout=10) == -signal.SIGHUP
        assert path.exists(), "the live engine's socket file was removed"
    finally:
        worker.kill()
        worker.wait()
        router.close(linger=0)
        ctx.term()


def test_processes_we_spawn_leave_when_their_spawner_is_gone_before_they_look() -> None:
    """An engine core or API server whose spawner died before it asked for the parent-death
    signal ran on as an orphan (its parent was init by then). The spawner passes its pid:
    a process whose parent is another leaves at once."""
    code = (
        "import sys; from zmqworker.runtime.parent_death import follow_spawner; "
        "sys.exit(0 if follow_spawner(sys.argv) else 7)"
    )
    run = functools.partial(subprocess.run, timeout=60, capture_output=True, text=True)
    assert run([sys.executable, "-c", code, str(os.getpid())]).returncode == 0  # the parent
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert run([sys.executable, "-c", code, str(gone.pid)]).returncode == 7
    bad = run([sys.executable, "-c", code, "me"])
    assert bad.returncode == 1 and "argv[1] must be the spawner's pid" in bad.stderr
