"""The engine core as a process, and its clients: the protocol's rules at the socket (who
may speak, utility calls, a client gone), an engine core killed under its client, and a
client killed under its engine core. Nothing may be left running: no engine core, no
worker, no socket file."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import zmq

from messages import (
    PROTOCOL_VERSION,
    Decoder,
    Encoder,
    EngineCoreFailure,
    EngineCoreHello,
    EngineCoreRequest,
    RemoteError,
    SamplingParams,
)
from tests.engine_helpers import FakeExecutor, byte_level_tokenizer
from tests.test_engine_e2e import PROMPTS, make_llm
from tests.test_executor import wait_gone
from zmqworker.executor.errors import WorkerDiedError, WorkerError
from zmqworker.frontend.core_client import EngineCoreClient
from zmqworker.frontend.core_process import RemoteEngineCore, WatchedEngineCore
from zmqworker.frontend.engine_connection import ENGINE_SILENT_S, Failed
from zmqworker.frontend.errors import EngineCoreDiedError, EngineCoreError
from zmqworker.frontend.llm import LLM

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def fake_model(tmp_path_factory) -> Path:
    """A model folder for fake executors: its config and tokenizer."""
    folder = tmp_path_factory.mktemp("model")
    tok = byte_level_tokenizer()
    config = {"model_type": "llama", "vocab_size": len(tok), "max_position_embeddings": 512,
              "eos_token_id": 2, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "hidden_size": 64}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def fake_llm(fake_model):
    """An LLM over a fake executor: its engine core serves in a thread of this process."""

    def slow_tokens(seq: list[int]) -> int:
        time.sleep(0.002)  # a step takes a moment, as on a model
        return 5 + len(seq) % 50

    with LLM(
        str(fake_model),
        executor=lambda config: FakeExecutor(512, config.cache.block_size, token_fn=slow_tokens),
        block_size=4,
        max_model_len=512,
    ) as llm:
        yield llm


def second_client(llm: LLM, token: str | None = None) -> EngineCoreClient:
    """Another client of llm's engine cores, as an API server process would be."""
    launcher = llm._launcher
    assert launcher is not None
    handles = [WatchedEngineCore(i, pid) for i, pid in enumerate(llm.engine_core_pids)]
    return EngineCoreClient(launcher.addresses, handles, token or launcher.token, client_index=7)


def test_utility_calls_are_an_allowlist_with_checked_arguments(fake_llm):
    client = fake_llm.client
    with pytest.raises(EngineCoreError, match="AttributeError: 'executor' is not an engine core"):
        client.call("executor")
    with pytest.raises(ValueError, match="engine core 0: check_health: argument timeout"):
        client.call("check_health", ("soon",))
    with pytest.raises(TypeError, match="engine core 0: too many positional arguments"):
        client.call("stats", (1, 2))
    [stats] = client.call("stats")
    assert stats.num_blocks == 512 and stats.num_running == 0


def test_a_client_without_the_token_is_not_answered(fake_llm):
    stranger = second_client(fake_llm, token="0" * 32)
    try:
        with pytest.raises(TimeoutError, match=r"engine core\(s\) \[0\] not ready"):
            stranger.wait_ready(1.0)
    finally:
        stranger.close()
    assert fake_llm.generate("Hello", SamplingParams(max_tokens=2))[0].finished


def test_a_client_gone_has_its_requests_aborted_and_their_blocks_freed(fake_llm):
    before = fake_llm.stats()
    other = second_client(fake_llm)
    other.wait_ready(30)
    params = SamplingParams(max_tokens=400, ignore_eos=True)  # a second or more
    for i in range(2):
        other.add_request(EngineCoreRequest(f"other-{i}", np.array([5, 6, 7], np.int32), params))
    deadline = time.monotonic() + 30
    while fake_llm.stats().num_running < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    other.close()  # its process would have died: the connection drops
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = fake_llm.stats()
        if stats.num_running == 0 and stats.num_free_blocks == stats.num_blocks:
            break
        time.sleep(0.05)
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_blocks
    assert stats.num_aborted == before.num_aborted + 2


def test_a_token_id_outside_the_vocabulary_fails_its_request_alone(fake_llm):
    """The engine core checks a request's token ids as the workers would read them: one
    outside the vocabulary fails that request by name, not the step of every request."""
    other = second_client(fake_llm)
    vocab = len(fake_llm.tokenizer)
    bad = {
        "stop": SamplingParams(stop_token_ids=[vocab]),
        "bias": SamplingParams(logit_bias={vocab + 5: 1.0}),
        "words": SamplingParams(bad_words_token_ids=[[1, vocab]]),
        "allowed": SamplingParams(allowed_token_ids=[1, vocab + 2]),
        "many": SamplingParams(stop_token_ids=[1] * 1025),  # past a step's room for it
    }
    try:
        other.wait_ready(30)
        running = SamplingParams(max_tokens=40, ignore_eos=True)
        other.add_request(EngineCoreRequest("runs", np.array([5, 6, 7], np.int32), running))
        for name, params in bad.items():
            other.add_request(EngineCoreRequest(name, np.array([5, 6], np.int32), params))
        errors, tokens, finished = {}, 0, False
        deadline = time.monotonic() + 30
        while not finished and time.monotonic() < deadline:
            for event in other.receive(1.0):
                if isinstance(event, Failed):
                    errors.update(dict.fromkeys(event.request_ids, str(event.error)))
                    continue
                tokens += len(event.new_token_ids)
                finished |= bool(event.finished)
    finally:
        other.close()
    assert finished and tokens == 40
    assert errors["stop"].endswith(f"stop_token_ids: token id {vocab} is outside the vocabulary "
                                   f"[0, {vocab})")  # fmt: skip
    assert f"logit_bias: token id {vocab + 5} is outside" in errors["bias"]
    assert f"bad_words_token_ids: token id {vocab} is outside" in errors["words"]
    assert errors["allowed"].endswith(f"allowed_token_ids: token id {vocab + 2} is outside the "
                                      f"vocabulary [0, {vocab})")  # fmt: skip
    assert "stop_token_ids holds 1025 ids, more than 1024" in errors["many"]


def test_junk_and_strangers_at_the_socket_are_dropped(fake_llm):
    """A peer that has not said hello is not served; junk does not stop the engine (its
    socket, not its workers, is what is tested: the fake executor's engine serves)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(fake_llm._launcher.addresses[0])
    enc = Encoder()
    params = SamplingParams(max_tokens=2)
    sock.send_multipart(enc.encode(EngineCoreRequest("x", np.array([1], np.int32), params)))
    sock.send_multipart([b"\x92\x06\xc1"])  # not msgpack
    hello = EngineCoreHello(PROTOCOL_VERSION, "wrong", os.getpid())
    sock.send_multipart(enc.encode(hello))
    assert sock.poll(500) == 0  # nothing answers any of them
    sock.close()
    out = fake_llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=3))
    assert len(out[0].token_ids) == 3


def another_version(frames: list) -> list:
    """frames of this version's encoder, as the next protocol version would send them."""
    body = bytearray(frames[0])
    assert body[:2] == bytes([0x92, PROTOCOL_VERSION])  # [version, message]
    body[1] = PROTOCOL_VERSION + 1
    return [bytes(body), *frames[1:]]


def test_a_peer_of_another_release_is_told_so(fake_llm):
    """Its Hello is refused with a fatal EngineCoreFailure naming both versions (in this
    version: the peer's decoder names them as it fails), not left to wait for Ready."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(fake_llm._launcher.addresses[0])
    hello = EngineCoreHello(PROTOCOL_VERSION, fake_llm._launcher.token, os.getpid())
    sock.send_multipart(another_version(Encoder().encode(hello)))
    assert sock.poll(5000)
    refusal = Decoder().decode(sock.recv_multipart())
    sock.close()
    assert isinstance(refusal, EngineCoreFailure) and refusal.fatal
    assert f"protocol version {PROTOCOL_VERSION}, not {PROTOCOL_VERSION + 1}" in refusal.message


def test_a_client_fails_an_engine_core_of_another_release_at_once(tmp_path):
    """What such an engine core sends does not decode here: the client gives it up,
    naming both versions, rather than waiting for a Ready it cannot read."""
    address = f"ipc://{tmp_path}/core.sock"
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(address)
    client = EngineCoreClient([address], [RemoteEngineCore(0, address)], "token")
    try:
        identity, *frames = router.recv_multipart()
        assert isinstance(Decoder().decode(frames), EngineCoreHello)
        ready = EngineCoreFailure(0, [], "ProtocolError", "another release", fatal=True)
        router.send_multipart([identity, *another_version(Encoder().encode(ready))])
        started = time.monotonic()
        with pytest.raises(EngineCoreError, match=f"protocol version {PROTOCOL_VERSION + 1}"):
            client.wait_ready(30)
        assert time.monotonic() - started < 5
    finally:
        client.close()
        router.close()


def test_a_killed_engine_core_fails_the_stream_naming_it_and_leaves_nothing():
    llm = make_llm(tp=2)
    folder = Path(llm._launcher.folder)
    [core] = llm.engine_core_pids
    workers = llm.worker_pids
    params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)

    async def stream() -> int:
        seen = 0
        async for _ in llm.generate_stream(PROMPTS[0], params):
            seen += 1
            if seen == 2:
                os.kill(core, signal.SIGKILL)
        return seen

    try:
        started = time.monotonic()
        with pytest.raises(EngineCoreDiedError, match=r"engine core 0 \(pid \d+\) died .*SIGKILL"):
            asyncio.run(stream())
        assert time.monotonic() - started < 30
        with pytest.raises(EngineCoreDiedError, match="engine core 0"):  # at once
            llm.generate([PROMPTS[1]], params)
        assert wait_gone(workers, 10.0), "a worker outlived its engine core"
    finally:
        llm.shutdown()
    assert not folder.exists()


def test_a_stopped_engine_core_fails_the_stream_once_its_connection_drops():
    llm = make_llm()
    [core] = llm.engine_core_pids
    workers = llm.worker_pids
    params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    stopped: list[float] = []

    async def stream() -> None:
        async for _ in llm.generate_stream(PROMPTS[0], params):
            if not stopped:
                os.kill(core, signal.SIGSTOP)  # alive, silent: no heartbeat answers
                stopped.append(time.monotonic())

    try:
        with pytest.raises(
            EngineCoreDiedError, match=r"engine core 0 \(pid \d+\) stopped answering"
        ):
            asyncio.run(stream())
        took = time.monotonic() - stopped[0]
        assert ENGINE_SILENT_S <= took < ENGINE_SILENT_S + 5, took
    finally:
        llm.shutdown()  # SIGKILL: a stopped process leaves no other way
    assert wait_gone([core, *workers], 10.0)


def test_an_engine_core_and_its_workers_leave_when_their_client_is_killed(tmp_path):
    script = textwrap.dedent(f"""
        import json, sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from tests.test_engine_e2e import make_llm
        llm = make_llm(tp=2)
        print(json.dumps([llm.engine_core_pids, llm.worker_pids, llm._launcher.folder]))
        sys.stdout.flush()
        time.sleep(600)
    """)
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    try:
        cores, workers, folder = json.loads(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait(30)
    assert wait_gone([*cores, *workers], 15.0), "the engine core or a worker outlived its client"
    deadline = time.monotonic() + 5
    while Path(folder).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(folder).exists(), "the engine core's socket folder was left behind"


def test_an_engine_core_that_lost_a_worker_stops_the_others_before_its_client_ends_it():
    """A fatal failure means the engine core is stopping its workers: its client's
    shutdown right after gives it time to, rather than a SIGTERM that leaves the live
    worker's socket folder behind."""
    llm = make_llm(tp=2)
    workers = llm.worker_pids
    argv = psutil.Process(workers[0]).cmdline()
    folder = Path(argv[argv.index("--engine") + 1].removeprefix("ipc://")).parent
    os.kill(workers[1], signal.SIGKILL)
    try:
        with pytest.raises(EngineCoreError, match="worker rank 1 died"):
            llm.generate([PROMPTS[0]], SamplingParams(max_tokens=3))
    finally:
        llm.shutdown()
    assert wait_gone([*llm.engine_core_pids, *workers], 10.0)
    assert not folder.exists(), os.listdir(folder)


class PeerDiesInStep(FakeExecutor):
    """A step that fails on a live rank because its peer died (a collective cut short),
    before the executor's news of the death."""

    def execute_model(self, *args, **kwargs):
        self.failure = WorkerDiedError(1, -signal.SIGKILL)
        raise WorkerError("execute_model", RemoteError(0, "RuntimeError", "Connection reset", ""))


class PeerDiesAfterStep(FakeExecutor):
    """The same, the death's news a moment behind the step's error (the kernel closed
    the dead rank's sockets before its end showed)."""

    def execute_model(self, *args, **kwargs):
        died = WorkerDiedError(1, -signal.SIGKILL)
        threading.Timer(0.05, setattr, (self, "failure", died)).start()
        raise WorkerError("execute_model", RemoteError(0, "RuntimeError", "Connection reset", ""))


@pytest.mark.parametrize("executor", [PeerDiesInStep, PeerDiesAfterStep])
def test_a_step_failed_by_a_worker_s_death_is_that_death_and_fatal(fake_model, executor):
    with LLM(
        str(fake_model),
        executor=lambda config: executor(512, config.cache.block_size),
        block_size=4,
        max_model_len=512,
    ) as llm:
        with pytest.raises(EngineCoreError, match="WorkerDiedError: worker rank 1 died"):
            llm.generate([PROMPTS[0]], SamplingParams(max_tokens=3))
        with pytest.raises(EngineCoreError, match="worker rank 1 died"):  # given up: fatal
            llm.generate([PROMPTS[0]], SamplingParams(max_tokens=3))
