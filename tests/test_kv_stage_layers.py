"""Pulls between connectors of instances of different pipeline stage counts
(kv_transfer/head_map.py, stage_map), over real sockets on small caches of two layers:
a stage of one instance takes its layers alone from every stage of the other holding
some, over tcp (a part of the staged layers asked) and on one host (the staging, or on
CUDA the producer's cache, read in place; the layers taken from it). Each layer lands
in its place, nothing else is written, and each producer lets its staging go once all
its readers are done. The caches live on ZMQWORKER_TEST_DEVICE."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from messages.kv_transfer import KVConnectorMetadata, KVLoad, KVSave, KVTransferConfig, RemoteKV
from tests.test_kv_connector import BLOCK_BYTES, KEYS, SPEC, caches, free_port, names, until
from zmqworker.kv_transfer.zmq_connector import ZmqKVConnector

NUM_LAYERS = len(SPEC.layer_names)  # the model's: two stages hold one each
SOURCE, DEST = [5, 1, 7], [0, 6, 3]
pytestmark = [
    pytest.mark.filterwarnings("ignore:The given buffer is not writable"),
    pytest.mark.parametrize("shared", [False, True], ids=["tcp", "same-host"]),
]


def stage(
    role: str, kv: list[torch.Tensor], port: int, pp_rank: int, pp_size: int, shared: bool
) -> ZmqKVConnector:
    """Rank pp_rank of an instance of pp_size stages (tp 1), its cache kv (its layers)."""
    config = KVTransferConfig(role=role, port=port, timeout_s=2.0, shared_memory=shared)
    spec = msgspec.structs.replace(SPEC, layer_names=SPEC.layer_names[: len(kv)])
    return ZmqKVConnector(config, lambda: kv, spec, tp_rank=0, tp_size=1, keys=KEYS,
                          pp_rank=pp_rank, pp_size=pp_size, num_layers=NUM_LAYERS)  # fmt: skip


def load(req_id: str, port: int, stages: int) -> KVConnectorMetadata:
    remote = RemoteKV(req_id, 12, [f"tcp://127.0.0.1:{port + s}" for s in range(stages)],
                      pipeline_stages=stages)  # fmt: skip
    return KVConnectorMetadata(loads=[KVLoad(req_id, np.array(DEST, np.int32), remote)])


def save(req_id: str) -> KVConnectorMetadata:
    return KVConnectorMetadata(saves=[KVSave(req_id, np.array(SOURCE, np.int32), 12)])


def test_one_stage_into_two(shared: bool) -> None:
    """Each of two decode stages takes its layer of the one prefill stage's two; the
    prefill rank counts both as its readers."""
    port = free_port()
    kv = caches(8, seed=21)
    producer = stage("producer", kv, port, 0, 1, shared)
    targets = [caches(8, seed=22)[:1], caches(8, seed=23)[:1]]
    before = [t[0].clone() for t in targets]
    decode = [stage("consumer", t, 0, s, 2, shared) for s, t in enumerate(targets)]
    try:
        producer.after_step(save("one"))
        for side in decode:
            side.before_step(load("one", port, 1))
        for side in decode:
            until(side, lambda outs: names(outs, "finished_recving") == ["one"])
            # Its layer alone travels (tcp), or is read (same host: in place, though the
            # pull asked for that layer, as one to a producer on another host would).
            assert sum(side.puller.num_bytes.values()) == len(SOURCE) * BLOCK_BYTES // NUM_LAYERS
            assert (side.puller.num_pulled["tcp"] == 0) == shared
        assert names(until(producer, bool), "finished_sending") == ["one"]
    finally:
        for side in (*decode, producer):
            side.shutdown()
    for layer, (target, old) in enumerate(zip(targets, before, strict=True)):
        assert torch.equal(target[0][:, DEST], kv[layer][:, SOURCE])
        others = [b for b in range(8) if b not in DEST]
        assert torch.equal(target[0][:, others], old[:, others])


def test_a_first_pull_from_another_host_carries_its_layers_alone(shared: bool) -> None:
    """A decode stage that may share the producer's host asks its first pull with the
    layers it takes: a producer on another host answers with those alone over tcp (not the
    whole staging), after which the puller knows it is over tcp."""
    if not shared:
        pytest.skip("a puller without shared memory splits over tcp from the first pull")
    port = free_port()
    kv = caches(8, seed=41)
    producer = stage("producer", kv, port, 0, 1, shared)
    assert producer.server is not None
    producer.server._host_id = "another host"  # its pulls' host ids are not its own
    target = caches(8, seed=42)[1:]
    decode = stage("consumer", target, 0, 1, 2, shared)
    try:
        producer.after_step(save("far"))
        decode.before_step(load("far", port, 1))
        until(decode, lambda outs: names(outs, "finished_recving") == ["far"])
        puller = decode.puller
        assert puller is not None and puller.num_pulled["tcp"] == 1
        assert puller.num_bytes["tcp"] == len(SOURCE) * BLOCK_BYTES // NUM_LAYERS
        assert f"tcp://127.0.0.1:{port}" in puller._over_tcp
        assert names(until(producer, bool), "finished_sending") == ["far"]
    finally:
        decode.shutdown()
        producer.shutdown()
    assert torch.equal(target[0][:, DEST], kv[1][:, SOURCE])


def test_two_stages_into_one(shared: bool) -> None:
    """The one decode stage takes layer 0 from prefill stage 0 and layer 1 from stage 1,
    each of which lets its staging go on that one reader's KVDone."""
    port = free_port()
    kv = caches(8, seed=31)
    prefill = [stage("producer", kv[s : s + 1], port, s, 2, shared) for s in range(2)]
    target = caches(8, seed=32)
    decode = stage("consumer", target, 0, 0, 1, shared)
    try:
        for side in prefill:
            side.after_step(save("two"))
        decode.before_step(load("two", port, 2))
        until(decode, lambda outs: names(outs, "finished_recving") == ["two"])
        for side in prefill:
            assert names(until(side, bool), "finished_sending") == ["two"]
        pulled = decode.puller.num_pulled
        assert pulled["tcp" if not shared else "memfd"] + pulled["cuda_ipc"] == 2
    finally:
        for side in (decode, *prefill):
            side.shutdown()
    for layer in range(NUM_LAYERS):
        assert torch.equal(target[layer][:, DEST], kv[layer][:, SOURCE])


def test_a_stage_told_no_model_layer_count_is_refused(shared: bool) -> None:
    """A stage's connector maps layers by the model's count: one whose cache does not
    match its share of that count (here: none given) is refused at construction."""
    config = KVTransferConfig(role="consumer", port=0, timeout_s=2.0, shared_memory=shared)
    kv = caches(4, seed=41)
    with pytest.raises(ValueError, match="stage 1 of 2 holds 1 of the model's 2 layers, its "
                       "cache 2: give num_layers"):  # fmt: skip
        ZmqKVConnector(config, lambda: kv, SPEC, tp_rank=0, tp_size=1, keys=KEYS,
                       pp_rank=1, pp_size=2)  # fmt: skip
