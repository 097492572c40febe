"""Copies made ahead of their answers (kv_transfer/read_ahead.py), over real sockets in
one process, out of a producer's host cache in a memfd: a load that names the prefill's
block ids is copied as its pull goes out once that cache is open here, and the answer
confirms it; an answer that names other blocks, or a cache made anew, has its blocks
copied again from where it says; a refusal fails the load all the same; a load cancelled
meanwhile lets its copy's hold go; a load whose producer's cache is not open waits for
its answer. No hold on a producer's cache outlives the loads."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from messages.kv_transfer import KVConnectorMetadata, KVLoad, RemoteKV
from tests.test_kv_connector import names, until
from tests.test_kv_host_cache import SHAPE, SPEC, Producer, consumer, free_port, shared_cache


def load(req: str, dest: list[int], port: int, source: list[int] | None, cached: int = 0):
    ids = None if source is None else np.array(source, np.int32)
    remote = RemoteKV(req, len(dest) * SPEC.block_size, [f"tcp://127.0.0.1:{port}"], ids)
    return KVLoad(req, np.array(dest, np.int32), remote, num_cached_blocks=cached)


def pull(side, req: str, dest: list[int], port: int, source: list[int] | None, cached=0):
    side.before_step(KVConnectorMetadata(loads=[load(req, dest, port, source, cached)]))


def no_holds(side) -> None:
    """Nothing holds a producer's cache open here once the loads are over."""
    caches = side.puller.peer_caches
    assert all(c.users == 0 for c in [*caches._open.values(), *caches._retired])


def opened(side, producer: Producer, port: int) -> None:
    """A first pull from producer: its cache is open here from then on."""
    producer.stage("first", [0])
    pull(side, "first", [15], port, [0])
    until(side, lambda outs: names(outs, "finished_recving") == ["first"])
    assert side.read_ahead.num_stood == 0  # nothing was open to copy from ahead


@pytest.mark.parametrize("cached", [0, 2], ids=["all", "after-hits"])
def test_a_load_naming_the_prefill_s_blocks_is_copied_ahead_and_confirmed(cached) -> None:
    port = free_port()
    producer = Producer(port)
    target = [torch.zeros(SHAPE) for _ in SPEC.layer_names]
    side = consumer(target)
    try:
        opened(side, producer, port)
        source, dest = [7, 2, 3, 8], [1, 5, 6, 14]
        producer.stage("r", source)
        pull(side, "r", dest, port, source, cached)
        until(side, lambda outs: names(outs, "finished_recving") == ["r"])
        assert side.read_ahead.num_stood == 1
        assert side.puller.num_pulled["host_cache"] == 2
        assert "r" in names(until(producer.side, lambda o: "r" in names(o, "finished_sending")),
                            "finished_sending")  # fmt: skip
        for mine, theirs in zip(target, producer.shared.layers, strict=True):
            assert torch.equal(mine[:, dest[cached:]], theirs[:, source[cached:]])
            assert not mine[:, dest[:cached]].any()  # held here already: untouched
        no_holds(side)
    finally:
        side.shutdown()
        producer.close()


@pytest.mark.parametrize("change", ["other-blocks", "new-cache"])
def test_a_copy_ahead_the_answer_contradicts_is_made_again(change) -> None:
    """other-blocks: the load names blocks the producer did not stage; new-cache: the
    producer made its cache anew (a wake-up), so the copy ahead read the old one."""
    port = free_port()
    producer = Producer(port)
    target = [torch.zeros(SHAPE) for _ in SPEC.layer_names]
    side = consumer(target)
    try:
        opened(side, producer, port)
        named = [9, 10]
        if change == "new-cache":
            old, producer.shared = producer.shared, shared_cache(seed=2)
            old.close()
        producer.stage("r", [4, 5] if change == "other-blocks" else named)
        pull(side, "r", [11, 12], port, named)
        until(side, lambda outs: names(outs, "finished_recving") == ["r"])
        assert side.read_ahead.num_stood == 0
        staged = [4, 5] if change == "other-blocks" else named
        for mine, theirs in zip(target, producer.shared.layers, strict=True):
            assert torch.equal(mine[:, [11, 12]], theirs[:, staged])
        no_holds(side)
    finally:
        side.shutdown()
        producer.close()


def test_a_copy_ahead_of_a_refusal_fails_its_load() -> None:
    """The prefill's staged KV was withdrawn (a failed step there): the blocks were
    copied ahead, the answer refuses, and the load fails naming why."""
    port = free_port()
    producer = Producer(port)
    side = consumer([torch.zeros(SHAPE) for _ in SPEC.layer_names])
    try:
        opened(side, producer, port)
        producer.stage("r", [3])
        producer.side.before_step(KVConnectorMetadata(cancel_saves=["r"]))
        pull(side, "r", [4], port, [3])
        [failure] = names(until(side, bool), "failed_recving")
        assert failure.req_id == "r" and "was withdrawn" in failure.error
        assert side.read_ahead.num_stood == 0
        no_holds(side)
    finally:
        side.shutdown()
        producer.close()


def test_a_load_without_the_prefill_s_blocks_waits_for_its_answer() -> None:
    port = free_port()
    producer = Producer(port)
    target = [torch.zeros(SHAPE) for _ in SPEC.layer_names]
    side = consumer(target)
    try:
        opened(side, producer, port)
        producer.stage("r", [6])
        pull(side, "r", [7], port, None)
        until(side, lambda outs: names(outs, "finished_recving") == ["r"])
        assert side.read_ahead.num_stood == 0
        for mine, theirs in zip(target, producer.shared.layers, strict=True):
            assert torch.equal(mine[:, 7], theirs[:, 6])
    finally:
        side.shutdown()
        producer.close()


def test_a_load_cancelled_after_its_copy_ahead_lets_its_hold_go() -> None:
    """The engine gives up on the load (a failed step) before its answer is taken: its
    copy's hold goes at once, the answer that comes is dropped (KVDone said, so the
    producer lets its blocks go), and nothing is reported of it."""
    port = free_port()
    producer = Producer(port)
    side = consumer([torch.zeros(SHAPE) for _ in SPEC.layer_names])
    try:
        opened(side, producer, port)
        # Pulled before it is staged: its answer waits for the staging, below.
        side.before_step(KVConnectorMetadata(loads=[load("r", [4], port, [3])]))
        [held] = side.puller.peer_caches._open.values()
        assert held.users == 1 and side.read_ahead._ahead  # copied ahead, not judged
        side.before_step(KVConnectorMetadata(cancel_loads=["r"]))
        assert not side.read_ahead._ahead and held.users == 0
        producer.stage("r", [3])
        sent: list[str] = []
        deadline = time.monotonic() + 10
        while "r" not in sent:  # the consumer drops the answer, saying KVDone
            assert time.monotonic() < deadline, "the producer never heard KVDone"
            assert side.take_output(wait_s=0.02) is None  # nothing reported of "r"
            out = producer.side.take_output(wait_s=0.02)
            sent += [] if out is None else out.finished_sending
        assert side.read_ahead.num_stood == 0
        no_holds(side)
    finally:
        side.shutdown()
        producer.close()
