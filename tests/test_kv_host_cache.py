"""KV read straight out of a producer's host cache (its memfd, same host), over real
sockets in one process: the blocks land byte for byte (runs of consecutive blocks and
lone ones, all heads or some), the producer hears KVDone and lets them go, the mapping
closes once idle; a producer's new cache (sleep and wake_up make one) is mapped anew;
KV withdrawn while a puller reads it in place waits for that puller; an answer that does
not fit its cache is refused before anything is mapped; and a worker that produces KV
on the CPU keeps its cache in a memfd, let go with the cache."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch
import zmq

from messages import KVCacheSpec
from messages.kv_peer import HostCacheKV, KVBlocks, KVPull, SharedKV
from messages.kv_transfer import KVConnectorMetadata, KVLoad, KVSave, KVTransferConfig, RemoteKV
from tests.test_kv_connector import KEYS, free_port, names, peer, until, until_closed
from tests.test_piece_copies import mode  # noqa: F401 (a fixture)
from zmqworker.distributed.shared_cache import SharedKVCache
from zmqworker.kv_transfer import wire
from zmqworker.kv_transfer.blocks import copy_blocks, gather, layout_of
from zmqworker.kv_transfer.host_peers import open_host_cache
from zmqworker.kv_transfer.peer_caches import PeerCacheError
from zmqworker.kv_transfer.zmq_connector import ZmqKVConnector
from zmqworker.model_runner.kv_cache_memory import make_caches

SPEC = KVCacheSpec(block_size=4, num_kv_heads=2, head_size=8, dtype="float32",
                   layer_names=["a", "b", "c"])  # fmt: skip
SHAPE = (2, 16, SPEC.num_kv_heads, SPEC.block_size * SPEC.head_size)


def shared_cache(seed: int) -> SharedKVCache:
    shared = SharedKVCache(len(SPEC.layer_names), SHAPE, torch.float32)
    g = torch.Generator().manual_seed(seed)
    for layer in shared.layers:
        layer.copy_(torch.randn(SHAPE, generator=g))
    return shared


class Producer:
    """A producer connector over a host cache in shared memory that can be made anew."""

    def __init__(self, port: int, timeout_s: float = 10.0) -> None:
        self.shared = shared_cache(seed=1)
        config = KVTransferConfig(role="producer", port=port, timeout_s=timeout_s)
        self.side = ZmqKVConnector(config, lambda: self.shared.layers, SPEC, 0, 1, KEYS,
                                   shared_cache=lambda: self.shared)  # fmt: skip

    def stage(self, req: str, ids: list[int]) -> None:
        save = KVSave(req, np.array(ids, np.int32), len(ids) * SPEC.block_size)
        self.side.after_step(KVConnectorMetadata(saves=[save]))

    def close(self) -> None:
        self.side.shutdown()
        self.shared.close()


def consumer(target: list[torch.Tensor]) -> ZmqKVConnector:
    config = KVTransferConfig(role="consumer", timeout_s=10.0)
    return ZmqKVConnector(config, lambda: target, SPEC, 0, 1, KEYS)


def pull(side: ZmqKVConnector, req: str, dest: list[int], port: int, cached: int = 0) -> None:
    remote = RemoteKV(req, len(dest) * SPEC.block_size, [f"tcp://127.0.0.1:{port}"])
    load = KVLoad(req, np.array(dest, np.int32), remote, num_cached_blocks=cached)
    side.before_step(KVConnectorMetadata(loads=[load]))


@pytest.mark.parametrize(
    "source, dest, cached",
    [([3, 4, 5, 9], [10, 11, 12, 0], 0), ([7, 2, 3, 8], [1, 5, 6, 14], 2), ([5], [5], 1)],
    ids=["runs", "after-hits", "all-hits"],
)
def test_blocks_land_from_the_producer_s_host_cache_in_place(source, dest, cached) -> None:
    port = free_port()
    producer = Producer(port)
    target = [torch.zeros(SHAPE) for _ in SPEC.layer_names]
    side = consumer(target)
    try:
        producer.stage("r", source)
        pull(side, "r", dest, port, cached)
        until(side, lambda outs: names(outs, "finished_recving") == ["r"])
        assert side.puller.num_pulled["host_cache"] == 1
        assert side.puller.num_bytes["host_cache"] == (len(dest) - cached) * 3 * SHAPE[0] * 256
        assert names(until(producer.side, bool), "finished_sending") == ["r"]
        for mine, theirs in zip(target, producer.shared.layers, strict=True):
            assert torch.equal(mine[:, dest[cached:]], theirs[:, source[cached:]])
            assert not mine[:, dest[:cached]].any()  # held here already: untouched
        until_closed(side.puller.peer_caches, "the producer's cache was never unmapped")
    finally:
        side.shutdown()
        producer.close()


@pytest.mark.usefixtures("mode")
@pytest.mark.parametrize("heads", [None, (1, 0, 1), (0, 1, 1)])
def test_copy_blocks_equals_an_indexed_copy(heads) -> None:
    """Runs and lone blocks alike, all heads or a piece of them (first, dest, count), in
    the kernel's copy of pieces and in slices."""
    g = torch.Generator().manual_seed(3)
    sources = [torch.randn(SHAPE, generator=g) for _ in range(2)]
    dst = [torch.randn(SHAPE, generator=g) for _ in range(2)]
    want = [t.clone() for t in dst]
    ids, source_ids = np.array([4, 5, 6, 1, 9, 10]), np.array([0, 1, 2, 3, 8, 12])
    copy_blocks(dst, ids, sources, source_ids, heads)
    first, dest, count = heads or (0, 0, SPEC.num_kv_heads)
    for mine, theirs in zip(want, sources, strict=True):
        mine[:, ids, dest : dest + count] = theirs[:, source_ids, first : first + count]
    assert all(torch.equal(a, b) for a, b in zip(dst, want, strict=True))


def test_gather_takes_each_layer_s_blocks_and_refuses_one_past_the_cache() -> None:
    """The producer's gather into its staging (a take without numpy's own buffer, the
    ids checked first: such a take would clip one past the cache to the last block)."""
    g = torch.Generator().manual_seed(5)
    caches = [torch.randn(SHAPE, generator=g) for _ in range(2)]
    for ids in (torch.tensor([7, 0, 3, 3]), torch.tensor([15, 1], dtype=torch.int32)):
        out = torch.zeros(2, 2, len(ids), *SHAPE[2:])
        gather(caches, ids, out)
        assert all(torch.equal(out[i], cache[:, ids]) for i, cache in enumerate(caches))
    gather(caches, torch.tensor([], dtype=torch.int64), torch.zeros(2, 2, 0, *SHAPE[2:]))
    out = torch.zeros(2, 2, 2, *SHAPE[2:])
    for bad in (SHAPE[1], -1):
        with pytest.raises(ValueError, match=f"of {SHAPE[1]} blocks"):
            gather(caches, torch.tensor([1, bad]), out[:, :, :2])


def test_a_producer_s_new_cache_is_mapped_anew_and_the_old_one_let_go() -> None:
    port = free_port()
    producer = Producer(port)
    target = [torch.zeros(SHAPE) for _ in SPEC.layer_names]
    side = consumer(target)
    try:
        producer.stage("before", [1])
        pull(side, "before", [2], port)
        until(side, lambda outs: names(outs, "finished_recving") == ["before"])
        old, producer.shared = producer.shared, shared_cache(seed=2)  # a wake-up's cache
        old.close()
        producer.stage("after", [1])
        pull(side, "after", [3], port)
        until(side, lambda outs: names(outs, "finished_recving") == ["after"])
        for mine, before, after in zip(target, old.layers, producer.shared.layers, strict=True):
            assert torch.equal(mine[:, 2], before[:, 1]) and torch.equal(mine[:, 3], after[:, 1])
        peer_caches = side.puller.peer_caches
        assert [c.key[2] for c in peer_caches._open.values()] == [producer.shared.inode]
        deadline = time.monotonic() + 5
        while peer_caches._retired:  # the old one: closed once unread
            assert time.monotonic() < deadline, "the producer's old cache stayed mapped"
            time.sleep(0.05)
    finally:
        side.shutdown()
        producer.close()


def test_kv_withdrawn_while_read_in_place_waits_for_its_reader() -> None:
    """The engine withdraws a save (cancel_saves) after a puller was answered with its
    blocks in place: they stay held, and are reported sent once that puller is done."""
    port = free_port()
    producer = Producer(port)
    target = [torch.zeros(SHAPE) for _ in SPEC.layer_names]
    side = consumer(target)
    try:
        producer.stage("lent", [6, 7])
        pull(side, "lent", [8, 9], port)
        deadline = time.monotonic() + 10
        while side.puller.arrived.empty():  # answered in place, not copied from yet
            assert time.monotonic() < deadline, "no answer"
            time.sleep(0.01)
        producer.side.cancel(KVConnectorMetadata(cancel_saves=["lent"]))
        assert producer.side.take_output(wait_s=0.3) is None  # still read: held
        until(side, lambda outs: names(outs, "finished_recving") == ["lent"])
        assert names(until(producer.side, bool), "finished_sending") == ["lent"]
        for mine, theirs in zip(target, producer.shared.layers, strict=True):
            assert torch.equal(mine[:, [8, 9]], theirs[:, [6, 7]])
    finally:
        side.shutdown()
        producer.close()


@pytest.mark.parametrize(
    "change, error",
    [
        ({"offsets": [0, 4096]}, "2 layers of host cache for 3"),
        ({"offsets": [0, 8, 16]}, "not 16-aligned"),
        ({"num_cache_blocks": 10**6}, "bytes at offset 0 of a memfd of"),
        ("nbytes", "holds .* bytes, not"),
        ("inode", "is another memfd now"),
        ("no-inode", "does not name the memfd's inode"),
        ("staging", "not a KV cache"),
    ],
)
def test_an_answer_that_does_not_fit_its_cache_is_refused_before_mapping(change, error) -> None:
    shared = shared_cache(seed=4)
    staging = os.memfd_create("zmqworker-kv", os.MFD_CLOEXEC)
    try:
        memfd = SharedKV(os.getpid(), shared.fd, shared.nbytes, shared.inode)
        if change == "nbytes":
            memfd = SharedKV(memfd.pid, memfd.fd, memfd.nbytes + 4096, memfd.inode)
        elif change == "inode":
            memfd = SharedKV(memfd.pid, memfd.fd, memfd.nbytes, memfd.inode + 1)
        elif change == "no-inode":
            memfd = SharedKV(memfd.pid, memfd.fd, memfd.nbytes, 0)
        elif change == "staging":
            memfd = SharedKV(memfd.pid, staging, memfd.nbytes, memfd.inode)
        fields = {"offsets": shared.offsets, "num_cache_blocks": SHAPE[1], "block_ids": [0]}
        host = HostCacheKV(memfd, **(fields | (change if isinstance(change, dict) else {})))
        with pytest.raises((ValueError, PeerCacheError), match=error):
            open_host_cache(host, layout_of(SPEC))
    finally:
        os.close(staging)
        shared.close()


def test_a_host_cache_that_cannot_be_opened_is_asked_for_bytes_instead() -> None:
    """The pull is asked again for a memfd (and fails if answered in place again), and so
    is every later pull of that producer."""
    port = free_port()
    ctx = zmq.Context()
    side = consumer([torch.zeros(SHAPE) for _ in SPEC.layer_names])
    null = os.open("/dev/null", os.O_RDONLY)
    try:
        server = peer(ctx, zmq.ROUTER, f"tcp://127.0.0.1:{port}")
        pull(side, "r", [2], port)
        assert server.poll(5000), "no pull"
        who, body = server.recv_multipart()
        assert wire.decode(body).host_cache
        forged = HostCacheKV(SharedKV(os.getpid(), null, 4096, 1), [0, 0, 0], 1, [0])
        server.send_multipart([who, wire.encode(KVBlocks("r", layout_of(SPEC), 1,
                                                         host_cache=forged))])  # fmt: skip
        assert server.poll(5000), "not asked again"
        again = wire.decode(server.recv_multipart()[1])
        assert again.req_id == "r" and again.host_id and not again.host_cache
        # Answered in place again: the load fails (it is not asked a third time).
        server.send_multipart([who, wire.encode(KVBlocks("r", layout_of(SPEC), 1,
                                                         host_cache=forged))])  # fmt: skip
        [failure] = names(until(side, bool), "failed_recving")
        assert "from a producer asked for bytes" in failure.error
        pull(side, "later", [3], port)
        later = None
        while not isinstance(later, KVPull):  # after the KVDone of "r"
            assert server.poll(5000), "no later pull"
            later = wire.decode(server.recv_multipart()[1])
        assert later.req_id == "later" and later.host_id and not later.host_cache
    finally:
        os.close(null)
        side.shutdown()
        ctx.destroy(linger=0)


def test_a_cpu_producer_keeps_its_cache_in_a_memfd() -> None:
    """Only a producer that serves through shared memory, on the CPU; the memfd's fd is
    closed with the cache (no new peer can open it)."""
    producer = KVTransferConfig(role="producer")
    cpu = torch.device("cpu")
    layers, shared = make_caches(SPEC, 4, cpu, producer)
    assert shared is not None and os.readlink(f"/proc/self/fd/{shared.fd}").startswith(
        "/memfd:zmqworker-kv-cache"
    )
    base = layers[0].data_ptr() - shared.offsets[0]
    assert [t.data_ptr() - base for t in layers] == shared.offsets
    assert all(not t.any() for t in layers)  # zeroed, as every cache
    fd = shared.fd
    shared.close()
    assert not os.path.exists(f"/proc/self/fd/{fd}") or not os.readlink(
        f"/proc/self/fd/{fd}"
    ).startswith("/memfd:zmqworker-kv-cache")
    for config in (None, KVTransferConfig(role="consumer"),
                   KVTransferConfig(role="producer", shared_memory=False)):  # fmt: skip
        assert make_caches(SPEC, 4, cpu, config)[1] is None
