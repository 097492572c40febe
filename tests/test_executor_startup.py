"""MultiprocExecutor start-up that fails before any worker is spawned: a config its
bounds cannot follow from is refused before anything is made, and a failure part-way (a
socket that cannot bind) leaves no folder, ZAP thread or zmq context behind."""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path
from unittest import mock

import msgspec
import pytest
import zmq

from messages import CacheConfig, SchedulerConfig
from tests.test_executor import echo_config
from zmqworker.executor import multiproc
from zmqworker.executor.multiproc import MultiprocExecutor


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


def test_a_failure_after_the_zap_thread_started_stops_it(folder: Path) -> None:
    before, python_threads = threads(), threading.active_count()
    failing = mock.patch.object(multiproc, "bind_router", side_effect=OSError("no port"))
    with failing, pytest.raises(OSError, match="no port"):
        MultiprocExecutor(echo_config(), transport="tcp")
    assert list(folder.iterdir()) == []
    assert threading.active_count() <= python_threads, "the ZAP thread is still running"
    assert threads() <= before
