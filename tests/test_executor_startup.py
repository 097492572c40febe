"""MultiprocExecutor start-up that fails before any worker is spawned: a config its
bounds cannot follow from is refused before anything is made, and a failure part-way (a
socket that cannot bind) leaves no folder, ZAP thread or zmq context behind. And the
handshake's bounds: a rank stopped before its Hello, a worker's wait for its Welcome."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from unittest import mock

import msgspec
import pytest
import zmq

from messages import CacheConfig, SchedulerConfig
from tests.test_executor import _children, echo_config
from zmqworker.executor import multiproc
from zmqworker.executor.errors import WorkerStartupError
from zmqworker.executor.handshake import WELCOME_MARGIN_S
from zmqworker.executor.multiproc import MultiprocExecutor
from zmqworker.transport.spawn_env import WELCOME_TIMEOUT_ENV


def threads() -> int:
    """This process's threads, libzmq's I/O threads included."""
    return len(os.listdir("/proc/self/task"))


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where the executor makes its private folder: a path so long that an ipc socket in
    it cannot bind (over the 107 bytes of a unix socket's name)."""
    base = tmp_path / ("x" * 100)
    base.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(base))
    return base


@pytest.mark.parametrize(
    ("section", "value", "field"),
    [
        ("cache", CacheConfig(block_size=0), "cache.block_size"),
        ("scheduler", SchedulerConfig(max_num_seqs=0), "scheduler.max_num_seqs"),
    ],
)
def test_a_size_below_one_is_refused_before_anything_is_made(
    folder: Path, section: str, value: object, field: str
) -> None:
    config = msgspec.structs.replace(echo_config(), **{section: value})
    before = threads()
    with pytest.raises(ValueError, match=f"WorkerConfig {field} must be at least 1, got 0"):
        MultiprocExecutor(config, transport="tcp")
    assert list(folder.iterdir()) == []
    assert threads() <= before


def test_an_ipc_socket_that_cannot_bind_leaves_nothing_behind(folder: Path) -> None:
    before = threads()
    with pytest.raises(zmq.ZMQError, match="longer than"):
        MultiprocExecutor(echo_config(), transport="ipc")
    assert list(folder.iterdir()) == []
    assert threads() <= before


def test_a_fast_exit_before_the_workers_start_leaves_no_folder(tmp_path: Path) -> None:
    """An engine core told to leave at once (SIGTERM: fast_exit) after its executor bound
    its socket, before the workers that would remove it started: nothing is left."""
    script = (
        "import sys, tempfile\n"
        "tempfile.tempdir = sys.argv[1]\n"
        "from tests.test_executor import echo_config\n"
        "from zmqworker.executor import multiproc\n"
        "from zmqworker.runtime.fast_exit import fast_exit\n"
        "multiproc.spawn_all = lambda *args: fast_exit([], 3)\n"
        "multiproc.MultiprocExecutor(echo_config())\n"
    )
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=root, timeout=120)
    assert done.returncode == 3
    assert list(tmp_path.iterdir()) == []


def test_a_failure_after_the_zap_thread_started_stops_it(folder: Path) -> None:
    before, python_threads = threads(), threading.active_count()
    failing = mock.patch.object(multiproc, "bind_router", side_effect=OSError("no port"))
    with failing, pytest.raises(OSError, match="no port"):
        MultiprocExecutor(echo_config(), transport="tcp")
    assert list(folder.iterdir()) == []
    assert threading.active_count() <= python_threads, "the ZAP thread is still running"
    assert threads() <= before


# A rank that stops itself (SIGSTOP) as its process starts, before its Hello: what a
# debugger or an operator's kill -STOP leaves.
STOP_AT_START = """
import os, signal, sys
if "--rank" in sys.argv and sys.argv[sys.argv.index("--rank") + 1] == os.environ["STOP_RANK"]:
    os.kill(os.getpid(), signal.SIGSTOP)
"""


@pytest.mark.parametrize(("tp", "rank"), [(1, 0), (2, 1)])
def test_a_rank_stopped_before_its_hello_fails_start_up_naming_it(
    tmp_path: Path, tp: int, rank: int
) -> None:
    """Not the start-up bound (nor, with tp=2, a healthy rank's Welcome wait) but the
    stuck bound: the stopped rank is named and killed, the others stopped."""
    (tmp_path / "sitecustomize.py").write_text(STOP_AT_START)
    path = os.pathsep.join([str(tmp_path), os.environ["PYTHONPATH"]])
    before = set(_children())
    start = time.monotonic()
    with pytest.raises(WorkerStartupError, match=f"worker rank {rank} is stopped") as info:
        MultiprocExecutor(
            echo_config(tp=tp),
            start_timeout=20,
            stuck_after_s=1.0,
            env={"PYTHONPATH": path, "STOP_RANK": str(rank)},
        )
    assert time.monotonic() - start < 6.0, "waited for the start-up bound"
    assert "while the engine waited for every Hello" in str(info.value)
    assert not set(_children()) - before, "a worker was left behind"


def test_a_worker_waits_for_its_welcome_as_long_as_its_engine_waits_for_hellos() -> None:
    """Welcomes go out once every rank said hello: a rank that did waits out the start-up
    bound (and a margin), so that the engine's error names the rank it did not hear from
    rather than a healthy rank that gave up first."""
    ex = MultiprocExecutor(echo_config(), start_timeout=123.0)
    try:
        with open(f"/proc/{ex.pids[0]}/environ", "rb") as f:
            env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        welcome_s = float(env[WELCOME_TIMEOUT_ENV.encode()])
        assert welcome_s == 123.0 + WELCOME_MARGIN_S and WELCOME_MARGIN_S > 0
    finally:
        ex.shutdown()
