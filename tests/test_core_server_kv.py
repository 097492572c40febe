"""An engine core serving as a prefill instance, in a thread over its real ROUTER: it keeps
reading its clients while a finished prefill's KV waits to be taken."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import zmq
from engine_helpers import FakeExecutor

from messages import (
    EngineCoreConfig,
    EngineCoreRequest,
    KVTransferConfig,
    KVTransferParams,
    ModelConfig,
    SamplingParams,
    WorkerConfig,
)
from zmqworker.engine.core_main import build_core
from zmqworker.engine.core_server import EngineCoreServer
from zmqworker.frontend.core_client import EngineCoreClient
from zmqworker.frontend.core_process import WatchedEngineCore


class OneRankExecutor(FakeExecutor):
    world_size = 1  # its workers never report a staged KV taken: the transfer stays open


def test_a_prefill_instance_answers_calls_while_its_staged_kv_waits(tmp_path) -> None:
    """With async scheduling, steps in flight and a transfer under way, the loop that takes
    back the steps of finished requests stops for the transfer: a call is answered, and so
    is the next request, while the first one's KV is still staged."""
    worker = WorkerConfig(
        model=ModelConfig(path="unused", max_model_len=64),
        kv_transfer=KVTransferConfig(role="producer"),
    )
    config = EngineCoreConfig(
        worker=worker, address=f"ipc://{tmp_path}/core.sock", token="t" * 32,
        async_scheduling=True,
    )  # fmt: skip
    server = EngineCoreServer(config, zmq.Context.instance())
    thread = threading.Thread(
        target=server.serve,
        args=(lambda: build_core(config, lambda _: OneRankExecutor(num_blocks=16)),),
    )
    thread.start()
    client = EngineCoreClient([config.address], [WatchedEngineCore(0, os.getpid())], config.token)
    try:
        client.wait_ready(30)
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        prompt = np.arange(1, 11, dtype=np.int32)
        for request_id in ("first", "second"):
            client.add_request(
                EngineCoreRequest(request_id, prompt, params,
                                  kv_transfer_params=KVTransferParams(do_remote_decode=True))
            )  # fmt: skip
            finished = None
            deadline = time.monotonic() + 10
            while finished is None and time.monotonic() < deadline:
                for event in client.receive(0.5):
                    finished = next(
                        (f for f in getattr(event, "finished", None) or [] if f.kv_transfer), None
                    )
            assert finished is not None, f"{request_id} did not finish within 10 s"
            assert finished.kv_transfer.req_id  # its KV is staged, not taken
            [stats] = client.call("stats", timeout=5)
            assert stats is not None
    finally:
        client.call("shutdown")
        thread.join(30)
        client.close()
    assert not thread.is_alive()
