"""The tp ranks' KV reports combined (kv_transfer/tp_reports.py), two ranks as two
threads exchanging through a stand-in for their process group, each over a connector
whose reports the test sets: a load cancelled after one rank copied it is forgotten on
every rank, so that the same request id loaded again is reported only once every rank
has copied it anew, and no exchange is left outstanding for it; a withdrawn save that no
step staged is reported sent once every rank says so."""

from __future__ import annotations

import threading

import numpy as np
import torch
import torch.distributed as dist

from messages.kv_transfer import KVConnectorMetadata, KVConnectorOutput, KVLoad, RemoteKV
from zmqworker.kv_transfer.connector import KVConnector
from zmqworker.kv_transfer.tp_reports import TPCombined


class Reports(KVConnector):
    """A rank's connector whose next report the test sets; as the ZeroMQ one, a cancel
    drops a cancelled load's reports not taken yet, and reports at once a withdrawn save
    it never staged."""

    served = frozenset({"loads", "cancel_loads", "saves", "cancel_saves"})

    def __init__(self) -> None:
        self.next = KVConnectorOutput()

    def cancel(self, metadata: KVConnectorMetadata) -> None:
        gone = set(metadata.cancel_loads)
        self.next.finished_recving = [r for r in self.next.finished_recving if r not in gone]
        self.next.finished_sending += metadata.cancel_saves

    def before_step(self, metadata: KVConnectorMetadata | None) -> None:
        pass

    def after_step(self, metadata: KVConnectorMetadata | None) -> None:
        pass

    def take_output(self, wait_s: float = 0.0) -> KVConnectorOutput | None:
        out, self.next = self.next, KVConnectorOutput()
        return out if out else None

    def shutdown(self) -> None:
        pass


class Group:
    """all_gather between threads, each a rank: it blocks until every rank has joined."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._joined = threading.Barrier(size, timeout=10.0)
        self._slots: list[torch.Tensor | None] = [None] * size
        self.rank = threading.local()
        self.gathers = [0] * size

    def all_gather(self, out: list[torch.Tensor], tensor: torch.Tensor, group: Group) -> None:
        rank = self.rank.value
        self.gathers[rank] += 1
        self._slots[rank] = tensor.clone()
        self._joined.wait()
        for dest, slot in zip(out, self._slots, strict=True):
            dest.copy_(slot)
        self._joined.wait()


def rank_steps(group: Group, rank: int, steps: dict) -> None:
    """Rank's steps: (the combined report, exchanges made) of each."""
    group.rank.value = rank
    inner = Reports()
    tp = TPCombined(inner, group, torch.device("cpu"))  # type: ignore[arg-type]
    remote = RemoteKV("r@x.1", 4, ["tcp://127.0.0.1:1"])
    load = KVConnectorMetadata(loads=[KVLoad("r", np.array([1], np.int32), remote)])
    orders = [
        (load, 0),  # rank 0's copy alone: not reported
        (KVConnectorMetadata(cancel_loads=["r"]), None),  # after a failed step
        (load, 1),  # sent again under its id: rank 1's copy alone
        (KVConnectorMetadata(), 0),  # and rank 0's
        (KVConnectorMetadata(cancel_saves=["s@x.2"]), None),  # never staged
    ]
    steps[rank] = []
    for metadata, copier in orders:
        tp.cancel(metadata)
        tp.before_step(metadata)
        if copier == rank:
            inner.next.finished_recving.append("r")
        gathers = group.gathers[rank]
        steps[rank].append((tp.take_output(), group.gathers[rank] - gathers))


def test_a_cancelled_load_is_forgotten_on_every_rank(monkeypatch) -> None:
    group = Group(2)
    monkeypatch.setattr(dist, "all_gather", group.all_gather)
    monkeypatch.setattr(dist, "get_world_size", lambda g: g.size)
    steps: dict[int, list] = {}
    ranks = [threading.Thread(target=rank_steps, args=(group, r, steps)) for r in range(2)]
    for thread in ranks:
        thread.start()
    for thread in ranks:
        thread.join(timeout=30.0)
    loaded = KVConnectorOutput(finished_recving=["r"])
    withdrawn = KVConnectorOutput(finished_sending=["s@x.2"])
    expected = [(None, 2), (None, 0), (None, 2), (loaded, 2), (withdrawn, 2)]
    assert steps == {0: expected, 1: expected}
