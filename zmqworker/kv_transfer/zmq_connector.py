"""The ZeroMQ KV connector: a prefill rank serves its finished prefills' KV (server.py),
a decode rank pulls it (puller.py) from the prefill rank of the same tp rank and stage,
or, where the two instances' tensor parallel sizes (or pipeline stages) differ, its heads
of its layers from the prefill ranks that hold them (head_map.py).

The decode side pulls, as vLLM's NIXL connector reads: the decode instance knows where
the KV must land (its own block ids, allocated when it takes the request) and when it
has room, so the prefill side never holds a peer's block ids or waits on its memory; the
prefill side only keeps what it computed until it is taken or times out. Over tcp the
bytes a pull takes travel as one frame (zero-copy where that is the whole staging); on
one host the puller maps the prefill's memfd and copies straight into its cache, or
copies from the prefill's cache itself into its own: where both caches are on GPUs it
can open, on the device (CUDA IPC), saying KVDone once that copy has run; where both are
in host memory and the prefill's lies in a memfd (a producer's host cache does), from
its mapping. A
load's first num_cached_blocks blocks hold their KV already (prefix-cache hits on the
decode side): only the rest is copied in; the pull names them (KVPull.first_block), so
over tcp only the blocks after them travel, and through a memfd only they are read.
Where a producer's cache is open here already and the load names its block ids, the
blocks are copied as the pull goes out, and its answer judges the copy (read_ahead.py).
"""

from __future__ import annotations

import logging
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
from zmqworker.distributed.shared_cache import SharedKVCache
from zmqworker.kv_transfer import device_copies
from zmqworker.kv_transfer.arrived import Arrived
from zmqworker.kv_transfer.blocks import (
    copy_from_peer,
    layout_of,
    scatter,
    scatter_heads,
    view_staged,
)
from zmqworker.kv_transfer.connector import KVConnector
from zmqworker.kv_transfer.head_map import HeadMapError, HeadSource, stage_map
from zmqworker.kv_transfer.peer_sockets import address_error
from zmqworker.kv_transfer.puller import KVPuller
from zmqworker.kv_transfer.read_ahead import ReadAhead
from zmqworker.kv_transfer.server import KVServer
from zmqworker.models.llama import pp_layer_range
from zmqworker.transport.curve import KVKeys

log = logging.getLogger("zmqworker.kv_transfer")


class ZmqKVConnector(KVConnector):
    def __init__(
        self,
        config: KVTransferConfig,
        kv_caches: Callable[[], list[torch.Tensor]],
        spec: KVCacheSpec,
        tp_rank: int,
        tp_size: int,
        keys: KVKeys | None,
        num_kv_heads: int | None = None,
        shared_cache: Callable[[], SharedKVCache | None] = lambda: None,
        pp_rank: int = 0,
        pp_size: int = 1,
        num_layers: int | None = None,
    ) -> None:
        """kv_caches: the rank's cache tensors now (sleep and wake_up make new ones).
        num_kv_heads: the model's (all ranks'); None: spec's times tp_size (no replicated
        heads). shared_cache: the memfd holding a host cache now, if one does. pp_rank of
        pp_size: the rank's pipeline stage; it serves at the address of the instance's
        rank pp_rank * tp_size + tp_rank, and pulls its layers from the prefill's stages
        holding them (head_map.py). num_layers: the model's (None: spec's, one stage)."""
        if not kv_caches():
            raise ValueError("the KV connector needs the KV cache: make it after the cache")
        self.config = config
        self.kv_caches = kv_caches
        self.layout = layout_of(spec)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.pp_rank, self.pp_size = pp_rank, pp_size
        self.num_kv_heads = num_kv_heads or spec.num_kv_heads * tp_size
        self.num_layers = num_layers or self.layout.num_layers
        first, end = pp_layer_range(self.num_layers, pp_rank, pp_size)
        if end - first != self.layout.num_layers:
            raise ValueError(
                f"stage {pp_rank} of {pp_size} holds {end - first} of the model's "
                f"{self.num_layers} layers, its cache {self.layout.num_layers}: give num_layers"
            )
        self._news = threading.Event()  # a transfer ended: a waiting take_output wakes
        self._lock = threading.Lock()
        self._sent: list[str] = []
        self._recved: list[str] = []
        self._failed: list[KVFailure] = []
        self._loading: dict[str, KVLoad] = {}
        # The pieces still to come of every load pulled, by identity: of a load no longer
        # in _loading (cancelled: cancel_loads; or failed by another piece), what arrives
        # is dropped (a later load of the same request id is not).
        self._pieces_left: dict[int, int] = {}
        self._offered: set[str] = set()  # saves offered and not reported sent yet
        device = kv_caches()[0].device
        locked_for = device if device.type == "cuda" else None  # page-lock host memory
        self.server: KVServer | None = None
        self.puller: KVPuller | None = None
        self.read_ahead: ReadAhead | None = None
        try:
            if config.produces:
                rank = pp_rank * tp_size + tp_rank
                self.server = KVServer(
                    config.address(rank),
                    rank,
                    self.layout,
                    keys,
                    self._on_sent,
                    config.timeout_s,
                    kv_caches,
                    config.cuda_ipc,
                    shared_cache,
                )
            if config.consumes:
                if locked_for is not None and config.shared_memory and config.cuda_ipc:
                    device_copies.warm_up_copies(kv_caches())
                self.puller = KVPuller(
                    tp_rank, self.layout, keys, config.timeout_s, config.shared_memory,
                    on_arrival=self._news.set, device=locked_for,
                    cuda_ipc=config.cuda_ipc,
                )  # fmt: skip
                self.read_ahead = ReadAhead(self.puller, kv_caches, self.layout.num_kv_heads)
        except BaseException:
            self.shutdown()
            raise

    @property
    def served(self) -> frozenset[str]:
        saves = {"saves", "cancel_saves"} if self.server is not None else set()
        loads = {"loads", "cancel_loads"} if self.puller is not None else set()
        return frozenset(saves | loads)

    def cancel(self, metadata: KVConnectorMetadata) -> None:
        for req_id in metadata.cancel_loads:
            self._cancel(req_id)
        for req_id in metadata.cancel_saves:
            self._withdraw(req_id)

    def before_step(self, metadata: KVConnectorMetadata | None) -> None:
        if metadata is not None:
            pulled = [(load, self._start_load(load)) for load in metadata.loads]
            if self.read_ahead is not None:
                self.read_ahead.start([(load, reads) for load, reads in pulled if reads])
        self._copy_arrived()

    def after_step(self, metadata: KVConnectorMetadata | None) -> None:
        if metadata is None or not metadata.saves:
            return
        for save in metadata.saves:
            self._stage(save)

    def take_output(self, wait_s: float = 0.0) -> KVConnectorOutput | None:
        if wait_s > 0 and not self._has_news() and (self._loading or self._offered):
            self._news.wait(wait_s)
        self._news.clear()
        self._copy_arrived()
        with self._lock:
            sent, self._sent = self._sent, []
        self._offered.difference_update(sent)
        recved, failed = self._recved, self._failed
        self._recved, self._failed = [], []
        output = KVConnectorOutput(sent, recved, failed)
        return output if output else None

    @property
    def num_cache_readers(self) -> int:
        return len(self._offered)

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.read_ahead is not None:
            self.read_ahead.close()
            self.read_ahead = None
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

    def _start_load(self, load: KVLoad) -> tuple[HeadSource, ...]:
        """Pull load (or fail it at once); the sources its pieces are pulled from."""
        assert self.puller is not None  # take_orders refused loads to a producer
        remote = load.remote
        bad = [e for e in map(address_error, remote.addresses) if e is not None]
        if not remote.addresses or bad:  # refused here: the puller's thread would meet it
            error = f"the prefill address {bad[0]}" if bad else "its RemoteKV names no address"
            self._failed.append(KVFailure(load.req_id, f"KV of request {load.req_id!r}: {error}"))
            return ()
        prefill = (len(remote.addresses) // remote.pipeline_stages, remote.pipeline_stages)
        try:
            heads = stage_map(self.num_kv_heads, self.num_layers, prefill,
                              (self.tp_size, self.pp_size), self.tp_rank, self.pp_rank)  # fmt: skip
        except HeadMapError as e:
            error = (f"the prefill instance has tensor parallel size {prefill[0]} and "
                     f"{prefill[1]} pipeline stage(s), this decode instance {self.tp_size} "
                     f"and {self.pp_size}: {e}")  # fmt: skip
            self._failed.append(KVFailure(load.req_id, error))
            return ()
        self._loading[load.req_id] = load
        self._pieces_left[id(load)] = len(heads.reads)
        self.puller.pull(load, heads)
        return heads.reads

    def _cancel(self, req_id: str) -> None:
        """Drop the load of req_id under way, and any report of it not yet taken."""
        load = self._loading.pop(req_id, None)
        if load is not None and self.read_ahead is not None:
            self.read_ahead.cancel(load)
        self._recved = [r for r in self._recved if r != req_id]
        self._failed = [f for f in self._failed if f.req_id != req_id]

    def _withdraw(self, req_id: str) -> None:
        """The engine gave up on req_id's save: its server stops serving it (and reports
        it sent once nothing reads its blocks); never offered, it is reported at once."""
        if self.server is not None and req_id in self._offered:
            self.server.withdraw(req_id)
        else:
            self._on_sent(req_id)

    def _copy_arrived(self) -> None:
        if self.puller is None or self.read_ahead is None:
            return
        while not self.puller.arrived.empty():
            arrived = self.puller.arrived.get()
            load = arrived.load
            left = self._pieces_left.pop(id(load)) - 1
            if left:
                self._pieces_left[id(load)] = left
            ahead = self.read_ahead.stood(arrived, self.config.timeout_s)
            stale = None if ahead is not None else arrived.stale(self.config.timeout_s)
            if arrived.error is None and stale:
                self._let_go(arrived)
                arrived.error = f"KV of request {load.req_id!r}: {stale}"
            if self._loading.get(load.req_id) is not load:  # cancelled, or failed
                if ahead is not None:
                    self.read_ahead.done(arrived, ahead)
                    continue
                arrived.release()
                if arrived.error is None:
                    self.puller.done(load, arrived.source)
            elif arrived.error is not None:
                del self._loading[load.req_id]
                self._failed.append(KVFailure(load.req_id, arrived.error))
            else:
                try:
                    if ahead is None:
                        self._copy_in(arrived)
                    else:
                        self.read_ahead.done(arrived, ahead)
                except Exception as e:  # this load fails; the step and its requests go on
                    log.exception("rank %d: copying in the KV of %r", self.tp_rank, load.req_id)
                    del self._loading[load.req_id]
                    error = f"KV of request {load.req_id!r}: copying it in failed: {e}"
                    self._failed.append(KVFailure(load.req_id, error))
                    continue
                if not left:
                    del self._loading[load.req_id]
                    self._recved.append(load.req_id)

    def _copy_in(self, arrived: Arrived) -> None:
        load = arrived.load
        start = load.num_cached_blocks  # the blocks before it hold their KV here
        if arrived.sources is not None:
            self._copy_in_place(arrived, start)
            return
        try:
            if start < len(load.block_ids):
                self._scatter(arrived, start)
        finally:  # copied or not, nothing reads the staging any more
            self._let_go(arrived)

    def _scatter(self, arrived: Arrived, start: int) -> None:
        """Copy the load's blocks from start on out of arrived (which holds them from
        its first_block on) into their block ids."""
        load, source, layout = arrived.load, arrived.source, arrived.layout
        assert layout is not None
        held = len(load.block_ids) - arrived.first_block
        taken, mine = source.layer_slices(self.layout.num_layers)
        shift = arrived.first_layer  # the staged layer the buffer's first one is
        staged = view_staged(arrived.buffer, layout, held)[
            taken.start - shift : taken.stop - shift, :, start - arrived.first_block :
        ]
        kv_caches = self.kv_caches()[mine]
        ids = torch.from_numpy(np.asarray(load.block_ids[start:], np.int64))
        if source.count == self.layout.num_kv_heads == layout.num_kv_heads:
            scatter(kv_caches, ids, staged)
        else:
            scatter_heads(kv_caches, ids, staged, arrived.first, source.dest, source.count)

    def _copy_in_place(self, arrived: Arrived, start: int) -> None:
        """Copy the load's blocks from start on out of the producer's cache (arrived.sources,
        opened here; its blocks arrived.source_ids), and let arrived go; on a GPU the copy
        is queued, and the puller lets arrived go once it has run."""
        load, source, sources = arrived.load, arrived.source, arrived.sources
        assert sources is not None and arrived.source_ids is not None
        copied = None
        try:
            if start < len(load.block_ids):
                heads = source.heads(sources.num_kv_heads, self.layout.num_kv_heads)
                ids = np.asarray(load.block_ids[start:], np.int64)
                taken, mine = source.layer_slices(self.layout.num_layers)
                copied = copy_from_peer(self.kv_caches()[mine], ids, sources,
                                        arrived.source_ids[start:], heads, taken)  # fmt: skip
        except BaseException:
            if self.kv_caches()[0].device.type == "cuda":
                torch.cuda.current_stream(self.kv_caches()[0].device).synchronize()
            self._let_go(arrived)
            raise
        assert self.puller is not None
        self.puller.done_once_run(copied, arrived)

    def _let_go(self, arrived: Arrived) -> None:
        arrived.release()
        if self.puller is not None:
            self.puller.done(arrived.load, arrived.source)

    def _stage(self, save: KVSave) -> None:
        assert self.server is not None
        self._offered.add(save.req_id)
        self.server.offer(save.req_id, save.block_ids)
