"""An engine core serving two clients, in a thread over its real ROUTER, while one of them
pushes a weight update: the other's requests wait for its end and run on across it; an
update that ends short fails them, naming why, and frees their blocks."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import zmq
from engine_helpers import FakeExecutor

from messages import (
    EngineCoreConfig,
    EngineCoreRequest,
    ModelConfig,
    ModelRunnerOutput,
    SamplingParams,
    SchedulerOutput,
    SharedWeightRef,
    SharedWeights,
    WorkerCall,
    WorkerConfig,
)
from zmqworker.engine.core_main import build_core
from zmqworker.engine.core_server import EngineCoreServer
from zmqworker.frontend.core_client import EngineCoreClient
from zmqworker.frontend.core_process import WatchedEngineCore
from zmqworker.frontend.engine_connection import Failed

NUM_BLOCKS = 16
STEP_S = 0.05
CHUNK = SharedWeights(os.getpid(), 3, 1, 64, [SharedWeightRef("w", 0, 0, 1)])


class PushedExecutor(FakeExecutor):
    """Takes a pushed update's calls (its rows are not read here); a step takes STEP_S, so
    that a request is still running when the update starts."""

    world_size = 1
    call_timeout_s = 30.0

    def collective_rpc(self, method: str, args=(), kwargs=None, timeout=None) -> list:
        return [None]

    def _run(self, so: SchedulerOutput) -> ModelRunnerOutput:
        time.sleep(STEP_S)
        return super()._run(so)


@pytest.fixture
def served(tmp_path) -> Iterator[tuple[EngineCoreClient, EngineCoreClient]]:
    worker = WorkerConfig(model=ModelConfig(path="unused", max_model_len=64))
    config = EngineCoreConfig(worker=worker, address=f"ipc://{tmp_path}/core.sock", token="t" * 32)
    server = EngineCoreServer(config, zmq.Context.instance())
    make = lambda _: PushedExecutor(num_blocks=NUM_BLOCKS)  # noqa: E731
    thread = threading.Thread(target=server.serve, args=(lambda: build_core(config, make),))
    thread.start()
    engines = [WatchedEngineCore(0, os.getpid())]
    pusher, other = (EngineCoreClient([config.address], engines, config.token) for _ in range(2))
    try:
        pusher.wait_ready(30)
        other.wait_ready(30)
        yield pusher, other
    finally:
        other.call("shutdown")
        thread.join(30)
        with contextlib.suppress(zmq.ZMQError):  # closed already where a test did
            pusher.close()
        other.close()
    assert not thread.is_alive()


def push(client: EngineCoreClient, method: str, *args: object) -> None:
    client.call("collective_rpc", [WorkerCall(method, list(args))], timeout=10)


def tokens_of(
    client: EngineCoreClient, request_id: str, until: float, first: bool = False
) -> tuple[int, object]:
    """(tokens request_id got, how it ended: its finish reason, a Failed, or None) by
    until (with first: by its first token)."""
    got, ended = 0, None
    while ended is None and time.monotonic() < until and not (first and got):
        for event in client.receive(0.05):
            if isinstance(event, Failed):
                ended = event if request_id in event.request_ids else ended
            elif request_id in event.request_ids:
                i, offsets = event.request_ids.index(request_id), event.token_offsets
                got += 1 if offsets is None else int(offsets[i + 1] - offsets[i])
                ended = next((f.finish_reason for f in event.finished if f.index == i), None)
    return got, ended


def start(client: EngineCoreClient, request_id: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    client.add_request(EngineCoreRequest(request_id, np.arange(1, 9, dtype=np.int32), params))
    got, ended = tokens_of(client, request_id, time.monotonic() + 10, first=True)
    assert got >= 1 and ended is None


def test_another_client_s_request_waits_for_a_pushed_update_then_runs_on(served) -> None:
    pusher, other = served
    start(other, "r")
    push(pusher, "start_weight_update")
    push(pusher, "load_weight_chunk", CHUNK)  # its rows are coming: no step may run
    assert tokens_of(other, "r", time.monotonic() + 0.5)[1] is None  # those before the push
    got, ended = tokens_of(other, "r", time.monotonic() + 1.0)
    assert (got, ended) == (0, None)  # waits, neither stepped nor failed
    push(pusher, "finish_weight_update")
    got, ended = tokens_of(other, "r", time.monotonic() + 10)
    assert got > 0 and ended == "length"


def test_an_update_that_ends_short_fails_the_requests_and_frees_their_blocks(served) -> None:
    pusher, other = served
    start(other, "r")
    push(pusher, "start_weight_update")
    push(pusher, "load_weight_chunk", CHUNK)
    push(pusher, "abort_weight_update")  # some rows came: the weights are neither
    got, ended = tokens_of(other, "r", time.monotonic() + 10)
    assert isinstance(ended, Failed) and "no step: a weight update ended" in str(ended.error)
    [stats] = pusher.call("stats", timeout=5)
    assert (stats.num_running, stats.num_free_blocks) == (0, NUM_BLOCKS)


def test_a_push_whose_client_is_gone_ends_and_fails_the_requests(served) -> None:
    """The trainer that pushed dies mid-push: nothing will end the update, so the other
    client's requests fail naming why, rather than wait for ever."""
    pusher, other = served
    start(other, "r")
    push(pusher, "start_weight_update")
    push(pusher, "load_weight_chunk", CHUNK)
    assert tokens_of(other, "r", time.monotonic() + 0.5)[1] is None  # those before the push
    pusher.close()
    got, ended = tokens_of(other, "r", time.monotonic() + 20)
    assert isinstance(ended, Failed) and "no step: a weight update ended" in str(ended.error)
    [stats] = other.call("stats", timeout=5)
    assert (stats.num_running, stats.num_free_blocks) == (0, NUM_BLOCKS)
