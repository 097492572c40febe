"""KV transfer between instances (disaggregated prefill and decode), after vLLM v1's
KV connector: what the engine's scheduler side tells its workers in a step
(KVConnectorMetadata), what the workers report back (KVConnectorOutput), and the
messages a decode worker and a prefill worker exchange to move one request's blocks.
The host tier's copies (KVHostCopies) ride in the same metadata.

The decode side pulls: a prefill instance keeps a finished prefill's blocks staged,
a decode worker asks for them by request id (KVPull), gets a KVBlocks answer (the
bytes as the next frame over tcp, or where they lie in shared memory on one host),
copies them into its own blocks and says KVDone; only then does the prefill side let
the blocks go. docs/kv_transfer.md has the whole exchange.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
import numpy as np

NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(ge=1)]


class KVTransferConfig(msgspec.Struct, tag=True, frozen=True, omit_defaults=True):
    """A worker's part in KV transfer. producer: it serves the blocks of finished
    prefills (rank r's server binds tcp://host:port+r); consumer: it pulls remote
    blocks into its own; both: either. timeout_s bounds every wait: a staged prefill
    nobody pulls is dropped after it, a pull unanswered within it fails its request."""

    role: Literal["producer", "consumer", "both"]
    host: str = "127.0.0.1"
    port: NonNegative = 0
    timeout_s: float = 30.0
    # Same-host peers copy through a memfd, not tcp (a producer's host cache lies in one).
    shared_memory: bool = True
    cuda_ipc: bool = True  # same-host GPU caches are read through CUDA IPC, not a memfd

    def address(self, rank: int) -> str:
        return f"tcp://{self.host}:{self.port + rank}"

    @property
    def produces(self) -> bool:
        return self.role in ("producer", "both")

    @property
    def consumes(self) -> bool:
        return self.role in ("consumer", "both")


class RemoteKV(msgspec.Struct, tag=True, frozen=True):
    """Where a request's computed KV waits: the name it is staged under on the prefill
    instance (KVSave.req_id, unique to that staging), the first num_tokens tokens'
    blocks, served by the prefill's ranks: of its pipeline_stages stages, stage s's
    tensor-parallel rank i at addresses[s * tp + i] (tp: len(addresses) //
    pipeline_stages). A decode rank pulls its layers from the prefill stages holding them
    (each side splits the model's layers over its stages by one rule). block_ids: those
    blocks in the prefill's cache (every rank's), held until the KV is taken; a decode
    rank that can read that cache in place copies them as it asks for them, and the
    answer confirms the copy (None: it waits for the answer). weights_version: the
    prefill instance's count of weight changes when it computed the KV (-1: none to
    trust, as for a prompt computed across a change or a reset of its prefix cache): a
    decode instance whose own count differs never shares the request's blocks through its
    prefix cache, since their KV may have come from other weights."""

    req_id: str
    num_tokens: Positive
    addresses: list[str]
    block_ids: np.ndarray | None = None  # int32
    pipeline_stages: Positive = 1
    weights_version: Annotated[int, msgspec.Meta(ge=-1)] = -1

    def __post_init__(self) -> None:
        if len(self.addresses) % self.pipeline_stages:
            raise ValueError(
                f"RemoteKV of {len(self.addresses)} addresses for {self.pipeline_stages} "
                "pipeline stages: each stage has as many ranks"
            )
        ids = self.block_ids
        if ids is None:
            return
        rows = ids.ndim == 1 and np.issubdtype(ids.dtype, np.integer)
        if not rows or (len(ids) and ids.min() < 0):
            raise ValueError(
                f"RemoteKV.block_ids must be one row of block ids (>= 0), got {ids.dtype}"
                f"{list(ids.shape)}"
            )


class KVSave(msgspec.Struct, tag=True, frozen=True):
    """Stage the first num_tokens tokens of a request (in block_ids) for a remote puller,
    once this step has computed them, under the name req_id: the name pullers ask for,
    which no other staging of the instance ever has (RemoteKV.block_ids lets a puller
    copy before its answer confirms the staging)."""

    req_id: str
    block_ids: np.ndarray  # int32 [ceil(num_tokens / block_size)]
    num_tokens: Positive


class KVLoad(msgspec.Struct, tag=True, frozen=True, omit_defaults=True):
    """Pull remote's KV into block_ids (the request's blocks here, as many as remote's
    tokens fill). The first num_cached_blocks of them hold that KV already (prefix-cache
    hits here): only the blocks after them are written."""

    req_id: str
    block_ids: np.ndarray  # int32
    remote: RemoteKV
    num_cached_blocks: NonNegative = 0

    def __post_init__(self) -> None:
        if self.num_cached_blocks > len(self.block_ids):
            raise ValueError(
                f"KVLoad of {self.req_id!r}: num_cached_blocks {self.num_cached_blocks} "
                f"over its {len(self.block_ids)} block_ids"
            )


class KVHostCopies(msgspec.Struct, tag=True, frozen=True):
    """A step's copies between the device's blocks and the host tier's slots, done
    before the step's forward: first every store (block store_blocks[i] into slot
    store_slots[i]: a cached block about to be reused), then every load (slot
    load_slots[i] into block load_blocks[i]: a prefix found in the host tier), since a
    block stored may be the target of a load of the same step."""

    store_blocks: np.ndarray  # int32
    store_slots: np.ndarray  # int32, as long as store_blocks
    load_slots: np.ndarray  # int32
    load_blocks: np.ndarray  # int32, as long as load_slots


class KVConnectorMetadata(msgspec.Struct, tag=True, omit_defaults=True):
    """A step's KV transfer orders, the scheduler side's to the workers'. saves are
    staged after the step's forward; loads start before it and end in a later step;
    host copies are done before it. cancel_loads: requests whose loads under way the
    scheduler gave up on (after a failed step, with their blocks): applied first, so
    that whatever arrives for them is dropped, never copied into blocks that may hold
    other requests' KV by then, and never reported. cancel_saves: finished prefills
    whose staged KV the scheduler gave up on (after a failed step; it still holds their
    blocks): no pull is answered for them any more, and each is reported in
    finished_sending once nothing reads its blocks (at once, unless a puller was
    answered with them in place and has not said it is done)."""

    saves: list[KVSave] = []
    loads: list[KVLoad] = []
    host: KVHostCopies | None = None
    cancel_loads: list[str] = []
    cancel_saves: list[str] = []


class KVFailure(msgspec.Struct, tag=True, frozen=True):
    req_id: str
    error: str


class KVConnectorOutput(msgspec.Struct, tag=True, omit_defaults=True):
    """What transfers ended since the previous step's report: staged KV a puller took
    (or that expired: its blocks can go), loads done (their blocks hold the remote KV),
    and loads that failed (the request cannot go on)."""

    finished_sending: list[str] = []
    finished_recving: list[str] = []
    failed_recving: list[KVFailure] = []

    def __bool__(self) -> bool:
        return bool(self.finished_sending or self.finished_recving or self.failed_recving)
