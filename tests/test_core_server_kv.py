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
    AbortRequests,
    EngineCoreConfig,
    EngineCoreRequest,
    KVConnectorOutput,
    KVTransferConfig,
    KVTransferParams,
    ModelConfig,
    ModelRunnerOutput,
    SamplingParams,
    SchedulerOutput,
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


class ReportingExecutor(OneRankExecutor):
    """Its worker lets a withdrawn staging go at once (no puller reads it)."""

    def _run(self, so: SchedulerOutput) -> ModelRunnerOutput:
        output = super()._run(so)
        orders = so.kv_connector_metadata
        if orders is not None and orders.cancel_saves:
            output.kv_connector_output = KVConnectorOutput(finished_sending=orders.cancel_saves)
        return output


def test_a_finished_prefill_s_kv_is_withdrawn_by_its_own_client_s_abort(tmp_path) -> None:
    """A router whose caller gave up before the decode instance pulled the KV aborts the
    request on the prefill instance too: its staged KV is withdrawn and its blocks go,
    rather than at the KV timeout. Another client's abort of that id goes unheeded."""
    worker = WorkerConfig(
        model=ModelConfig(path="unused", max_model_len=64),
        kv_transfer=KVTransferConfig(role="producer"),
    )
    config = EngineCoreConfig(worker=worker, address=f"ipc://{tmp_path}/core.sock", token="t" * 32)
    server = EngineCoreServer(config, zmq.Context.instance())
    thread = threading.Thread(
        target=server.serve,
        args=(lambda: build_core(config, lambda _: ReportingExecutor(num_blocks=16)),),
    )
    thread.start()
    engines = [WatchedEngineCore(0, os.getpid())]
    owner, other = (EngineCoreClient([config.address], engines, config.token) for _ in range(2))

    def free_blocks() -> int:
        [stats] = owner.call("stats", timeout=5)
        return stats.num_free_blocks

    try:
        owner.wait_ready(30)
        other.wait_ready(30)
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        owner.add_request(
            EngineCoreRequest("first", np.arange(1, 11, dtype=np.int32), params,
                              kv_transfer_params=KVTransferParams(do_remote_decode=True))
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while (total := free_blocks()) and total == 16 and time.monotonic() < deadline:
            owner.receive(0.1)
        held = free_blocks()
        assert held == 13  # its 10 tokens' blocks of 4, staged for a pull
        # As the router sends it (the request ended here, so abort() would send nothing).
        other._send(other.engines[0], AbortRequests(["first"]))
        time.sleep(0.5)
        assert free_blocks() == held
        owner._send(owner.engines[0], AbortRequests(["first"]))
        while free_blocks() < 16 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert free_blocks() == 16
    finally:
        owner.call("shutdown")
        thread.join(30)
        owner.close()
        other.close()
    assert not thread.is_alive()
