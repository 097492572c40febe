"""The ZeroMQ KV connector: a prefill rank serves its finished prefills' KV (server.py),
a decode rank pulls it from the prefill rank of the same tp rank (puller.py).

The decode side pulls, as vLLM's NIXL connector reads: the decode instance knows where
the KV must land (its own block ids, allocated when it takes the request) and when it
has room, so the prefill side never holds a peer's block ids or waits on its memory; the
prefill side only keeps what it computed until it is taken or times out. Over tcp the
staged bytes travel as one zero-copy frame; on one host the puller maps the prefill's
memfd and copies straight into its cache. A load's first num_cached_blocks blocks hold
their KV already (prefix-cache hits on the decode side): only the rest is copied in, and
over a memfd only that part of the staged KV is read (over tcp the whole staged prompt
still travels).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import torch

from messages import KVCacheSpec
from messages.kv_transfer import (
    KVConnectorMetadata,
    KVConnectorOutput,
    KVFailure,
    KVLoad,
    KVSave,
    KVTransferConfig,
)
from zmqworker.kv_transfer.blocks import gather, layout_of, scatter, staged_nbytes, view_staged
from zmqworker.kv_transfer.connector import KVConnector
from zmqworker.kv_transfer.puller import Arrived, KVPuller
from zmqworker.kv_transfer.server import KVServer
from zmqworker.transport.curve import KVKeys


class ZmqKVConnector(KVConnector):
    def __init__(
        self,
        config: KVTransferConfig,
        kv_caches: Callable[[], list[torch.Tensor]],
        spec: KVCacheSpec,
        tp_rank: int,
        tp_size: int,
        keys: KVKeys | None,
    ) -> None:
        """kv_caches: the rank's cache tensors now (sleep and wake_up make new ones)."""
        if not kv_caches():
            raise ValueError("the KV connector needs the KV cache: make it after the cache")
        self.config = config
        self.kv_caches = kv_caches
        self.layout = layout_of(spec)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self._news = threading.Event()  # a transfer ended: a waiting take_output wakes
        self._lock = threading.Lock()
        self._sent: list[str] = []
        self._recved: list[str] = []
        self._failed: list[KVFailure] = []
        self._loading: dict[str, KVLoad] = {}
        # Loads the scheduler gave up on (cancel_loads), by identity: what arrives for
        # them is dropped (a later load of the same request id is not).
        self._cancelled: set[int] = set()
        self._num_staged = 0
        self.server: KVServer | None = None
        self.puller: KVPuller | None = None
        try:
            if config.produces:
                self.server = KVServer(
                    config.address(tp_rank),
                    tp_rank,
                    self.layout,
                    keys,
                    self._on_sent,
                    config.timeout_s,
                )
            if config.consumes:
                self.puller = KVPuller(
                    tp_rank, self.layout, keys, config.timeout_s, config.shared_memory,
                    on_arrival=self._news.set,
                )  # fmt: skip
        except BaseException:
            self.shutdown()
            raise

    def before_step(self, metadata: KVConnectorMetadata | None) -> None:
        if metadata is not None:
            for req_id in metadata.cancel_loads:
                self._cancel(req_id)
            for load in metadata.loads:
                self._start_load(load)
        self._copy_arrived()

    def after_step(self, metadata: KVConnectorMetadata | None) -> None:
        if metadata is None or not metadata.saves:
            return
        if self.server is None:
            raise RuntimeError(f"KV saves sent to a {self.config.role} (not a producer)")
        for save in metadata.saves:
            self._stage(save)

    def take_output(self, wait_s: float = 0.0) -> KVConnectorOutput | None:
        if wait_s > 0 and not self._has_news() and (self._loading or self._num_staged):
            self._news.wait(wait_s)
        self._news.clear()
        self._copy_arrived()
        with self._lock:
            sent, self._sent = self._sent, []
        self._num_staged -= len(sent)
        recved, failed = self._recved, self._failed
        self._recved, self._failed = [], []
        output = KVConnectorOutput(sent, recved, failed)
        return output if output else None

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.puller is not None:
            self.puller.close()
            self.puller = None

    # helpers ------------------------------------------------------------------------

    def _on_sent(self, req_id: str) -> None:
        with self._lock:
            self._sent.append(req_id)
        self._news.set()

    def _has_news(self) -> bool:
        with self._lock:
            return bool(self._sent or self._recved or self._failed)

    def _start_load(self, load: KVLoad) -> None:
        if self.puller is None:
            raise RuntimeError(f"KV loads sent to a {self.config.role} (not a consumer)")
        remote_tp = len(load.remote.addresses)
        if remote_tp != self.tp_size:
            self._failed.append(KVFailure(load.req_id, _tp_mismatch(remote_tp, self.tp_size)))
            return
        self._loading[load.req_id] = load
        self.puller.pull(load)

    def _cancel(self, req_id: str) -> None:
        """Drop the load of req_id under way, and any report of it not yet taken."""
        load = self._loading.pop(req_id, None)
        if load is not None:
            self._cancelled.add(id(load))
        self._recved = [r for r in self._recved if r != req_id]
        self._failed = [f for f in self._failed if f.req_id != req_id]

    def _copy_arrived(self) -> None:
        if self.puller is None:
            return
        while not self.puller.arrived.empty():
            arrived = self.puller.arrived.get()
            if id(arrived.load) in self._cancelled:
                self._cancelled.discard(id(arrived.load))
                arrived.release()
                if arrived.error is None:
                    self.puller.done(arrived.load)
                continue
            self._loading.pop(arrived.load.req_id, None)
            if arrived.error is not None:
                self._failed.append(KVFailure(arrived.load.req_id, arrived.error))
                continue
            self._copy_in(arrived)

    def _copy_in(self, arrived: Arrived) -> None:
        load = arrived.load
        try:
            staged = view_staged(arrived.buffer, self.layout, len(load.block_ids))
            start = load.num_cached_blocks  # the blocks before it hold their KV here
            ids = torch.from_numpy(np.asarray(load.block_ids[start:], np.int64))
            scatter(self.kv_caches(), ids, staged[:, :, start:])
            del staged
        finally:
            arrived.release()
        assert self.puller is not None
        self.puller.done(load)
        self._recved.append(load.req_id)

    def _stage(self, save: KVSave) -> None:
        assert self.server is not None
        num_blocks = len(save.block_ids)
        nbytes = staged_nbytes(self.layout, num_blocks)
        staged = self.server.stage(save.req_id, nbytes, num_blocks)
        try:
            view = view_staged(memoryview(staged.memory), self.layout, num_blocks)
            gather(self.kv_caches(), torch.from_numpy(np.asarray(save.block_ids, np.int64)), view)
            del view
        except BaseException:
            self.server.pool.give_back(staged.fd, staged.memory)
            raise
        self._num_staged += 1
        self.server.offer(staged)


def _tp_mismatch(remote_tp: int, tp: int) -> str:
    return (
        f"the prefill instance has tensor parallel size {remote_tp}, this decode instance "
        f"{tp}: KV moves tp rank i to tp rank i, so the sizes must match (resharding heads "
        "between sizes is not done yet)"
    )
