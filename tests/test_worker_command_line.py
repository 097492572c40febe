"""`zmqworker worker` refuses a bad command line or environment with status 2 and one
line that names the problem, before it connects (docs/protocol.md, "The worker
process"): never a traceback, never a handshake that fails unexplained."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zmqworker.transport.curve import CURVE_ENV, KVKeys, RunKeys, WorkerKeys

KEYS = RunKeys.new()
GOOD = KEYS.for_workers()


def worker(engine: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "zmqworker.runtime", "--engine", engine, "--rank", "0"],
        capture_output=True,
        text=True,
        env={**os.environ, "ZMQWORKER_TOKEN": "t", **env},
        timeout=timeout,
    )


@pytest.mark.parametrize(
    ("engine", "message"),
    [
        (
            "tcp://127.0.0.1",
            "--engine must be ipc://PATH or tcp://HOST:PORT, got 'tcp://127.0.0.1'",
        ),
        ("tcp://127.0.0.1:http", "--engine must be ipc://PATH or tcp://HOST:PORT"),
        ("tcp://:5555", "--engine must be ipc://PATH or tcp://HOST:PORT"),
        ("localhost:5555", "--engine must be ipc://PATH or tcp://HOST:PORT"),
        ("ipc://", "--engine must be ipc://PATH or tcp://HOST:PORT"),
        ("ipc://{tmp}/no-such-folder/engine.sock", "No such file or directory"),
        ("tcp://no-such-host.invalid:5555", "--engine tcp://no-such-host.invalid:5555: "),
    ],
)
def test_an_engine_address_it_cannot_use(tmp_path: Path, engine: str, message: str) -> None:
    out = worker(engine.format(tmp=tmp_path))
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("zmqworker worker: error: ") and message in out.stderr
    assert "Traceback" not in out.stderr


def keys_env(engine_public: bytes, public: bytes, secret: bytes) -> str:
    return WorkerKeys(engine_public, public, secret).to_env()


def test_a_log_level_logging_does_not_know_is_a_command_line_error() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "zmqworker.runtime", "--engine", "ipc:///nowhere/e.sock",
         "--rank", "0", "--log-level", "bogus"],
        capture_output=True, text=True, env={**os.environ, "ZMQWORKER_TOKEN": "t"}, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2 and "--log-level: invalid choice: 'BOGUS'" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (keys_env(b"~" * 40, GOOD.public, GOOD.secret), "the engine's public key is not z85"),
        (keys_env(GOOD.engine_public, GOOD.public, b" " * 40), "the secret key is not z85"),
        (
            keys_env(GOOD.engine_public, KEYS.engine_public, GOOD.secret),
            "the public key is not the secret key's",
        ),
    ],
)
def test_curve_keys_that_could_never_connect(value: str, message: str) -> None:
    out = worker("tcp://127.0.0.1:9", **{CURVE_ENV: value})
    assert out.returncode == 2, out.stderr
    assert out.stderr == f"zmqworker worker: error: ${CURVE_ENV}: {message}\n"


def test_a_shared_pair_is_checked_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    pair = KVKeys.new()
    monkeypatch.setenv(KVKeys.ENV, f"{pair.public.decode()},{KVKeys.new().secret.decode()}")
    with pytest.raises(ValueError, match="the public key is not the secret key's"):
        KVKeys.from_env()
    monkeypatch.setenv(KVKeys.ENV, pair.to_env())
    assert KVKeys.from_env() == pair


def test_a_worker_server_that_fails_to_start_closes_what_it_opened(tmp_path):
    """In process (a Ray actor's case, whose process lives on): an engine address that
    cannot be connected to, found after the pipeline's socket is bound, leaves no socket,
    file, reader or thread behind."""
    import asyncio
    import threading

    import zmq

    from zmqworker.runtime.worker_process import WorkerServer

    loop = asyncio.new_event_loop()
    # The process's context, kept, starts its I/O thread and reaper with a first socket.
    zmq.Context.instance().socket(zmq.PAIR).close()
    try:
        fds, threads = len(os.listdir("/proc/self/fd")), threading.active_count()
        data = tmp_path / "data.sock"
        with pytest.raises(zmq.ZMQError):
            WorkerServer(loop, "tcp://", 0, "token", data_bind=f"ipc://{data}")
        assert not data.exists()
        assert threading.active_count() == threads
        deadline = time.monotonic() + 5  # libzmq's reaper closes a socket's descriptors
        while len(os.listdir("/proc/self/fd")) > fds:
            assert time.monotonic() < deadline, "descriptors left open"
            time.sleep(0.01)
    finally:
        loop.close()


def exited_pid() -> str:
    """The pid of a process that has exited (reaped): never this test's worker's parent."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    return str(gone.pid)


@pytest.mark.parametrize(
    ("pid", "message"),
    [
        ("-5", "--exit-with-parent takes a pid, got -5"),
        ("1", "--exit-with-parent 1: that process is not this worker's parent"),
        (
            "{exited}",
            "--exit-with-parent {exited}: that process is not this worker's parent (it has exited)",
        ),
    ],
)
def test_an_exit_with_parent_pid_that_is_not_the_parent(
    tmp_path: Path, pid: str, message: str
) -> None:
    """A process that is not its parent, live or exited, is a mistake, not a dead engine
    (whose worker init adopted): the worker leaves the engine's socket file alone."""
    exited = exited_pid()
    pid, message = pid.format(exited=exited), message.format(exited=exited)
    engine = tmp_path / "engine.sock"
    engine.touch()
    out = subprocess.run(
        [sys.executable, "-m", "zmqworker.runtime", "--engine", f"ipc://{engine}", "--rank", "0"]
        + ["--exit-with-parent", pid],
        capture_output=True,
        text=True,
        env={**os.environ, "ZMQWORKER_TOKEN": "t"},
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr == f"zmqworker worker: error: {message}\n"
    assert engine.exists()


@pytest.mark.parametrize(
    ("value", "returncode", "message"),
    [
        ("1", 3, "no Welcome from ipc://{engine} within 1 s"),
        ("0", 2, "$ZMQWORKER_WELCOME_TIMEOUT_S must be seconds > 0, got '0'"),
        ("soon", 2, "$ZMQWORKER_WELCOME_TIMEOUT_S must be seconds > 0, got 'soon'"),
    ],
)
def test_the_welcome_wait_is_the_engine_s_to_set(
    tmp_path: Path, value: str, returncode: int, message: str
) -> None:
    """An engine that waits longer than 60 s for every Hello tells its workers to wait as
    long for their Welcome ($ZMQWORKER_WELCOME_TIMEOUT_S)."""
    import zmq

    engine = tmp_path / "engine.sock"
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.bind(f"ipc://{engine}")
    try:
        out = worker(f"ipc://{engine}", timeout=30, ZMQWORKER_WELCOME_TIMEOUT_S=value)
    finally:
        router.close(linger=0)
    assert out.returncode == returncode, out.stderr
    assert message.format(engine=engine) in out.stderr


@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan", "later", "3e6"])
def test_an_engine_silence_that_is_not_seconds_is_refused(tmp_path: Path, value: str) -> None:
    """Past 2,147,483 s the bound would overflow libzmq's millisecond options."""
    out = worker(f"ipc://{tmp_path}/engine.sock", ZMQWORKER_ENGINE_SILENT_S=value)
    assert out.returncode == 2, out.stderr
    message = f"$ZMQWORKER_ENGINE_SILENT_S must be seconds > 0, at most 2,147,483, got {value!r}"
    assert message in out.stderr
