"""A step's KV orders at a worker, in process: cancels stand even when the worker refuses
the step they came with, and orders of a kind the worker's connector does not serve are
refused before anything of the step is done."""

from __future__ import annotations

import time

import numpy as np
import pytest

from messages import CachedRequestData, SchedulerOutput
from messages.kv_transfer import (
    KVConnectorMetadata,
    KVLoad,
    KVSave,
    KVTransferConfig,
    RemoteKV,
)
from tests.test_worker import config, free_port, generate, started
from zmqworker.transport.curve import KV_CURVE_ENV, KVKeys


@pytest.fixture
def producer(monkeypatch):
    monkeypatch.setenv(KV_CURVE_ENV, KVKeys.new().to_env())
    transfer = KVTransferConfig(role="producer", port=free_port(), timeout_s=30.0)
    w = started(config(kv_transfer=transfer))
    yield w
    w.shutdown()


def orders_step(orders: KVConnectorMetadata, handles: list[int]) -> SchedulerOutput:
    cached = CachedRequestData.build(handles, [7] * len(handles), [1] * len(handles))
    return SchedulerOutput([], cached, len(handles), kv_connector_metadata=orders)


def test_a_refused_step_s_cancels_still_stand(producer):
    """The engine gives up on a staged save (cancel_saves) in a step the worker refuses
    (an unknown handle): the save is withdrawn all the same, reported sent at once,
    rather than kept until its expiry with its blocks promised to no one."""
    save = KVSave("staged", np.array([3], np.int32), 2)
    producer.kv_connector.after_step(KVConnectorMetadata(saves=[save]))
    assert producer.kv_connector.num_cache_readers == 1
    refused = orders_step(KVConnectorMetadata(cancel_saves=["staged"]), [99])
    with pytest.raises(ValueError, match="handle 99"):
        producer.execute_model(refused)
    deadline = time.monotonic() + 10
    sent: list[str] = []
    while sent != ["staged"]:
        assert time.monotonic() < deadline, "the withdrawn save was never reported"
        out = producer.kv_connector.take_output(wait_s=0.05)
        sent += out.finished_sending if out is not None else []
    assert producer.kv_connector.num_cache_readers == 0
    assert generate(producer, 1) == generate(producer, 2)  # the worker goes on


def test_orders_the_connector_does_not_serve_are_refused(producer):
    remote = RemoteKV("r", 3, ["tcp://127.0.0.1:1"])
    load = KVLoad("r", np.array([1], np.int32), remote)
    with pytest.raises(
        ValueError,
        match=r"^KV orders this worker's connector does not serve: loads "
        r"\(it serves cancel_saves, saves\)$",
    ):
        producer.execute_model(orders_step(KVConnectorMetadata(loads=[load]), []))
    generate(producer, 1)


def test_kv_orders_for_a_worker_without_a_connector_are_refused():
    w = started()
    try:
        cancels = KVConnectorMetadata(cancel_loads=["r"])
        with pytest.raises(ValueError, match="without KV transfer or a host tier: cancel_loads"):
            w.execute_model(orders_step(cancels, []))
        w.execute_model(orders_step(KVConnectorMetadata(), []))  # no orders: taken
    finally:
        w.shutdown()
