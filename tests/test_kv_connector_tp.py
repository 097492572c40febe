"""The ZeroMQ KV connector between sides of different tensor parallel sizes, in one
process over real sockets: each decode rank's cache ends up with the heads the model's
head rule gives it, taken from the prefill ranks that hold them, out of their host
caches in place (copied ahead of the answers too), through the memfd and over tcp; a
prefill rank's staged KV goes once every decode rank that reads it (or only releases it,
a replica nobody reads) is done, not at the timeout. The caches live on
ZMQWORKER_TEST_DEVICE (bench/run_on_gpu.sh runs these on CUDA: the head-slice copies)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import ExitStack

import numpy as np
import pytest
import torch

from messages import KVCacheSpec
from messages.kv_transfer import KVConnectorMetadata, KVLoad, KVSave, KVTransferConfig, RemoteKV
from tests.test_kv_connector import KEYS, free_port, names, until
from zmqworker.distributed.shared_cache import SharedKVCache
from zmqworker.kv_transfer.zmq_connector import ZmqKVConnector
from zmqworker.models.llama import kv_heads_of_rank

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")
BLOCK, HEAD, SLOTS = 4, 8, 32  # block size, head size, block size x head size
DEVICE = os.environ.get("ZMQWORKER_TEST_DEVICE", "cpu")
TIMEOUT_S = 20.0  # far above the test's run: a staged KV that went, went on KVDone


def model_cache(num_kv_heads: int, num_blocks: int) -> list[torch.Tensor]:
    """The whole model's cache (all heads), two layers, random."""
    g = torch.Generator().manual_seed(num_kv_heads)
    return [torch.randn(2, num_blocks, num_kv_heads, SLOTS, generator=g) for _ in range(2)]


def side(role: str, kv: list[torch.Tensor], heads: int, rank: int, tp: int, shared=None, **kw):
    """shared: the SharedKVCache holding kv (a producer's host cache, read in place)."""
    spec = KVCacheSpec(BLOCK, kv[0].shape[2], HEAD, "float32", ["a", "b"])
    config = KVTransferConfig(role=role, timeout_s=TIMEOUT_S, **kw)
    return ZmqKVConnector(config, lambda: kv, spec, rank, tp, KEYS, num_kv_heads=heads,
                          shared_cache=lambda: shared)  # fmt: skip


def in_shared_memory(kv: list[torch.Tensor]) -> SharedKVCache:
    shared = SharedKVCache(len(kv), tuple(kv[0].shape), kv[0].dtype)
    for mine, layer in zip(shared.layers, kv, strict=True):
        mine.copy_(layer)
    return shared


def rank_slice(kv: list[torch.Tensor], heads: int, rank: int, tp: int) -> list[torch.Tensor]:
    per_rank, first = kv_heads_of_rank(heads, tp, rank)
    return [layer[:, :, first : first + per_rank].to(DEVICE, copy=True) for layer in kv]


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as s:
        yield s


@pytest.mark.parametrize("path", ["host_cache", "memfd", "tcp"])
@pytest.mark.parametrize(
    ("heads", "prefill_tp", "decode_tp", "cached"),
    [(4, 2, 1, 0), (4, 1, 2, 0), (4, 2, 4, 0), (4, 4, 2, 0), (1, 2, 1, 0), (1, 1, 2, 0),
     (2, 4, 1, 0), (4, 2, 1, 1), (4, 1, 2, 1)],
)  # fmt: skip
def test_each_decode_rank_gets_its_heads(
    stack: ExitStack,
    heads: int,
    prefill_tp: int,
    decode_tp: int,
    cached: int,
    path: str,
) -> None:
    """cached: the leading blocks the decode side holds already (left as they are). Each
    decode rank reads (the producer's host cache, the memfd) or receives (tcp) its own
    heads of the blocks after them alone."""
    if path == "host_cache" and DEVICE != "cpu":
        pytest.skip("host caches: the caches on the CPU")
    shared_memory = path != "tcp"
    whole = model_cache(heads, 8)
    source, dest = [3, 6], [1, 4]
    addresses, producers = [], []
    for p in range(prefill_tp):
        port = free_port()  # rank p binds the config's port + p
        kv, shared = rank_slice(whole, heads, p, prefill_tp), None
        if path == "host_cache":
            shared = in_shared_memory(kv)
            stack.callback(shared.close)
            kv = shared.layers
        producer = side("producer", kv, heads, p, prefill_tp, shared, port=port - p)
        stack.callback(producer.shutdown)
        producer.after_step(KVConnectorMetadata(saves=[KVSave("r", np.array(source), 7)]))
        addresses.append(f"tcp://127.0.0.1:{port}")
        producers.append(producer)
    targets = []
    for d in range(decode_tp):
        per_rank = kv_heads_of_rank(heads, decode_tp, d)[0]
        target = [torch.zeros(2, 6, per_rank, SLOTS, device=DEVICE) for _ in range(2)]
        consumer = side("consumer", target, heads, d, decode_tp, shared_memory=shared_memory)
        stack.callback(consumer.shutdown)
        remote = RemoteKV("r", 7, addresses)
        load = KVLoad("r", np.array(dest, np.int32), remote, num_cached_blocks=cached)
        consumer.before_step(KVConnectorMetadata(loads=[load]))
        until(consumer, lambda outs: names(outs, "finished_recving") == ["r"])
        pulled_bytes = 2 * 2 * per_rank * (len(dest) - cached) * SLOTS * 4  # layers, k/v
        assert consumer.puller.num_bytes == {
            "cuda_ipc": 0,
            "host_cache": 0,
            "memfd": 0,
            "tcp": 0,
            path: pulled_bytes,
        }
        targets.append(target)
    for d, target in enumerate(targets):
        want = rank_slice(whole, heads, d, decode_tp)  # on DEVICE, as target
        for layer in range(2):
            assert not target[layer][:, dest[:cached]].any()  # untouched
            pulled = target[layer][:, dest[cached:]]
            assert torch.equal(pulled, want[layer][:, source[cached:]])
    for producer in producers:  # every prefill rank let it go once its readers were done
        assert names(until(producer, bool, timeout=5.0), "finished_sending") == ["r"]


def test_a_prefill_rank_that_never_answers_fails_the_load_by_name(stack: ExitStack) -> None:
    """2 -> 1 with prefill rank 1 gone: the load fails naming its address; rank 0's piece
    is still told done, so rank 0 lets its staged KV go."""
    whole = model_cache(4, 8)
    port, gone = free_port(), free_port()
    producer = side("producer", rank_slice(whole, 4, 0, 2), 4, 0, 2, port=port)
    stack.callback(producer.shutdown)
    producer.after_step(KVConnectorMetadata(saves=[KVSave("r", np.array([2]), 3)]))
    target = [torch.zeros(2, 4, 4, SLOTS, device=DEVICE) for _ in range(2)]
    spec = KVCacheSpec(BLOCK, 4, HEAD, "float32", ["a", "b"])
    config = KVTransferConfig(role="consumer", timeout_s=0.5)
    consumer = ZmqKVConnector(config, lambda: target, spec, 0, 1, KEYS, num_kv_heads=4)
    stack.callback(consumer.shutdown)
    addresses = [f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{gone}"]
    load = KVLoad("r", np.array([1], np.int32), RemoteKV("r", 3, addresses))
    consumer.before_step(KVConnectorMetadata(loads=[load]))
    outs = until(consumer, lambda outs: bool(names(outs, "failed_recving")))
    assert names(outs, "finished_recving") == []
    [failure] = names(outs, "failed_recving")
    assert failure.req_id == "r" and f":{gone}" in failure.error
    assert names(until(producer, bool, timeout=5.0), "finished_sending") == ["r"]
    assert consumer._loading == {} and consumer._pieces_left == {}


@pytest.mark.parametrize(
    ("heads", "prefill_tp", "decode_tp"), [(4, 2, 1), (4, 1, 2), (4, 2, 4), (1, 1, 2), (2, 4, 1)]
)
def test_a_decode_rank_copies_its_heads_ahead_of_the_answers(
    stack: ExitStack, heads: int, prefill_tp: int, decode_tp: int
) -> None:
    """Once the prefill ranks' host caches are open (a first pull), a load naming the
    prefill's blocks is copied, each decode rank's own heads from each prefill rank it
    reads, before the answers, which confirm every piece."""
    if DEVICE != "cpu":
        pytest.skip("host caches: the caches on the CPU")
    whole = model_cache(heads, 8)
    addresses = []
    for p in range(prefill_tp):
        port = free_port()
        shared = in_shared_memory(rank_slice(whole, heads, p, prefill_tp))
        stack.callback(shared.close)
        producer = side("producer", shared.layers, heads, p, prefill_tp, shared, port=port - p)
        stack.callback(producer.shutdown)
        saves = [KVSave("first", np.array([7]), 4), KVSave("r", np.array([2, 5]), 7)]
        producer.after_step(KVConnectorMetadata(saves=saves))
        addresses.append(f"tcp://127.0.0.1:{port}")
    for d in range(decode_tp):
        per_rank = kv_heads_of_rank(heads, decode_tp, d)[0]
        target = [torch.zeros(2, 6, per_rank, SLOTS) for _ in range(2)]
        consumer = side("consumer", target, heads, d, decode_tp)
        stack.callback(consumer.shutdown)
        loads = (("first", 4, None, [5]), ("r", 7, np.array([2, 5], np.int32), [1, 4]))
        for req, num_tokens, source, dest in loads:
            remote = RemoteKV(req, num_tokens, addresses, source)
            consumer.before_step(KVConnectorMetadata(loads=[KVLoad(req, np.array(dest), remote)]))
            until(consumer, lambda outs, req=req: names(outs, "finished_recving") == [req])
        pieces = consumer.puller.num_pulled["host_cache"] // 2  # a load's
        read_ahead = consumer.read_ahead
        assert read_ahead.num_copied == read_ahead.num_stood == pieces > 0  # all of "r"
        want = rank_slice(whole, heads, d, decode_tp)
        for layer in range(2):
            assert torch.equal(target[layer][:, [1, 4]], want[layer][:, [2, 5]])
