"""The ZeroMQ KV connector's two sides in one process, over real sockets, on small
caches: blocks staged by a producer land byte for byte in other block ids of a consumer,
through the memfd (same host) and over tcp, where only the blocks after the consumer's
cached ones travel; a layout, a tp size whose heads cannot map, or an answer without the
blocks a load needs, fails the load by name (tests/test_kv_connector_tp.py: sizes that
map); a pull past the staged blocks is refused by name; staged KV nobody pulls expires
and is reported sent. The caches live on ZMQWORKER_TEST_DEVICE
(bench/run_on_gpu.sh runs these on CUDA: the device-side gathers and copies)."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import zmq

from messages import KVCacheSpec
from messages.kv_peer import CudaKV, CudaKVLayer, KVBlocks, KVDone, KVPull
from messages.kv_transfer import (
    KVConnectorMetadata,
    KVConnectorOutput,
    KVLoad,
    KVSave,
    KVTransferConfig,
    RemoteKV,
)
from zmqworker.kv_transfer import wire
from zmqworker.kv_transfer.arrived import Arrived
from zmqworker.kv_transfer.blocks import layout_of
from zmqworker.kv_transfer.head_map import HeadSource
from zmqworker.kv_transfer.peer_caches import IDLE_CLOSE_S
from zmqworker.kv_transfer.zmq_connector import ZmqKVConnector
from zmqworker.transport.curve import KVKeys, make_server

SPEC = KVCacheSpec(
    block_size=4, num_kv_heads=2, head_size=8, dtype="float32", layer_names=["a", "b"]
)
KEYS = KVKeys.new()
DEVICE = os.environ.get("ZMQWORKER_TEST_DEVICE", "cpu")
BLOCK_BYTES = 2 * 2 * SPEC.num_kv_heads * SPEC.block_size * SPEC.head_size * 4  # all layers
pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def caches(num_blocks: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (2, num_blocks, SPEC.num_kv_heads, SPEC.block_size * SPEC.head_size)
    return [torch.randn(shape, generator=g).to(DEVICE) for _ in SPEC.layer_names]


def connector(role: str, kv: list[torch.Tensor], port: int, **kw) -> ZmqKVConnector:
    config = KVTransferConfig(role=role, port=port, timeout_s=kw.pop("timeout_s", 2.0), **kw)
    spec = kw.pop("spec", SPEC)
    return ZmqKVConnector(config, lambda: kv, spec, tp_rank=0, tp_size=1, keys=KEYS)


@pytest.fixture(scope="module")
def producer() -> Iterator[tuple[ZmqKVConnector, list[torch.Tensor], str]]:
    port = free_port()
    kv = caches(16, seed=1)
    side = connector("producer", kv, port)
    try:
        yield side, kv, f"tcp://127.0.0.1:{port}"
    finally:
        side.shutdown()


def until(side: ZmqKVConnector, done, timeout: float = 10.0) -> list[KVConnectorOutput]:
    """take_output until done(outputs so far)."""
    outputs: list[KVConnectorOutput] = []
    deadline = time.monotonic() + timeout
    while not done(outputs):
        assert time.monotonic() < deadline, f"no end after {timeout} s: {outputs}"
        side.before_step(None)
        out = side.take_output(wait_s=0.05)
        if out is not None:
            outputs.append(out)
    return outputs


def until_closed(peer_caches, what: str) -> None:
    """Until a puller's openings of producers' caches are all closed: once idle, so that
    the producers' memory may go."""
    deadline = time.monotonic() + IDLE_CLOSE_S + 5
    while peer_caches.any_open:
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def names(outputs: list[KVConnectorOutput], what: str) -> list[str]:
    return [n for o in outputs for n in getattr(o, what)]


@pytest.mark.parametrize("num_cached", [0, 2, 3], ids=["all", "after-hits", "all-hits"])
@pytest.mark.parametrize("shared_memory", [True, False], ids=["memfd", "tcp"])
def test_staged_blocks_land_in_the_consumer_s_blocks(
    producer, shared_memory: bool, num_cached: int
) -> None:
    """num_cached: the first blocks hold their KV on the consumer already (prefix-cache
    hits there): they are left as they are, and only the blocks after them are read (the
    memfd) or travel (tcp; none at all where every block is cached)."""
    side, kv, address = producer
    req = f"r-{shared_memory}-{num_cached}"
    source, dest = [3, 7, 1], [10, 2, 5]
    side.after_step(KVConnectorMetadata(saves=[KVSave(req, np.array(source, np.int32), 11)]))
    target = caches(12, seed=2)
    before = [t.clone() for t in target]
    consumer = connector("consumer", target, 0, shared_memory=shared_memory)
    try:
        remote = RemoteKV(req, 11, [address])
        load = KVLoad(req, np.array(dest, np.int32), remote, num_cached_blocks=num_cached)
        consumer.before_step(KVConnectorMetadata(loads=[load]))
        until(consumer, lambda outs: names(outs, "finished_recving") == [req])
        path = "memfd" if shared_memory else "tcp"
        assert consumer.puller.num_pulled == {
            "cuda_ipc": 0,
            "host_cache": 0,
            "memfd": 0,
            "tcp": 0,
            path: 1,
        }
        pulled_bytes = (len(dest) - num_cached) * BLOCK_BYTES
        assert consumer.puller.num_bytes == {
            "cuda_ipc": 0,
            "host_cache": 0,
            "memfd": 0,
            "tcp": 0,
            path: pulled_bytes,
        }
    finally:
        consumer.shutdown()
    kept, pulled = dest[:num_cached], dest[num_cached:]
    for layer in range(len(SPEC.layer_names)):
        assert torch.equal(target[layer][:, pulled], kv[layer][:, source[num_cached:]])
        assert torch.equal(target[layer][:, kept], before[layer][:, kept])
    sent = until(side, lambda outs: req in names(outs, "finished_sending"))
    assert names(sent, "failed_recving") == []


def test_a_load_from_another_layout_or_tp_size_fails_by_name(producer) -> None:
    side, _, address = producer
    side.after_step(KVConnectorMetadata(saves=[KVSave("shape", np.array([0], np.int32), 4)]))
    other = KVCacheSpec(4, 2, 16, "float32", ["a", "b"])  # another head size
    consumer = ZmqKVConnector(
        KVTransferConfig(role="consumer", timeout_s=2.0),
        lambda: [torch.zeros(2, 4, 2, 64)] * 2,
        other,
        tp_rank=0,
        tp_size=1,
        keys=KEYS,
    )
    try:
        loads = [
            KVLoad("shape", np.array([1], np.int32), RemoteKV("shape", 4, [address])),
            KVLoad("tp", np.array([1], np.int32), RemoteKV("tp", 4, [address] * 3)),
        ]
        consumer.before_step(KVConnectorMetadata(loads=loads))
        outs = until(consumer, lambda outs: len(names(outs, "failed_recving")) == 2)
    finally:
        consumer.shutdown()
    errors = {f.req_id: f.error for f in names(outs, "failed_recving")}
    assert "layout" in errors["shape"] and "'shape'" in errors["shape"]
    assert (
        "tensor parallel size 3 and 1 pipeline stage(s), this decode instance 1 and 1"
        in (errors["tp"])
    )
    assert "tensor parallel size 3 is not a multiple of the 2 key/value heads" in errors["tp"]


def test_staged_kv_nobody_pulls_expires_and_is_reported_sent() -> None:
    kv = caches(4, seed=3)
    side = connector("producer", kv, free_port(), timeout_s=0.3)
    try:
        side.after_step(KVConnectorMetadata(saves=[KVSave("lost", np.array([1], np.int32), 2)]))
        assert names(until(side, lambda outs: bool(outs)), "finished_sending") == ["lost"]
    finally:
        side.shutdown()


def test_a_cancelled_load_lands_nowhere_and_a_new_one_of_its_id_does(producer) -> None:
    """After a failed step the scheduler gives its loads up with their blocks: the next
    step's cancel_loads comes first, so that the pull still under way copies nothing into
    blocks other requests may hold by then, and is never reported."""
    side, kv, address = producer
    req = "cancelled"
    source, dest = [4, 6], [1, 2]
    target = caches(8, seed=3)
    before = [t.clone() for t in target]
    consumer = connector("consumer", target, 0)
    try:
        side.after_step(KVConnectorMetadata(saves=[KVSave(req, np.array(source, np.int32), 8)]))
        load = KVLoad(req, np.array(dest, np.int32), RemoteKV(req, 8, [address]))
        consumer.before_step(KVConnectorMetadata(loads=[load]))
        consumer.cancel(KVConnectorMetadata(cancel_loads=[req]))
        reports: list[KVConnectorOutput] = []
        deadline = time.monotonic() + 10.0
        while sum(consumer.puller.num_pulled.values()) < 1 or reports == []:
            assert time.monotonic() < deadline, "the cancelled pull never ended"
            consumer.before_step(None)
            assert consumer.take_output(wait_s=0.05) is None
            out = side.take_output()
            if out is not None and req in out.finished_sending:
                reports.append(out)
        for layer, cache in enumerate(target):
            assert torch.equal(cache, before[layer])
        # The same request id again (a client may retry it): this load lands.
        side.after_step(KVConnectorMetadata(saves=[KVSave(req, np.array(source, np.int32), 8)]))
        again = KVLoad(req, np.array(dest, np.int32), RemoteKV(req, 8, [address]))
        consumer.before_step(KVConnectorMetadata(loads=[again]))
        until(consumer, lambda outs: names(outs, "finished_recving") == [req])
    finally:
        consumer.shutdown()
    for layer in range(len(SPEC.layer_names)):
        assert torch.equal(target[layer][:, dest], kv[layer][:, source])


def peer(ctx: zmq.Context, kind: int, address: str) -> zmq.Socket:
    """A bare CURVE socket with the deployment's keys: a DEALER connected to address, or
    a ROUTER bound there (a producer of our own making)."""
    sock = ctx.socket(kind)
    sock.linger = 0
    if kind == zmq.ROUTER:
        make_server(sock, KEYS.public, KEYS.secret)
        sock.bind(address)
    else:
        KEYS.make_client(sock)
        sock.connect(address)
    return sock


def test_a_pull_past_the_staged_blocks_is_refused_by_name(producer) -> None:
    """The server answers the refusal and goes on serving: the same request pulled from
    a block it has comes, those blocks alone."""
    side, kv, address = producer
    side.after_step(KVConnectorMetadata(saves=[KVSave("past", np.array([5, 9], np.int32), 8)]))
    ctx = zmq.Context()
    try:
        sock = peer(ctx, zmq.DEALER, address)
        answers = []
        for first_block in (3, 1):
            sock.send(wire.encode(KVPull("past", rank=0, first_block=first_block)))
            assert sock.poll(5000), "no answer"
            answers.append(sock.recv_multipart())
        sock.send(wire.encode(KVDone("past")))
        refusal, answer = (wire.decode(a[0]) for a in answers)
    finally:
        ctx.destroy(linger=0)
    assert isinstance(refusal, KVBlocks) and len(answers[0]) == 1
    assert refusal.error is not None and "'past'" in refusal.error
    assert "first_block 3 is past the 2 blocks staged" in refusal.error
    assert isinstance(answer, KVBlocks) and answer.error is None
    assert (answer.num_blocks, answer.first_block) == (2, 1)
    data = np.frombuffer(answers[1][1], np.float32).reshape(2, 2, 1, 2, -1)
    for layer in range(len(SPEC.layer_names)):
        assert np.array_equal(data[layer][:, 0], kv[layer][:, 9].cpu().numpy())
    assert "past" in names(until(side, bool), "finished_sending")


def test_a_refused_pull_lets_the_staging_go_at_once() -> None:
    """A consumer that believes it holds more blocks than were staged is refused; it
    fails the load by name and says KVDone, so the producer frees the staging long
    before it would expire."""
    port = free_port()
    side = connector("producer", caches(4, seed=5), port, timeout_s=60.0)
    consumer = connector("consumer", caches(6, seed=6), 0, timeout_s=60.0)
    try:
        side.after_step(KVConnectorMetadata(saves=[KVSave("short", np.array([3], np.int32), 4)]))
        remote = RemoteKV("short", 4, [f"tcp://127.0.0.1:{port}"])
        load = KVLoad("short", np.array([0, 1, 2], np.int32), remote, num_cached_blocks=2)
        consumer.before_step(KVConnectorMetadata(loads=[load]))
        [failure] = names(until(consumer, bool), "failed_recving")
        assert names(until(side, bool, timeout=10.0), "finished_sending") == ["short"]
    finally:
        consumer.shutdown()
        side.shutdown()
    assert "first_block 2 is past the 1 blocks staged for request 'short'" in failure.error


@contextmanager
def answered_by_hand(
    target: list[torch.Tensor], req: str, dest: list[int], num_cached_blocks: int = 0
) -> Iterator[SimpleNamespace]:
    """A consumer over target pulls req into dest from a bare CURVE ROUTER of the test's
    making; the body answers the pull (hand.server, hand.who: the puller's identity,
    hand.pull: its KVPull). On exit the consumer has ended the load (hand.outputs: its
    reports) and told the server it is done with the staging, landed or refused."""
    address = f"tcp://127.0.0.1:{free_port()}"
    ctx = zmq.Context()
    consumer = connector("consumer", target, 0, shared_memory=False)
    try:
        server = peer(ctx, zmq.ROUTER, address)
        remote = RemoteKV(req, 4 * len(dest), [address])
        load = KVLoad(req, np.array(dest, np.int32), remote, num_cached_blocks=num_cached_blocks)
        consumer.before_step(KVConnectorMetadata(loads=[load]))
        assert server.poll(5000), "no pull"
        who, body = server.recv_multipart()
        hand = SimpleNamespace(server=server, who=who, pull=wire.decode(body), outputs=[])
        assert isinstance(hand.pull, KVPull)
        yield hand
        hand.outputs = until(consumer, bool)
        assert server.poll(5000), "no KVDone"
        assert wire.decode(server.recv_multipart()[1]) == KVDone(req)
    finally:
        consumer.shutdown()
        ctx.destroy(linger=0)


@pytest.mark.parametrize("first_block", [0, 3], ids=["all-blocks", "too-few"])
def test_the_consumer_checks_which_blocks_an_answer_holds(first_block: int) -> None:
    """A load with 2 cached blocks of 3 names them in its pull; an answer holding all
    the blocks (a producer that ignores KVPull.first_block) lands the ones it needs, one
    that leaves out a block it needs fails the load by name."""
    staged = torch.randn(len(SPEC.layer_names), 2, 3, SPEC.num_kv_heads, 32)
    target = caches(6, seed=4)
    before = [t.clone() for t in target]
    with answered_by_hand(target, "old", [4, 0, 2], num_cached_blocks=2) as hand:
        assert hand.pull.first_block == 2
        reply = KVBlocks("old", layout_of(SPEC), 3, first_block=first_block)
        data = staged[:, :, first_block:].numpy()
        hand.server.send_multipart([hand.who, wire.encode(reply), data])
    outs = hand.outputs
    if first_block == 0:
        assert names(outs, "finished_recving") == ["old"]
        for layer in range(len(SPEC.layer_names)):
            assert torch.equal(target[layer][:, 2], staged[layer][:, 2].to(DEVICE))
            assert torch.equal(target[layer][:, [4, 0]], before[layer][:, [4, 0]])
    else:
        [failure] = names(outs, "failed_recving")
        assert failure.req_id == "old" and "'old'" in failure.error
        assert "staged blocks from 3 on, this load needs them from 2 on" in failure.error
        for layer in range(len(SPEC.layer_names)):
            assert torch.equal(target[layer], before[layer])


def test_an_answer_in_gpu_memory_to_a_pull_that_did_not_offer_to_open_it_fails_the_load() -> None:
    """A peer that answers with CUDA IPC handles where the puller named no GPU it can
    open (a CPU cache, or tcp) fails the load by name: nothing is opened, nothing lands."""
    target = caches(6, seed=5)
    before = [t.clone() for t in target]
    with answered_by_hand(target, "gpu", [1, 3]) as hand:
        assert hand.pull.gpus == []
        layer = CudaKVLayer(bytes(64), 0)
        cuda = CudaKV("GPU-0", [layer, layer], num_cache_blocks=4, block_ids=[0, 1])
        reply = KVBlocks("gpu", layout_of(SPEC), 2, cuda=cuda)
        hand.server.send_multipart([hand.who, wire.encode(reply)])
    [failure] = names(hand.outputs, "failed_recving")
    assert "'gpu'" in failure.error and "did not offer to open it" in failure.error
    for layer in range(len(SPEC.layer_names)):
        assert torch.equal(target[layer], before[layer])


def test_staged_kv_counts_as_read_from_the_cache_until_it_is_gone() -> None:
    """A prefill's KV stays in its blocks until pulled or expired (the worker refuses to
    release the cache meanwhile: tests/test_worker.py); then it no longer counts."""
    side = connector("producer", caches(8, seed=6), free_port(), timeout_s=0.3)
    try:
        side.after_step(KVConnectorMetadata(saves=[KVSave("held", np.array([2], np.int32), 3)]))
        assert side.num_cache_readers == 1
        assert names(until(side, bool), "finished_sending") == ["held"]
        assert side.num_cache_readers == 0
    finally:
        side.shutdown()


def test_withdrawn_staged_kv_is_reported_sent_and_refused_to_pullers() -> None:
    """cancel_saves (the engine gave up on a save after a failed step): staged KV that no
    puller reads in place goes at once, reported sent, and a later pull is refused by
    name at once; a save that never reached this worker is reported sent at once too."""
    port = free_port()
    kv = caches(8, seed=7)
    side = connector("producer", kv, port, timeout_s=10.0)  # withdrawn ids kept that long
    consumer = connector("consumer", caches(8, seed=8), 0)
    try:
        side.after_step(KVConnectorMetadata(saves=[KVSave("gone", np.array([2], np.int32), 3)]))
        side.cancel(KVConnectorMetadata(cancel_saves=["gone", "never-staged"]))
        sent = names(until(side, lambda outs: len(names(outs, "finished_sending")) == 2),
                     "finished_sending")  # fmt: skip
        assert sorted(sent) == ["gone", "never-staged"] and side.num_cache_readers == 0
        remote = RemoteKV("gone", 3, [f"tcp://127.0.0.1:{port}"])
        consumer.before_step(KVConnectorMetadata(loads=[KVLoad("gone", np.array([5]), remote)]))
        [failure] = names(until(consumer, bool), "failed_recving")
    finally:
        consumer.shutdown()
        side.shutdown()
    assert failure.req_id == "gone" and "KV of request 'gone' was withdrawn" in failure.error


def test_an_arrival_that_cannot_be_copied_in_fails_its_load_not_the_step() -> None:
    """A piece whose bytes do not fit its blocks fails its load by name (its blocks
    untouched, its server told it was read); the step, and the other loads, go on."""
    target = caches(6, seed=9)
    before = [t.clone() for t in target]
    consumer = connector("consumer", target, 0, shared_memory=False)
    try:
        remote = RemoteKV("short", 8, [f"tcp://127.0.0.1:{free_port()}"])  # nobody there
        load = KVLoad("short", np.array([1, 4], np.int32), remote)
        consumer.before_step(KVConnectorMetadata(loads=[load]))
        source = HeadSource(rank=0, first=0, count=2, dest=0, staged_heads=2, readers=1)
        piece = Arrived(load, source, bytearray(16), layout=layout_of(SPEC))
        consumer.puller.arrived.put(piece)
        out = consumer.take_output()
    finally:
        consumer.shutdown()
    assert out is not None and [f.req_id for f in out.failed_recving] == ["short"]
    assert "copying it in failed" in out.failed_recving[0].error
    assert "2 blocks need 2048 bytes, the buffer holds 16" in out.failed_recving[0].error
    assert all(torch.equal(a, b) for a, b in zip(target, before, strict=True))
