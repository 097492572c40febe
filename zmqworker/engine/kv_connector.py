"""The scheduler side of KV transfer (the worker side is zmqworker/kv_transfer/): which
requests' KV is to be staged for a decode instance or pulled from a prefill instance,
the blocks that stay held meanwhile, and the orders each step carries to the workers.

Prefill side: a request marked remote_decode finishes after its first token, its blocks
held; the next step orders them staged (KVSave); they are freed once the workers report
them sent (pulled, or expired unpulled after the timeout). A staging's name, which the
decode side pulls it by, is the request's id made unique to this staging (staging_name):
a decode rank may copy a staging's blocks before the answer that confirms it is the one
it was told of (kv_transfer/read_ahead.py), so no two stagings ever share a name, even of
one request id sent again.

Decode side: a request with remote KV waits in a state of its own, outside the waiting
queue, so that its transfer never holds other requests back. Blocks go first come, first
served: a waiting request that came after it waits until it has its own (order_loads,
from the scheduler). Once they are free, a step orders the pull (KVLoad); once the
workers report the KV in, it joins the front of the waiting queue with those tokens
computed. The leading blocks its prompt finds in the prefix cache (or the host tier) here
are reused, not pulled (KVLoad.num_cached_blocks). A failed pull finishes it with an
error naming it, and its blocks go: the reused ones stay cached.

A step's orders (step_orders) also carry the host tier's copies (host_tier.py).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

import numpy as np

from messages import (
    KVConnectorMetadata,
    KVConnectorOutput,
    KVLoad,
    KVSave,
    KVTransferConfig,
    RemoteKV,
)
from zmqworker.cdiv import cdiv
from zmqworker.engine.block_manager import KVBlockManager
from zmqworker.engine.host_tier import HostKVTier
from zmqworker.engine.request import FinishReason, Request, RequestStatus


class KVConnectorScheduler:
    def __init__(
        self,
        block_manager: KVBlockManager,
        addresses: list[str],
        consumes: bool = True,
        pipeline_stages: int = 1,
    ) -> None:
        """addresses: where this instance's ranks serve staged KV (a producer's), in rank
        order (RemoteKV's, over pipeline_stages stages); empty for an instance that only
        consumes. consumes: whether its workers pull remote KV (a consumer's)."""
        self.kv = block_manager
        self.addresses = addresses
        self.consumes = consumes
        self.pipeline_stages = pipeline_stages
        self._to_load: dict[str, Request] = {}  # waiting for blocks, in arrival order
        # Pull ordered, not reported yet: the request and its load.
        self._loading: dict[str, tuple[Request, KVLoad]] = {}
        self._sending: dict[str, Request] = {}  # by staging name: blocks held until sent
        self._incarnation = secrets.token_hex(4)  # of this scheduler, in staging names
        self._num_staged = 0
        self._aborted: set[str] = set()  # loading when aborted: freed once reported
        self._saves: list[KVSave] = []
        self._loads: list[KVLoad] = []
        self._cancels: list[str] = []  # loads given up on: the next step tells the workers
        self._withdrawn: list[str] = []  # saves given up on: the next step tells them too
        self.num_loaded = 0  # requests whose remote KV came in, since start
        # Since start, over the loads that came in: the blocks that held their KV here
        # already (prefix-cache or host-tier hits), and those pulled.
        self.num_hit_blocks = 0
        self.num_pulled_blocks = 0

    @classmethod
    def of(
        cls,
        config: KVTransferConfig,
        block_manager: KVBlockManager,
        world_size: int,
        pipeline_stages: int,
    ) -> KVConnectorScheduler:
        """The scheduler side for an instance of world_size workers over pipeline_stages
        stages, given config."""
        produces = range(world_size) if config.produces else range(0)
        addresses = [config.address(rank) for rank in produces]
        return cls(block_manager, addresses, config.consumes, pipeline_stages)

    @property
    def busy(self) -> bool:
        """Whether transfers are under way: steps must go on to hear of their end."""
        return bool(self._to_load or self._loading or self._sending or self._saves)

    @property
    def num_pulls(self) -> int:
        """Requests waiting for their prompt's KV: for blocks, or pulling (aborted ones,
        whose pull is still reported, are no requests any more)."""
        return len(self._to_load) + len(self._loading) - len(self._aborted)

    def under_way(self) -> str | None:
        """The transfers that hold blocks (None: none), in words: a sleep, which drops the
        cache, must wait for them."""
        held, pulls = len(self._sending), len(self._to_load) + len(self._loading)
        parts = []
        if held:
            parts.append(f"the KV of {held} finished prefill(s) held for a decode instance")
        if pulls:
            parts.append(f"{pulls} pull(s) of KV from a prefill instance")
        return " and ".join(parts) or None

    def holds(self, req_id: str) -> bool:
        """Whether blocks are still held under req_id, where no live request has that id:
        a finished prefill's until its KV is sent, an aborted pull's until its end is
        reported. Another request of that id must wait: the blocks go by id."""
        return self.kv.holds(req_id)

    def add_remote(self, request: Request) -> None:
        """A request whose prompt was prefilled elsewhere (request.remote)."""
        assert request.remote is not None
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self._to_load[request.req_id] = request

    def hold(self, request: Request) -> None:
        """A finished prefill (remote_decode): its first num_tokens tokens' blocks stay,
        staged by the next step, until sent. Sets request.kv_transfer_out."""
        if not self.addresses:
            raise RuntimeError(
                f"request {request.req_id!r} asks for a remote decode, but this instance "
                "serves no KV (its kv_transfer role is not a producer)"
            )
        num_tokens = len(request.prompt_token_ids)
        blocks = self.kv.block_ids(request.req_id)[: cdiv(num_tokens, self.kv.block_size)]
        block_ids = np.array(blocks, np.int32)
        name = self.staging_name(request.req_id)
        self._saves.append(KVSave(name, block_ids, num_tokens))
        self._sending[name] = request
        version = -1 if self.kv.holds_stale_kv(request.req_id) else self.kv.weights_version
        request.kv_transfer_out = RemoteKV(
            name, num_tokens, list(self.addresses), block_ids, self.pipeline_stages, version
        )

    def staging_name(self, req_id: str) -> str:
        """A name for req_id's next staging that no other staging of this instance has
        (its id, this scheduler's random incarnation, a count)."""
        self._num_staged += 1
        return f"{req_id}@{self._incarnation}.{self._num_staged}"

    def abort(self, request: Request) -> None:
        """An aborted request waiting for remote KV: its blocks go now, or, with its pull
        under way, once the workers report it over (they may be writing them)."""
        self._to_load.pop(request.req_id, None)
        if request.req_id in self._loading:
            self._aborted.add(request.req_id)
        else:
            self.kv.free(request.req_id)

    def withdraw(self, req_id: str) -> None:
        """req_id's finished prefill was aborted by its client before a decode instance
        took its KV: its blocks go now where no step staged them yet, else once the
        workers report the withdrawn staging let go (a pull reading it in place ends
        first)."""
        for name, request in list(self._sending.items()):
            if request.req_id != req_id:
                continue
            unstaged = [s for s in self._saves if s.req_id == name]
            if unstaged:
                self._saves.remove(unstaged[0])
                del self._sending[name]
                self.kv.free(req_id)
            elif name not in self._withdrawn:
                self._withdrawn.append(name)

    def order_loads(self, before: Request | None = None) -> bool:
        """Blocks for the pulls waiting for them, in arrival order (those that came before
        `before` only), each loaded by the step being built; False once one does not fit:
        every request after it waits behind it."""
        while self._to_load:  # its head: loads leave it in arrival order
            req_id, request = next(iter(self._to_load.items()))
            remote = request.remote
            assert remote is not None
            if before is not None and request.queued_at > before.queued_at:
                return True
            num_cached = self.kv.allocate_pending(req_id, request.prompt_token_ids)
            if num_cached is None:
                return False
            if remote.kv.weights_version != self.kv.weights_version:  # other weights' KV
                self.kv.never_register(req_id)
            del self._to_load[req_id]
            blocks = np.array(self.kv.block_ids(req_id), np.int32)
            load = KVLoad(req_id, blocks, remote.kv, num_cached)
            self._loading[req_id] = (request, load)
            self._loads.append(load)
        return True

    def metadata(self) -> KVConnectorMetadata | None:
        """The orders for the step being built: loads for the requests that fit now,
        saves of the prefills finished since the last step."""
        self.order_loads()
        if not (self._saves or self._loads or self._cancels or self._withdrawn):
            return None
        metadata = KVConnectorMetadata(
            saves=self._saves,
            loads=self._loads,
            cancel_loads=self._cancels,
            cancel_saves=self._withdrawn,
        )
        self._saves, self._loads, self._cancels, self._withdrawn = [], [], [], []
        return metadata

    def update(
        self, output: KVConnectorOutput, requeue: Callable[[Request], None]
    ) -> list[Request]:
        """Apply what the workers reported: sent blocks freed, loaded requests handed to
        requeue (to wait for a step of their own), failed ones finished with their
        error. Returns the requests that finished."""
        finished: list[Request] = []
        for name in output.finished_sending:
            request = self._sending.pop(name, None)
            if request is not None:
                self.kv.free(request.req_id)
        for req_id in output.finished_recving:
            entry = self._loading.pop(req_id, None)
            if entry is None:
                continue
            if req_id in self._aborted:
                self._aborted.discard(req_id)
                self.kv.free(req_id)
                continue
            request, load = entry
            assert request.remote is not None
            self.num_loaded += 1
            self.num_hit_blocks += load.num_cached_blocks
            self.num_pulled_blocks += len(load.block_ids) - load.num_cached_blocks
            request.num_loaded_tokens = request.remote.kv.num_tokens
            request.status = RequestStatus.WAITING
            requeue(request)
        for failure in output.failed_recving:
            entry = self._loading.pop(failure.req_id, None)
            if entry is None:
                continue
            request = entry[0]
            # Reported once one rank (or stage) failed it: the others may still be pulling
            # into its blocks. The next step cancels it on every rank before anything of
            # that step runs, and no earlier step can hand the blocks to another request.
            self._cancels.append(failure.req_id)
            self.kv.free(failure.req_id)  # the reused blocks stay cached
            was_aborted = failure.req_id in self._aborted
            self._aborted.discard(failure.req_id)
            if not was_aborted:
                request.error = failure.error
                request.finish(FinishReason.ABORT)
                finished.append(request)
        return finished

    def reset(self, workers_lost: bool = False) -> list[Request]:
        """After a failed step: every load is forgotten (the blocks of requests waiting for
        KV are the scheduler's to free, with every unfinished request's; those of
        aborted ones whose pull was under way go here), and so is every save. Returns
        the requests that waited for KV. The loads under way are cancelled by the next
        step's orders, before anything of that step runs: their blocks may go to other
        requests at once. The finished prefills' blocks stay held until the workers
        report them sent: the next step withdraws their staged KV, which a puller may be
        reading in place (the saves no step carried yet were never staged, and with the
        workers lost nothing will report: their blocks go now)."""
        unstaged = self._sending if workers_lost else [s.req_id for s in self._saves]
        for name in list(unstaged):
            self.kv.free(self._sending.pop(name).req_id)
        for req_id in self._aborted:  # no request of the scheduler's holds these blocks
            self.kv.free(req_id)
        waiting = [*self._to_load.values(), *(r for r, _ in self._loading.values())]
        self._cancels = [*self._cancels, *self._loading]
        self._withdrawn = list(dict.fromkeys([*self._withdrawn, *self._sending]))
        self._to_load.clear()
        self._loading.clear()
        self._aborted.clear()
        self._saves, self._loads = [], []
        return waiting


def step_orders(
    connector: KVConnectorScheduler | None, host_tier: HostKVTier | None
) -> KVConnectorMetadata | None:
    """The step's orders to the workers' connectors: the transfers', the host tier's."""
    orders = connector.metadata() if connector is not None else None
    copies = host_tier.take_copies() if host_tier is not None else None
    if copies is None:
        return orders
    if orders is None:
        return KVConnectorMetadata(host=copies)
    orders.host = copies
    return orders
