"""KV pulled straight out of a producer's GPU cache (CUDA IPC, same host): on a GPU, and
from a peer GPU where there are two, the blocks land byte for byte (bfloat16), the
producer hears KVDone, a decode rank's own cached blocks stay as they are, a pull copied
ahead of its answer stands, a producer's new cache (a wake-up's) is opened anew (a copy
ahead out of the old one is made again), and the openings are closed once idle. On the
CPU: an answer naming blocks or layers the load cannot use is refused before anything is
opened, and an answer too old to copy from fails its load by name."""

from __future__ import annotations

import multiprocessing as mp
import socket
import time

import numpy as np
import pytest
import torch

from messages import KVCacheSpec
from messages.kv_peer import CudaKV, CudaKVLayer
from messages.kv_transfer import (
    KVConnectorMetadata,
    KVLoad,
    KVSave,
    KVTransferConfig,
    RemoteKV,
)
from tests.test_kv_connector import until_closed
from zmqworker.kv_transfer.arrived import Arrived
from zmqworker.kv_transfer.blocks import layout_of
from zmqworker.kv_transfer.cuda_peers import open_gpu_cache
from zmqworker.kv_transfer.head_map import HeadSource
from zmqworker.kv_transfer.peer_caches import PeerCache, checked_ids
from zmqworker.kv_transfer.zmq_connector import ZmqKVConnector
from zmqworker.transport.curve import KVKeys

SPEC = KVCacheSpec(
    block_size=4, num_kv_heads=2, head_size=8, dtype="bfloat16", layer_names=["a", "b", "c"]
)
LAYER = CudaKVLayer(bytes(64), 0)
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


def caches(num_blocks: int, seed: int, device: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (2, num_blocks, SPEC.num_kv_heads, SPEC.block_size * SPEC.head_size)
    return [torch.randn(shape, generator=g).to(torch.bfloat16).to(device) for _ in SPEC.layer_names]


@pytest.mark.parametrize(
    "layers, ids, error",
    [
        (2, [0, 1], "2 layers of GPU cache for 3"),
        (3, [0], "1 block ids in the producer's cache for 2 blocks"),
        (3, [0, 8], "block id 8 past the producer's 8 cache blocks"),
    ],
)
def test_an_answer_that_does_not_fit_the_load_is_refused_before_opening(layers, ids, error):
    cuda = CudaKV("GPU-x", [LAYER] * layers, num_cache_blocks=8, block_ids=ids)
    with pytest.raises(ValueError, match=error):  # checked before anything is opened
        checked_ids(cuda.block_ids, 2, cuda.num_cache_blocks)
        open_gpu_cache(cuda, layout_of(SPEC), torch.device("cuda", 0))


def test_an_answer_too_old_to_read_from_is_stale():
    """Past half of the time the producer holds the blocks (its hold_s, or this side's
    timeout where shorter or unsaid), an answer in place is not copied from."""
    load = KVLoad("r", np.array([1], np.int32), RemoteKV("r", 4, ["tcp://127.0.0.1:1"]))
    source = HeadSource(rank=0, first=0, count=2, dest=0, staged_heads=2, readers=1)
    cache = PeerCache((), [0], num_blocks=1, num_kv_heads=2, close=lambda: None)
    fresh = Arrived(load, source, sources=cache, source_ids=np.zeros(1, np.int64))
    assert fresh.stale(2.0) is None
    old = Arrived(load, source, sources=cache, received=time.monotonic() - 2.0)
    assert "answer is 2.0 s old, past 1.0 s" in old.stale(2.0)
    assert old.stale(8.0) is None
    held_less = Arrived(load, source, sources=cache, received=old.received, hold_s=3.0)
    assert "past 1.5 s" in held_less.stale(8.0)  # the producer's hold, not this timeout
    assert Arrived(load, source, received=time.monotonic() - 2.0).stale(1.0) is None  # bytes


def _producer(conn, port: int, keys: tuple[bytes, bytes], device: str) -> None:
    torch.cuda.set_device(device)
    kv = [caches(16, seed=1, device=device)]  # [the cache now]; the ones before it
    config = KVTransferConfig(role="producer", port=port, timeout_s=30.0)
    side = ZmqKVConnector(config, lambda: kv[0], SPEC, 0, 1, KVKeys(*keys))
    try:
        while (order := conn.recv()) != "quit":
            if order == "remake":  # as a wake-up does: a new cache, in new allocations
                kv.insert(0, caches(16, seed=3, device=device))
                conn.send("remade")
                continue
            req, ids = order
            side.after_step(KVConnectorMetadata(saves=[KVSave(req, np.array(ids, np.int32), 12)]))
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                out = side.take_output(wait_s=0.05)
                if out is not None and req in out.finished_sending:
                    conn.send("sent")
                    break
            else:
                conn.send("never sent")
    finally:
        side.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pull_in_place(consumer, conn, port: int, req: str, src, dest, num_cached: int = 0) -> None:
    conn.send((req, src))
    # The prefill's block ids: copied ahead of the answer where the cache is open here.
    remote = RemoteKV(req, 12, [f"tcp://127.0.0.1:{port}"], np.array(src, np.int32))
    load = KVLoad(req, np.array(dest, np.int32), remote, num_cached_blocks=num_cached)
    consumer.before_step(KVConnectorMetadata(loads=[load]))
    recved, deadline = [], time.monotonic() + 30
    while req not in recved:
        assert time.monotonic() < deadline, "the load never landed"
        consumer.before_step(None)
        out = consumer.take_output(wait_s=0.05)
        recved += out.finished_recving if out is not None else []
        assert out is None or not out.failed_recving, out
    assert conn.poll(30) and conn.recv() == "sent"  # KVDone came after the copy


@gpu
@pytest.mark.parametrize("producer", ["cuda:0", pytest.param("cuda:1", marks=two_gpus)])
def test_blocks_come_straight_out_of_the_producer_s_gpu_cache(producer):
    """Then out of the producer's new cache once it has made one (a wake-up): the old
    opening is closed, the new one opened. The consumer is on cuda:0: a producer on
    cuda:1 is read across the peer link. The second pull is copied ahead of its answer
    (the cache is open by then), and so is the third, from the old cache: its answer
    names the new one, from which it is copied again."""
    if producer != "cuda:0" and not torch.cuda.can_device_access_peer(0, 1):
        pytest.skip("cuda:0 has no peer access to cuda:1")
    keys, port = KVKeys.new(), free_port()
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    args = (child_conn, port, (keys.public, keys.secret), producer)
    child = ctx.Process(target=_producer, args=args)
    child.start()
    source = caches(16, seed=1, device="cuda:0")  # the producer's, made alike here
    target = caches(12, seed=2, device="cuda:0")
    before = [t.clone() for t in target]
    config = KVTransferConfig(role="consumer", timeout_s=30.0)
    consumer = ZmqKVConnector(config, lambda: target, SPEC, 0, 1, keys)
    try:
        for num_cached, req in ((0, "all"), (1, "after-hit")):
            src, dest = [3, 7, 1], [10, 2, 5]
            _pull_in_place(consumer, conn, port, req, src, dest, num_cached)
            for layer in range(len(SPEC.layer_names)):
                kept, pulled = dest[:num_cached], dest[num_cached:]
                assert torch.equal(target[layer][:, pulled], source[layer][:, src[num_cached:]])
                assert torch.equal(target[layer][:, kept], before[layer][:, kept])
                target[layer][:, dest] = before[layer][:, dest]  # as new for the next
        peer_caches = consumer.puller.peer_caches
        first = [cache.key for cache in peer_caches._open.values()]
        conn.send("remake")
        assert conn.poll(30) and conn.recv() == "remade"
        _pull_in_place(consumer, conn, port, "after-wake", [3, 4], [0, 9])
        remade = caches(16, seed=3, device="cuda:0")
        for layer in range(len(SPEC.layer_names)):
            assert torch.equal(target[layer][:, [0, 9]], remade[layer][:, [3, 4]])
        assert [cache.key for cache in peer_caches._open.values()] != first  # opened anew
        assert consumer.puller.num_pulled == {"cuda_ipc": 3, "host_cache": 0, "memfd": 0, "tcp": 0}
        assert (consumer.read_ahead.num_copied, consumer.read_ahead.num_stood) == (2, 1)
        until_closed(peer_caches, "the producer's caches stayed open")
    finally:
        consumer.shutdown()
        conn.send("quit")
        child.join(timeout=30)
        if child.is_alive():
            child.kill()


def test_a_stale_answer_in_place_fails_its_load_by_name_and_lets_the_producer_go():
    """An answer naming blocks in a producer's GPU cache that comes too late to copy
    from (half the timeout) fails the load by name, copies nothing and says KVDone (the
    producer may let its blocks go); the load's later end is dropped."""
    target = caches(4, seed=3, device="cpu")
    before = [t.clone() for t in target]
    config = KVTransferConfig(role="consumer", timeout_s=2.0, shared_memory=False)
    consumer = ZmqKVConnector(config, lambda: target, SPEC, 0, 1, KVKeys.new())
    try:
        remote = RemoteKV("late", 4, [f"tcp://127.0.0.1:{free_port()}"])  # nobody there
        load = KVLoad("late", np.array([2], np.int32), remote)
        consumer.before_step(KVConnectorMetadata(loads=[load]))
        source = HeadSource(rank=0, first=0, count=2, dest=0, staged_heads=2, readers=1)
        cache = PeerCache((), [0, 0, 0], num_blocks=1, num_kv_heads=2, close=lambda: None)
        late = Arrived(load, source, sources=cache, source_ids=np.zeros(1, np.int64),
                       received=time.monotonic() - 1.5)  # fmt: skip
        consumer.puller.arrived.put(late)
        out = consumer.take_output()
        assert out is not None and [f.req_id for f in out.failed_recving] == ["late"]
        assert "answer is 1.5 s old, past 1.0 s" in out.failed_recving[0].error
        assert late.sources is None  # let go
    finally:
        consumer.shutdown()
    assert all(torch.equal(a, b) for a, b in zip(target, before, strict=True))
