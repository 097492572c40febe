"""A decode rank's pulls from prefill addresses that are wrong or gone, over real
sockets: each such load fails alone, by name, and the puller goes on serving the
others. A malformed address, or none, is refused as the load is taken in; one the
puller cannot connect or send to fails that pull (its socket closed); a peer that takes
nothing never blocks the puller's thread; and the sockets of addresses no pull waits on
close once idle, no more than MAX_PEERS of them open at once."""

from __future__ import annotations

import time

import numpy as np
import pytest

from messages.kv_transfer import KVConnectorMetadata, KVLoad, KVSave, RemoteKV
from tests.test_kv_connector import caches, connector, free_port, names, until
from zmqworker.kv_transfer import peer_sockets
from zmqworker.kv_transfer.head_map import head_map
from zmqworker.kv_transfer.zmq_connector import ZmqKVConnector

ONE = np.array([1], np.int32)
pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")


def load(req: str, *addresses: str) -> KVLoad:
    return KVLoad(req, ONE, RemoteKV(req, 4, list(addresses)))


def failures(consumer: ZmqKVConnector, count: int, timeout: float = 10.0) -> dict[str, str]:
    outs = until(consumer, lambda outs: len(names(outs, "failed_recving")) >= count, timeout)
    return {f.req_id: f.error for f in names(outs, "failed_recving")}


def pulled_from_a_live_producer(consumer: ZmqKVConnector, req: str) -> None:
    """A load from a live producer lands: the puller still serves."""
    port = free_port()
    side = connector("producer", caches(8, seed=1), port)
    try:
        side.after_step(KVConnectorMetadata(saves=[KVSave(req, np.array([2], np.int32), 4)]))
        consumer.before_step(KVConnectorMetadata(loads=[load(req, f"tcp://127.0.0.1:{port}")]))
        until(consumer, lambda outs: req in names(outs, "finished_recving"))
    finally:
        side.shutdown()


def test_a_malformed_prefill_address_fails_that_load_alone() -> None:
    consumer = connector("consumer", caches(8, seed=2), 0)
    try:
        consumer.before_step(KVConnectorMetadata(loads=[load("no-port", "tcp://127.0.0.1")]))
        errors = failures(consumer, 1)
        pulled_from_a_live_producer(consumer, "after")
    finally:
        consumer.shutdown()
    assert "'no-port'" in errors["no-port"]
    assert "'tcp://127.0.0.1' lacks a host or a port" in errors["no-port"]


def test_a_load_naming_no_prefill_address_fails_alone_not_the_step() -> None:
    consumer = connector("consumer", caches(8, seed=2), 0)
    try:
        consumer.before_step(KVConnectorMetadata(loads=[load("nowhere")]))
        errors = failures(consumer, 1)
        pulled_from_a_live_producer(consumer, "after")
    finally:
        consumer.shutdown()
    assert errors == {"nowhere": "KV of request 'nowhere': its RemoteKV names no address"}


def test_a_pull_that_cannot_connect_fails_alone_and_leaves_no_socket() -> None:
    """Past the connector's check (the puller's own guard): connect's error fails that
    pull, naming the address; its socket is closed, so shutdown is prompt too."""
    consumer = connector("consumer", caches(8, seed=2), 0)
    try:
        assert consumer.puller is not None
        consumer.puller.pull(load("bad", "tcp://127.0.0.1"), head_map(2, 1, 1, 0))
        arrived = consumer.puller.arrived.get(timeout=5.0)
        assert consumer.puller.open_addresses == []
        pulled_from_a_live_producer(consumer, "after")
    finally:
        start = time.monotonic()
        consumer.shutdown()
    assert time.monotonic() - start < 5.0
    assert arrived.error is not None and "'bad'" in arrived.error
    assert "cannot send to the prefill at tcp://127.0.0.1: Invalid argument" in arrived.error


def test_pulls_to_a_peer_that_takes_nothing_fail_and_the_others_go_on() -> None:
    """More pulls than a socket queues (SNDHWM, 1,000) to an address nobody serves: those
    past the queue fail at once naming it, the queued ones at their timeout, and a pull
    from a live producer ordered after them all lands."""
    dead = f"tcp://127.0.0.1:{free_port()}"
    port, count = free_port(), 1100
    side = connector("producer", caches(8, seed=1), port)
    consumer = connector("consumer", caches(8, seed=2), 0, timeout_s=1.0)
    try:
        side.after_step(KVConnectorMetadata(saves=[KVSave("live", np.array([2], np.int32), 4)]))
        loads = [load(f"r{i}", dead) for i in range(count)]
        loads.append(load("live", f"tcp://127.0.0.1:{port}"))
        consumer.before_step(KVConnectorMetadata(loads=loads))
        outs = until(consumer, lambda outs: len(names(outs, "failed_recving")) == count, 5.0)
    finally:
        consumer.shutdown()
        side.shutdown()
    assert names(outs, "finished_recving") == ["live"]
    errors = [f.error for f in names(outs, "failed_recving")]
    full = [e for e in errors if f"the prefill at {dead} takes no more messages" in e]
    timed_out = [e for e in errors if f"no answer from {dead} within 1.0 s" in e]
    assert full and len(full) + len(timed_out) == count


def test_sockets_of_idle_addresses_close_and_are_bounded(monkeypatch) -> None:
    """Six prefill addresses nobody serves (prefills restarted on new ports), at most four
    open: the two pulls past the bound fail at once by name, the four at their timeout,
    and no socket is left once they have been idle."""
    monkeypatch.setattr(peer_sockets, "IDLE_CLOSE_S", 0.2)
    monkeypatch.setattr(peer_sockets, "MAX_PEERS", 4)
    gone = [f"tcp://127.0.0.1:{free_port()}" for _ in range(6)]
    consumer = connector("consumer", caches(8, seed=2), 0, timeout_s=0.5)
    try:
        assert consumer.puller is not None
        loads = [load(f"r{i}", address) for i, address in enumerate(gone)]
        consumer.before_step(KVConnectorMetadata(loads=loads))
        consumer.puller.wait_sent(5.0)
        assert consumer.puller.open_addresses == gone[:4]
        errors = failures(consumer, 6)
        deadline = time.monotonic() + 5.0
        while consumer.puller.open_addresses:
            assert time.monotonic() < deadline, consumer.puller.open_addresses
            time.sleep(0.05)
    finally:
        consumer.shutdown()
    for i, address in enumerate(gone[:4]):
        assert f"no answer from {address} within 0.5 s" in errors[f"r{i}"]
    for i, address in list(enumerate(gone))[4:]:
        assert (
            f"pulls wait on all 4 prefill addresses open here: none for {address}"
            in (errors[f"r{i}"])
        )
