"""Faults and attacks on a run of real worker processes (the model-free EchoWorker): a
stopped worker, peers without the run's CURVE keys, oversize junk, inputs that must not
pass, and workers that must not outlive their engine."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
import zmq

from messages import (
    PROTOCOL_VERSION,
    CachedRequestData,
    Decoder,
    Encoder,
    Hello,
    ModelConfig,
    ProtocolError,
    RpcRequest,
    SamplingParams,
    SchedulerOutput,
    WorkerConfig,
)
from messages.step import HANDLE, NUM_SCHEDULED
from tests.engine_helpers import FakeExecutor, byte_level_tokenizer
from tests.test_executor import echo_config, wait_gone
from zmqworker.executor.errors import (
    ExecutorError,
    RpcTimeoutError,
    WorkerStuckError,
    timed_out,
)
from zmqworker.executor.handshake import STUCK_AFTER_S
from zmqworker.executor.multiproc import SHUTDOWN_GRACE_S, MultiprocExecutor
from zmqworker.frontend.errors import EngineCoreError
from zmqworker.frontend.llm import LLM
from zmqworker.model_runner.input_batch import InputBatch
from zmqworker.transport import curve
from zmqworker.transport.curve import RunKeys, make_client, make_server
from zmqworker.transport.heartbeats import HEARTBEATS

ROOT = Path(__file__).resolve().parent.parent


def test_a_stopped_worker_fails_the_step_within_the_bound_and_is_killed() -> None:
    ex = MultiprocExecutor(echo_config(tp=2), stuck_after_s=2.0)
    try:
        pending = ex.collective_rpc("sleep_for", (60.0,), non_block=True)
        time.sleep(0.2)
        stopped = time.monotonic()
        os.kill(ex.pids[1], signal.SIGSTOP)
        with pytest.raises(WorkerStuckError) as info:
            pending.result(timeout=30)
        took = time.monotonic() - stopped
        assert info.value.rank == 1 and "rank 1" in str(info.value)
        assert "no sign of life for" in str(info.value)
        assert 1.5 < took < 5.0, took
        assert wait_gone([ex.pids[1]], 5.0), "the stuck worker was not killed"
        with pytest.raises(ExecutorError):  # the run is over: at once, not at a timeout
            ex.collective_rpc("echo", (1,), timeout=30)
    finally:
        ex.shutdown()
    assert wait_gone(ex.pids, 10.0)


def test_a_worker_stopped_mid_generation_fails_it_with_worker_stuck() -> None:
    from tests.test_engine_e2e import make_llm  # the tiny Llama with its tokenizer

    def executor(config):
        return MultiprocExecutor(config, stuck_after_s=2.0)

    async def generate(llm) -> int:
        params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
        seen = 0
        async for _ in llm.generate_stream([5, 17, 42], params):
            seen += 1
            if seen == 3:  # mid-generation: the next steps reach a stopped rank
                os.kill(llm.worker_pids[1], signal.SIGSTOP)
                stopped.append(time.monotonic())
        return seen

    stopped: list[float] = []
    llm = make_llm(pp=2, executor=executor, step_timeout_s=300)
    pids = llm.worker_pids
    try:
        with pytest.raises(EngineCoreError, match="worker rank 1") as info:
            asyncio.run(generate(llm))
        took = time.monotonic() - stopped[0]
        assert info.value.exc_type == "WorkerStuckError"
        assert took < 4.0, took
    finally:
        llm.shutdown()
    assert wait_gone(pids, 10.0), "a worker outlived the run"


def test_replies_left_unread_do_not_make_a_live_worker_stuck() -> None:
    """Thousands of replies pile up while nobody receives: the engine's queue of replies
    has no bound, so libzmq keeps reading the worker and its heartbeats; a bounded queue
    stopped that reading, timed the live worker out and could abort the engine process
    (libzmq's "Assertion failed: !_io_error")."""
    ex = MultiprocExecutor(echo_config(tp=2), stuck_after_s=0.5)
    try:
        payload = "x" * 4096
        calls = [ex.collective_rpc("echo", (payload,), non_block=True) for _ in range(3000)]
        time.sleep(1.5)  # three heartbeat timeouts with nothing received
        assert all(call.result(timeout=60) == [payload, payload] for call in calls)
        assert ex.collective_rpc("echo", (1,), timeout=30) == [1, 1]
    finally:
        ex.shutdown()


def test_a_long_call_of_a_live_worker_is_no_wedge() -> None:
    ex = MultiprocExecutor(echo_config(), stuck_after_s=0.5)
    try:
        assert ex.collective_rpc("sleep_for", (2.0,), timeout=30) == [2.0]
    finally:
        ex.shutdown()


def dealer(address: str, keys=None, server_public: bytes | None = None) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        make_client(sock, keys, server_public)
    sock.connect(address)
    return sock


def test_ranks_still_running_a_call_that_timed_out_are_stopped_without_waiting(caplog) -> None:
    """A rank busy with a call that timed out (as after a fatal step timeout) would answer
    a shutdown only after that call: the executor stops it at once instead of asking and
    waiting out the grace. Its answer to that call, or to a later one (it runs them in
    order), takes it off that list (calls.OwedAnswers: test_executor.py)."""
    ex = MultiprocExecutor(echo_config(tp=2))
    try:
        with pytest.raises(RpcTimeoutError):
            ex.collective_rpc("sleep_for", (1.0,), timeout=0.2)
        assert ex.rpc.owing == [0, 1]
        assert ex.collective_rpc("echo", ("after",), timeout=30) == ["after", "after"]
        assert ex.rpc.owing == []
        with pytest.raises(RpcTimeoutError):
            ex.collective_rpc("sleep_for", (60.0,), timeout=0.2)
        assert ex.rpc.owing == [0, 1]
    finally:
        started = time.monotonic()
        ex.shutdown()
    assert time.monotonic() - started < SHUTDOWN_GRACE_S / 2
    assert "rank(s) [0, 1] never answered a call that timed out" in caplog.text
    assert wait_gone(ex.pids, 5.0)


def test_late_answers_that_came_while_nobody_listened_still_count(caplog) -> None:
    """Answers that arrived while the engine was idle are read before the shutdown decides:
    ranks that finished their call are asked politely."""
    ex = MultiprocExecutor(echo_config(tp=2))
    try:
        with pytest.raises(RpcTimeoutError):
            ex.collective_rpc("sleep_for", (0.3,), timeout=0.1)
        time.sleep(1.0)  # the late answers wait unread
        assert ex.rpc.owing == [0, 1]
    finally:
        ex.shutdown()
    assert "never answered" not in caplog.text and "polite shutdown failed" not in caplog.text
    assert ex.rpc.owing == [] and ex.rpc.late_replies == 2
    assert wait_gone(ex.pids, 5.0)


def test_on_tcp_a_peer_without_the_run_keys_cannot_even_say_hello() -> None:
    ex = MultiprocExecutor(echo_config(tp=2), transport="tcp")
    try:
        assert ex.curve
        before = ex.rpc.dropped_messages
        forged = Hello(PROTOCOL_VERSION, 0, os.getpid(), "token?")
        strangers = [dealer(ex.address), dealer(ex.address, RunKeys.new().for_workers(), b"0" * 40)]
        for sock in strangers:
            sock.send_multipart(Encoder().encode(forged), zmq.NOBLOCK)
        time.sleep(0.5)
        assert ex.collective_rpc("echo", ("still",), timeout=30) == ["still", "still"]
        assert ex.rpc.dropped_messages == before  # refused at the handshake: never read
        for sock in strangers:
            sock.close()
    finally:
        ex.shutdown()


def test_on_tcp_a_peer_that_never_says_a_word_is_cut_off(monkeypatch) -> None:
    """A peer that connects and sends nothing (no keys needed for that) holds one of the
    engine's descriptors only until the handshake interval ends, not libzmq's 30 s."""
    with zmq.Context.instance().socket(zmq.ROUTER) as sock:
        make_server(sock, *zmq.curve_keypair())
        assert sock.handshake_ivl == round(curve.HANDSHAKE_S * 1000) == 5000
    monkeypatch.setattr(curve, "HANDSHAKE_S", 2.0)
    ex = MultiprocExecutor(echo_config(), transport="tcp")
    silent: list[socket.socket] = []
    try:
        host, port = ex.address.removeprefix("tcp://").rsplit(":", 1)
        silent = [socket.create_connection((host, int(port)), timeout=10) for _ in range(3)]
        started = time.monotonic()
        for peer in silent:
            with contextlib.suppress(ConnectionResetError):
                while peer.recv(4096):  # the server's greeting, then the end
                    pass
        assert time.monotonic() - started < 5
        assert ex.collective_rpc("echo", ("still",), timeout=30) == ["still"]
    finally:
        for peer in silent:
            peer.close()
        ex.shutdown()


def rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def test_oversize_junk_to_the_engine_leaves_its_memory_alone() -> None:
    ex = MultiprocExecutor(echo_config())
    try:
        before = rss_bytes()
        junk = np.random.default_rng(0).integers(0, 255, 16 << 20, dtype=np.uint8)
        for _ in range(24):  # 384 MB if any of it were kept
            sock = dealer(ex.address)
            sock.send_multipart([junk], zmq.NOBLOCK)
            time.sleep(0.02)
            sock.close()
        assert ex.collective_rpc("echo", (1,), timeout=30) == [1]
        assert rss_bytes() - before < 100 << 20
    finally:
        ex.shutdown()


def small_model_config(tmp_path: Path) -> WorkerConfig:
    """echo_config with a small model's shape: the run's request bound (a step of new
    requests, each with a logit_bias on every token) is far below 64 MiB."""
    shape = {"vocab_size": 1000, "hidden_size": 64, "max_position_embeddings": 4096}
    (tmp_path / "config.json").write_text(json.dumps(shape))
    config = echo_config()
    return msgspec.structs.replace(config, model=ModelConfig(path=str(tmp_path)))


def test_an_oversize_request_fails_before_it_is_sent(tmp_path: Path) -> None:
    ex = MultiprocExecutor(small_model_config(tmp_path))
    try:
        big = "x" * (64 << 20)
        assert ex.rpc.max_request_bytes < len(big) // 2  # far past any request of this run
        with pytest.raises(ValueError, match="more than the .* bytes a worker of this run"):
            ex.collective_rpc("echo", (big,), timeout=5)
        assert ex.collective_rpc("echo", (1,), timeout=30) == [1]
    finally:
        ex.shutdown()


def test_a_worker_drops_an_oversize_frame_with_its_sender(tmp_path: Path) -> None:
    ex = MultiprocExecutor(small_model_config(tmp_path))
    try:
        ex.rpc.max_request_bytes = None  # past the engine's own check, as a bad engine would
        with pytest.raises(ExecutorError):
            ex.collective_rpc("echo", ("x" * (64 << 20),), timeout=5)
    finally:
        ex.shutdown()


def test_a_three_element_envelope_is_refused() -> None:
    frames = Encoder().encode(RpcRequest(1, "noop"))
    version, message = msgspec.msgpack.decode(frames[0])
    body = msgspec.msgpack.encode([version, message, "extra"])
    with pytest.raises(ProtocolError):
        Decoder().decode([body])


def batch() -> InputBatch:
    b = InputBatch(4, 64, 64, 4, 100, 20, torch.device("cpu"))
    b.num_kv_blocks = 16
    return b


@pytest.mark.parametrize(
    ("dtype", "value", "message"),
    [
        (np.int64, 2**32 + 2, "does not fit in int32"),
        (np.float64, 2.7, "must hold integers"),
    ],
)
def test_columns_that_int32_cannot_hold_are_refused_not_cut(dtype, value, message) -> None:
    columns = np.zeros((5, 1), dtype)
    columns[HANDLE], columns[NUM_SCHEDULED] = value, 1
    step = SchedulerOutput([], CachedRequestData(columns), 1)
    with pytest.raises(ValueError, match=message):
        batch().update(step)


ENGINE_SCRIPT = textwrap.dedent(
    """
    import time
    from tests.test_executor import echo_config
    from zmqworker.executor.multiproc import MultiprocExecutor
    ex = MultiprocExecutor(echo_config(pp=2))
    ex.collective_rpc("sleep_for", (60.0,), non_block=True)  # both busy when it dies
    print(*ex.pids, flush=True)
    time.sleep(600)
    """
)


def test_workers_leave_at_once_when_their_engine_is_killed() -> None:
    engine = subprocess.Popen(
        [sys.executable, "-c", ENGINE_SCRIPT], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    try:
        pids = [int(p) for p in engine.stdout.readline().split()]
        time.sleep(0.5)
        engine.kill()
        killed = time.monotonic()
        engine.wait()
        assert wait_gone(pids, 5.0), "workers outlived their engine"
        assert time.monotonic() - killed < 2.0
    finally:
        engine.kill()


# The engine's heartbeats carry no bound: as if it went silent before its first one
# reached the workers (one interval after they connect), which tells them the bound.
UNTOLD_ENGINE_SCRIPT = (
    textwrap.dedent(
        """
    from zmqworker.executor import handshake
    from zmqworker.transport.heartbeats import keep_alive
    handshake.keep_alive = lambda sock, silent_s, tell_peer: keep_alive(sock, silent_s)
    """
    )
    + ENGINE_SCRIPT
)


# Stopped right after a call: libzmq arms the TTL only at a heartbeat and disarms it at any
# other message, so the bound told does not tell the workers; their own pings do. The
# call answered, each worker has taken it in; the engine stops itself before the next
# heartbeat, as a rule (one comes every fifth of the bound).
AFTER_A_CALL_SCRIPT = textwrap.dedent(
    """
    import os, signal, time
    from tests.test_executor import echo_config
    from zmqworker.executor.multiproc import MultiprocExecutor
    ex = MultiprocExecutor(echo_config(pp=2))
    time.sleep(1.0)  # heartbeats have told the bound
    ex.collective_rpc("echo", (1,), timeout=30)
    print(*ex.pids, flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
    """
)


@pytest.mark.parametrize(
    "script",
    [ENGINE_SCRIPT, UNTOLD_ENGINE_SCRIPT, AFTER_A_CALL_SCRIPT],
    ids=["told", "untold", "after_a_call"],
)
def test_workers_leave_an_engine_that_goes_silent_within_the_stuck_bound(script: str) -> None:
    """An engine whose host is lost closes no connection. A stopped engine is as silent,
    and its workers keep their parent: only heartbeats can tell them. The engine's carry
    its stuck bound (its TTL) from the first, and the workers ping it from the start with
    that bound (ENGINE_SILENT_ENV): either way each drops its connection after the bound
    and leaves, even when the engine never told them."""
    engine = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    try:
        pids = [int(p) for p in engine.stdout.readline().split()]
        # Told: the TTL comes with the engine's first heartbeat, one interval after each
        # worker connected; three intervals let a loaded machine's I/O threads send it.
        time.sleep(3 * STUCK_AFTER_S / HEARTBEATS)
        engine.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        assert wait_gone(pids, 10.0), "workers outlived their silent engine"
        # The bound, then up to one interval for the ping that finds the engine silent.
        assert time.monotonic() - stopped < STUCK_AFTER_S * (1 + 1 / HEARTBEATS) + 1.0
    finally:
        engine.kill()
        engine.wait()


class StepGetsNoReply(FakeExecutor):
    """A step that got no reply within its bound (a rank wedged in it), and a utility
    call that got none within its own."""

    made: list[StepGetsNoReply] = []

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.made.append(self)

    def execute_model(self, *args, **kwargs):
        raise timed_out("execute_model", [0], 0.5)

    def collective_rpc(self, method, args=(), kwargs=None, timeout=None, *rest):
        raise timed_out(method, [0, 1], timeout or 0.0)


def test_a_step_without_a_reply_is_fatal_but_a_utility_call_without_one_is_not(tmp_path):
    """A step that times out means wedged workers: its requests fail saying so, with the
    ranks it waited on; the engine core stops and shuts its workers down, and what comes
    next fails at once. A utility call that times out fails alone."""
    tok = byte_level_tokenizer()
    config = {"model_type": "llama", "vocab_size": len(tok), "max_position_embeddings": 512,
              "eos_token_id": 2, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "hidden_size": 64}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    tok.save_pretrained(tmp_path)
    executor = lambda config: StepGetsNoReply(512, config.cache.block_size)  # noqa: E731
    with LLM(str(tmp_path), executor=executor, block_size=4, max_model_len=512) as llm:
        with pytest.raises(EngineCoreError, match="sleep_for timed out after 1 s"):
            llm.collective_rpc("sleep_for", (5.0,), timeout=1.0)
        with pytest.raises(EngineCoreError, match="StepTimeoutError") as info:
            llm.generate(["hello"], SamplingParams(max_tokens=3))
        text = str(info.value)
        assert "got no reply within 0.5 s" in text and "from rank(s) 0, which it waited" in text
        assert "may be stuck on any rank" in text
        start = time.monotonic()
        with pytest.raises(EngineCoreError, match="StepTimeoutError"):  # fatal: at once
            llm.generate(["hello"], SamplingParams(max_tokens=3))
        assert time.monotonic() - start < 1.0
        # The engine core shuts its executor down after it told the clients, not before.
        executor = StepGetsNoReply.made[-1]
        shut_down_by = time.monotonic() + 10
        while not executor.is_shut_down and time.monotonic() < shut_down_by:
            time.sleep(0.02)
        assert executor.is_shut_down
