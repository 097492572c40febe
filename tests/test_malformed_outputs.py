"""A message from an engine core that does not decode, at a real client socket: the
engine core is forged (a ROUTER in this process, with this process standing in for its
pid), so it can send what a real one never would. Its ids cannot be trusted, so every
request and call pending on that engine core fails at once, naming it and what was
wrong, and is aborted there; the engine core is not given up."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import zmq

from messages import (
    AbortRequests,
    Decoder,
    Encoder,
    EngineCoreHello,
    EngineCoreReady,
    EngineCoreRequest,
    SamplingParams,
)
from tests.test_client_outputs import outputs_bytes
from zmqworker.frontend.core_client import EngineCoreClient
from zmqworker.frontend.core_process import WatchedEngineCore
from zmqworker.frontend.engine_connection import Failed
from zmqworker.frontend.errors import EngineCoreError

TOKEN = "t" * 32


class ForgedEngineCore:
    """A ROUTER the client connects to as to engine core 0."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(address)
        self.enc, self.dec = Encoder(), Decoder()
        self.peer = b""

    def recv(self, timeout_s: float = 5.0):
        assert self.router.poll(round(timeout_s * 1000)), "nothing came from the client"
        self.peer, *frames = self.router.recv_multipart()
        return self.dec.decode(frames)

    def send(self, frames: list) -> None:
        self.router.send_multipart([self.peer, *frames])

    def close(self) -> None:
        self.router.close(linger=0)
        self.ctx.term()


@pytest.fixture
def forged(tmp_path):
    address = f"ipc://{tmp_path}/engine-core-0"
    engine = ForgedEngineCore(address)
    handle = WatchedEngineCore(0, os.getpid())  # alive as long as the test
    client = EngineCoreClient([address], [handle], TOKEN)
    try:
        assert isinstance(engine.recv(), EngineCoreHello)
        ready = EngineCoreReady(0, 64, 32, 4, 8, None, 1, os.getpid())
        engine.send(engine.enc.encode(ready))
        client.wait_ready(5)
        yield engine, client
    finally:
        client.close()
        handle.close()
        engine.close()


def test_a_malformed_output_fails_the_pending_requests_naming_the_engine_core(forged):
    engine, client = forged
    params = SamplingParams(max_tokens=4)
    for request_id in ("a", "b"):
        client.add_request(EngineCoreRequest(request_id, np.array([5, 6], np.int32), params))
        assert isinstance(engine.recv(), EngineCoreRequest)
    call = client.submit("stats")
    assert engine.recv().method == "stats"
    before = client.drops.total

    engine.send(outputs_bytes(new_token_ids=np.array([5], np.int32)))  # 1 token for 2 ids
    start = time.monotonic()
    [event] = client.receive(5)
    assert time.monotonic() - start < 1.0
    assert isinstance(event, Failed) and not event.fatal
    assert event.engine_index == 0 and event.request_ids == ["a", "b"]
    assert isinstance(event.error, EngineCoreError)
    assert str(event.error).startswith("engine core 0: ProtocolError: a malformed message")
    assert "1 new_token_ids for 2 request_ids" in str(event.error)
    assert client.drops.total == before + 1
    with pytest.raises(EngineCoreError, match="engine core 0: .*malformed"):
        client.wait(call)

    abort = engine.recv()  # nothing left running there
    assert isinstance(abort, AbortRequests) and abort.request_ids == ["a", "b"]
    assert client.engine_of("a") is None and client.engine_of("b") is None
    assert client.engines[0].dead is None and client.engines[0].requests == set()

    # The engine core goes on: the next request is sent to it as before.
    assert client.add_request(EngineCoreRequest("c", np.array([7], np.int32), params)) == 0
    assert engine.recv().request_id == "c"


def test_a_malformed_message_with_nothing_pending_fails_nothing(forged):
    engine, client = forged
    engine.send([b"\x92\x06\xc1"])  # not msgpack
    assert client.receive(0.5) == []
    assert client.drops.total == 1
