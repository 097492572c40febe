"""Copies made ahead of their answers (kv_transfer/read_ahead.py), over real sockets in
one process, out of a producer's host cache in a memfd: a load that names the prefill's
block ids is copied as its pull goes out once that cache is open here, and the answer
confirms it; an answer that names other blocks, or a cache made anew, has its blocks
copied again from where it says; a refusal fails the load all the same; a copy lets the
producer's cache go once it has run (on a GPU, as the puller's thread sees it run), and a
load cancelled meanwhile is forgotten; a load whose producer's cache is not open waits
for its answer. No hold on a producer's cache outlives the loads."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
import pytest
import torch

from messages.kv_transfer import KVConnectorMetadata, KVLoad, RemoteKV
from tests.test_kv_connector import names, until
from tests.test_kv_host_cache import SHAPE, SPEC, Producer, consumer, free_port, shared_cache
from zmqworker.kv_transfer import peer_caches
from zmqworker.kv_transfer.copies_run import CopiesRun
from zmqworker.kv_transfer.zmq_connector import ZmqKVConnector


class Pair(NamedTuple):
    producer: Producer
    side: ZmqKVConnector  # the consumer
    target: list[torch.Tensor]  # its cache
    port: int

    def load(self, req: str, dest: list[int], source: list[int] | None, cached: int = 0):
        """A load of dest, the prefill's blocks named (source) or not (None)."""
        ids = None if source is None else np.array(source, np.int32)
        address = f"tcp://127.0.0.1:{self.port}"
        remote = RemoteKV(req, len(dest) * SPEC.block_size, [address], ids)
        return KVLoad(req, np.array(dest, np.int32), remote, num_cached_blocks=cached)

    def pull(self, req: str, dest: list[int], source: list[int] | None, cached: int = 0):
        self.side.before_step(KVConnectorMetadata(loads=[self.load(req, dest, source, cached)]))

    def landed(self, req: str) -> None:
        until(self.side, lambda outs: names(outs, "finished_recving") == [req])

    def holds_none(self) -> bool:
        """Whether nothing holds a producer's cache open here (the loads are over)."""
        caches = self.side.puller.peer_caches
        return all(c.users == 0 for c in [*caches._open.values(), *caches._retired])


@pytest.fixture
def pair(monkeypatch) -> Iterator[Pair]:
    """A producer and a consumer that has its cache open (a first pull, not ahead), kept
    open however slowly the test runs."""
    monkeypatch.setattr(peer_caches, "IDLE_CLOSE_S", 600.0)
    port = free_port()
    producer = Producer(port)
    target = [torch.zeros(SHAPE) for _ in SPEC.layer_names]
    pair = Pair(producer, consumer(target), target, port)
    try:
        producer.stage("first", [0])
        pair.pull("first", [15], [0])
        pair.landed("first")
        assert pair.side.read_ahead.num_copied == 0  # nothing was open to copy from ahead
        yield pair
    finally:
        pair.side.shutdown()
        producer.close()


@pytest.mark.parametrize("cached", [0, 2], ids=["all", "after-hits"])
def test_a_load_naming_the_prefill_s_blocks_is_copied_ahead_and_confirmed(pair, cached) -> None:
    source, dest = [7, 2, 3, 8], [1, 5, 6, 14]
    pair.producer.stage("r", source)
    pair.pull("r", dest, source, cached)
    pair.landed("r")
    assert (pair.side.read_ahead.num_copied, pair.side.read_ahead.num_stood) == (1, 1)
    assert pair.side.puller.num_pulled["host_cache"] == 2
    producer = pair.producer.side
    until(producer, lambda outs: "r" in names(outs, "finished_sending"))
    for mine, theirs in zip(pair.target, pair.producer.shared.layers, strict=True):
        assert torch.equal(mine[:, dest[cached:]], theirs[:, source[cached:]])
        assert not mine[:, dest[:cached]].any()  # held here already: untouched
    assert pair.holds_none()


@pytest.mark.parametrize("change", ["other-blocks", "new-cache"])
def test_a_copy_ahead_the_answer_contradicts_is_made_again(pair, change, monkeypatch) -> None:
    """other-blocks: the load names blocks the producer did not stage; new-cache: the
    producer made its cache anew (a wake-up), so the copy ahead read the old one. The
    answer waits for the copy ahead: on a loaded machine it could otherwise come first,
    and the copy would read the new cache, which its answer then confirms."""
    named, staged = [9, 10], [4, 5] if change == "other-blocks" else [9, 10]
    if change == "new-cache":
        old, pair.producer.shared = pair.producer.shared, shared_cache(seed=2)
        old.close()
    server, copied = pair.producer.side.server, threading.Event()
    answer = server._answer
    monkeypatch.setattr(server, "_answer", lambda *args: copied.wait(10) and answer(*args))
    pair.producer.stage("r", staged)
    pair.pull("r", [11, 12], named)
    copied.set()
    pair.landed("r")
    assert (pair.side.read_ahead.num_copied, pair.side.read_ahead.num_stood) == (1, 0)
    for mine, theirs in zip(pair.target, pair.producer.shared.layers, strict=True):
        assert torch.equal(mine[:, [11, 12]], theirs[:, staged])
    assert pair.holds_none()


def test_a_copy_ahead_of_a_refusal_fails_its_load(pair) -> None:
    """The prefill's staged KV was withdrawn (a failed step there): the blocks were
    copied ahead, the answer refuses, and the load fails naming why."""
    pair.producer.stage("r", [3])
    pair.producer.side.cancel(KVConnectorMetadata(cancel_saves=["r"]))
    pair.pull("r", [4], [3])
    [failure] = names(until(pair.side, bool), "failed_recving")
    assert failure.req_id == "r" and "was withdrawn" in failure.error
    assert (pair.side.read_ahead.num_copied, pair.side.read_ahead.num_stood) == (1, 0)
    assert pair.holds_none()


def test_a_load_without_the_prefill_s_blocks_waits_for_its_answer(pair) -> None:
    pair.producer.stage("r", [6])
    pair.pull("r", [7], None)
    pair.landed("r")
    assert pair.side.read_ahead.num_copied == 0
    for mine, theirs in zip(pair.target, pair.producer.shared.layers, strict=True):
        assert torch.equal(mine[:, 7], theirs[:, 6])


def test_a_load_cancelled_after_its_copy_ahead_is_forgotten(pair) -> None:
    """The copy ahead lets the producer's cache go once it has run, before its answer is
    judged. The engine gives up on the load (a failed step) before its answer is taken:
    the copy is forgotten, the answer that comes is dropped (KVDone said, so the producer
    lets its blocks go), and nothing is reported of it."""
    pair.pull("r", [4], [3])  # before it is staged: its answer waits for the staging
    [held] = pair.side.puller.peer_caches._open.values()
    assert held.users == 0 and pair.side.read_ahead.num_copied == 1
    assert pair.side.read_ahead._ahead  # not judged yet
    pair.side.cancel(KVConnectorMetadata(cancel_loads=["r"]))
    assert not pair.side.read_ahead._ahead
    pair.producer.stage("r", [3])
    sent: list[str] = []
    deadline = time.monotonic() + 10
    while "r" not in sent:  # the consumer drops the answer, saying KVDone
        assert time.monotonic() < deadline, "the producer never heard KVDone"
        assert pair.side.take_output(wait_s=0.02) is None  # nothing reported of "r"
        out = pair.producer.side.take_output(wait_s=0.02)
        sent += [] if out is None else out.finished_sending
    assert pair.side.read_ahead.num_stood == 0 and pair.holds_none()


class StandInEvent:
    """A CUDA event's stand-in: passed once the test says so."""

    def __init__(self) -> None:
        self.passed = False

    def query(self) -> bool:
        return self.passed

    def synchronize(self) -> None:
        self.passed = True


def test_what_waits_for_a_device_copy_follows_once_it_has_run() -> None:
    """The puller's watch over device copies (copies_run.py): each copy's then() is
    called once its event has passed, in any order, and closing waits for the rest."""
    copies, called = CopiesRun(), []
    events = [StandInEvent() for _ in range(3)]
    for i, event in enumerate(events):
        copies.add(event, lambda i=i: called.append(i))
    copies.poll()
    assert called == [] and copies.watched
    events[1].passed = True
    copies.poll()
    assert called == [1] and copies.watched
    copies.close()
    assert sorted(called) == [0, 1, 2] and not copies.watched


def test_a_then_that_raises_leaves_the_others_called_once() -> None:
    copies, called = CopiesRun(), []

    def fails() -> None:
        called.append("fails")
        raise RuntimeError("a release failed")

    events = [StandInEvent(), StandInEvent()]
    copies.add(events[0], fails)
    copies.add(events[1], lambda: called.append("other"))
    events[0].passed = True
    with pytest.raises(RuntimeError, match="a release failed"):
        copies.poll()
    copies.close()
    assert called == ["fails", "other"]
