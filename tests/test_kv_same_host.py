"""Same-host pulls through the producer's memfd racing the staging's expiry, over real
sockets: a staging answered with its memfd is held a timeout past the answer, so a
puller a little late still opens it; a memfd gone all the same (opened too late) fails
that load alone, by name, and this host's later pulls still go through memfds; a
producer whose memfd cannot be opened on the first try (its pid not shown here) is read
over tcp from then on, that address alone."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest
import zmq

from messages.kv_peer import KVBlocks, KVPull, SharedKV
from messages.kv_transfer import KVConnectorMetadata, KVLoad, KVSave, RemoteKV
from tests.test_kv_connector import (
    BLOCK_BYTES,
    SPEC,
    caches,
    connector,
    free_port,
    names,
    peer,
    until,
)
from zmqworker.kv_transfer import wire
from zmqworker.kv_transfer.blocks import layout_of
from zmqworker.kv_transfer.staging import PeerMappings
from zmqworker.kv_transfer.zmq_connector import ZmqKVConnector

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")
NO_PID = 4194305  # past the kernel's largest pid_max: no process has it


@pytest.fixture
def late_open(monkeypatch) -> Iterator[list[float]]:
    """The puller's opening of a memfd waits late[0] s first (a busy thread)."""
    late = [0.0]
    acquire = PeerMappings.acquire

    def slow(self, *args, **kwargs):
        time.sleep(late[0])
        return acquire(self, *args, **kwargs)

    monkeypatch.setattr(PeerMappings, "acquire", slow)
    yield late


def pull(consumer: ZmqKVConnector, side: ZmqKVConnector | None, req: str, address: str):
    """Stage req on side (if given), pull it into consumer: its reports."""
    if side is not None:
        side.after_step(KVConnectorMetadata(saves=[KVSave(req, np.array([2], np.int32), 4)]))
    load = KVLoad(req, np.array([3], np.int32), RemoteKV(req, 4, [address]))
    consumer.before_step(KVConnectorMetadata(loads=[load]))
    return until(consumer, bool)


def test_a_memfd_answered_before_the_expiry_is_opened_after_it(late_open) -> None:
    """Pulled 0.6 s into a 1 s timeout, opened 0.6 s after the answer: past the staging's
    deadline, within the timeout it is held from the answer."""
    port = free_port()
    side = connector("producer", caches(8, seed=1), port, timeout_s=1.0)
    consumer = connector("consumer", caches(8, seed=2), 0, timeout_s=5.0)
    puller = consumer.puller
    assert puller is not None
    try:
        side.after_step(KVConnectorMetadata(saves=[KVSave("late", np.array([2], np.int32), 4)]))
        time.sleep(0.6)
        late_open[0] = 0.6
        outs = pull(consumer, None, "late", f"tcp://127.0.0.1:{port}")
    finally:
        consumer.shutdown()
        side.shutdown()
    assert names(outs, "finished_recving") == ["late"], outs
    assert puller.num_pulled["memfd"] == 1


def test_a_memfd_gone_before_it_is_opened_fails_that_load_alone(late_open) -> None:
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    side = connector("producer", caches(8, seed=1), port, timeout_s=0.3)
    consumer = connector("consumer", caches(8, seed=2), 0, timeout_s=5.0)
    puller = consumer.puller
    assert puller is not None
    try:
        assert names(pull(consumer, side, "first", address), "finished_recving") == ["first"]
        late_open[0] = 1.0  # past the answer's timeout: the memfd is closed
        [failure] = names(pull(consumer, side, "gone", address), "failed_recving")
        late_open[0] = 0.0
        assert names(pull(consumer, side, "next", address), "finished_recving") == ["next"]
    finally:
        consumer.shutdown()
        side.shutdown()
    assert failure.req_id == "gone" and "'gone'" in failure.error and address in failure.error
    assert puller.num_pulled == {"cuda_ipc": 0, "host_cache": 0, "memfd": 2, "tcp": 0}


def test_a_producer_not_shown_here_is_read_over_tcp_and_only_it() -> None:
    """A producer of this host whose memfd cannot be opened before any was (its pid not
    shown: another pid namespace) is asked again for bytes, and so are its later pulls;
    another producer's pulls still go through its memfd."""
    hidden = f"tcp://127.0.0.1:{free_port()}"
    port = free_port()
    side = connector("producer", caches(8, seed=1), port, timeout_s=5.0)
    consumer = connector("consumer", caches(8, seed=2), 0, timeout_s=5.0)
    puller = consumer.puller
    assert puller is not None
    ctx = zmq.Context()
    try:
        server = peer(ctx, zmq.ROUTER, hidden)
        consumer.before_step(KVConnectorMetadata(loads=[
            KVLoad("hidden", np.array([3], np.int32), RemoteKV("hidden", 4, [hidden]))
        ]))  # fmt: skip
        pulls = []
        for answer in (
            KVBlocks("hidden", layout_of(SPEC), 1, SharedKV(NO_PID, 3, BLOCK_BYTES, 1)),
            KVBlocks("hidden", error="refused by the test"),
        ):
            assert server.poll(5000), "no pull"
            who, body = server.recv_multipart()
            pulls.append(wire.decode(body))
            server.send_multipart([who, wire.encode(answer)])
        [failure] = names(until(consumer, bool), "failed_recving")
        live = pull(consumer, side, "live", f"tcp://127.0.0.1:{port}")
    finally:
        consumer.shutdown()
        side.shutdown()
        ctx.destroy(linger=0)
    assert all(isinstance(p, KVPull) for p in pulls)
    assert pulls[0].host_id != "" and pulls[1].host_id == ""
    assert failure.error.endswith("refused by the test")
    assert names(live, "finished_recving") == ["live"]
    assert puller.num_pulled["memfd"] == 1
    assert puller.reads_in_place(f"tcp://127.0.0.1:{port}") and not puller.reads_in_place(hidden)
