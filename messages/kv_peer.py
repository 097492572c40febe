"""The messages between the KV transfer workers of two instances (their own sockets,
not the engine's): the decode side pulls. A prefill instance keeps a finished prefill's
KV staged; a decode worker asks for it by request id (KVPull), gets a KVBlocks answer
(the bytes as the next frame over tcp, where they lie in shared memory on one host, or
the prefill's cache itself where the decode side can read it: its GPU cache through CUDA
IPC, its host cache through the memfd that holds it), copies them into its
own blocks and says KVDone; only then does the prefill side let it go.
docs/protocol.md, "KV transfer between instances", has the frames."""

from __future__ import annotations

from typing import Annotated

import msgspec

NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(ge=1)]


class KVLayout(msgspec.Struct, tag=True, frozen=True):
    """One rank's cache, as a peer must match it: layers x [2, blocks, heads, slots]."""

    num_layers: Positive
    block_size: Positive
    num_kv_heads: Positive
    head_size: Positive
    dtype: str


class KVPull(msgspec.Struct, tag=True, frozen=True):
    """A decode rank asks for req_id's staged KV on the prefill rank `rank` (the server's
    own: a check that it reached the right one). host_id: its host's boot id, when it
    can map the server's memory (same host); "" for the bytes over tcp. heads: [first,
    count] of the server rank's staged heads to take (prefill and decode of different
    tensor parallel sizes; docs/kv_transfer.md); None: all of them; count 0: none, this
    reader only lets it go (no answer). readers: how many decode ranks pull req_id from
    this server: its staged KV goes after that many KVDone (or releases). first_block:
    the leading staged blocks the reader skips (it holds their KV already): over tcp
    only the blocks after them travel; past the staged block count, an error. gpus: the
    UUIDs of the GPUs whose memory the puller can read through CUDA IPC (same host
    only; its own, then its peers): a server whose cache lies on one of them answers
    with CudaKV. host_cache: the puller's cache
    is in host memory and it can map the server's (same host only): a server whose
    cache lies in a memfd answers with HostCacheKV. layers: [first, count] of the staged
    layers to send over tcp: those a decode stage of another stage count takes, or one
    part of a pull split over several connections (CURVE runs on one thread a
    connection, so parts on their own connections go in parallel); a server on host_id's
    host may answer in place instead, all layers. None: all of them, answered as the
    rest says."""

    req_id: str
    rank: NonNegative
    host_id: str = ""
    heads: tuple[NonNegative, NonNegative] | None = None
    readers: Positive = 1
    first_block: NonNegative = 0
    gpus: list[str] = []
    host_cache: bool = False
    layers: tuple[NonNegative, Positive] | None = None


class SharedKV(msgspec.Struct, tag=True, frozen=True):
    """A staged prefill in the server's memfd: open /proc/pid/fd/fd, nbytes long; inode:
    the memfd's (0: unchecked), so that a puller never reads another memfd that took
    the same fd number after its staging went."""

    pid: Positive
    fd: NonNegative
    nbytes: NonNegative
    inode: NonNegative = 0


class CudaKVLayer(msgspec.Struct, tag=True, frozen=True):
    """One layer's cache tensor in the producer's GPU memory: the CUDA IPC handle
    (cudaIpcMemHandle_t, 64 bytes) of the allocation holding it, and its offset there
    in bytes."""

    handle: bytes
    offset: NonNegative


class CudaKV(msgspec.Struct, tag=True, frozen=True):
    """A staged prefill where the prefill computed it, in its GPU cache (device_uuid):
    each layer's cache tensor [2, num_cache_blocks, heads, slots] (the layout's dtype,
    contiguous), and the request's blocks in it, in order. The puller copies them within
    half of hold_s (and of its own timeout) from the answer."""

    device_uuid: str
    layers: list[CudaKVLayer]
    num_cache_blocks: Positive
    block_ids: list[NonNegative]
    hold_s: float = 0.0  # how long from the answer the server holds them (0: unsaid)


class HostCacheKV(msgspec.Struct, tag=True, frozen=True):
    """A staged prefill where the prefill computed it, in its host cache: the memfd that
    holds every layer's cache tensor (memfd: open /proc/pid/fd/fd, nbytes long, of that
    inode), each layer's tensor [2, num_cache_blocks, heads, slots] (the layout's dtype,
    contiguous) at offsets[layer] bytes in it, and the request's blocks in it, in order.
    The puller copies them within half of hold_s (and of its own timeout) from the
    answer."""

    memfd: SharedKV
    offsets: list[NonNegative]
    num_cache_blocks: Positive
    block_ids: list[NonNegative]
    hold_s: float = 0.0  # how long from the answer the server holds them (0: unsaid)


class KVBlocks(msgspec.Struct, tag=True, frozen=True, omit_defaults=True):
    """The answer to a KVPull: the layout and block count of the staged KV, laid out
    [layers, 2, blocks, heads, slots]; in shared memory (all of it: the puller takes the
    heads it asked), in the prefill's GPU cache (cuda) or host cache (host_cache), or in
    the frame that follows (none of the three; only the heads asked, only the blocks
    from first_block on). first_block: the leading staged blocks the answer leaves out
    (0 in shared memory or a cache: they hold them all; a producer that ignores
    KVPull.first_block sends 0 and all of them). layers: [first, count] of the staged
    layers the frame holds, as KVPull.layers asked (None: all). error: why there is none
    (unknown or expired request, wrong rank, heads, first_block or layers out of
    range)."""

    req_id: str
    layout: KVLayout | None = None
    num_blocks: NonNegative = 0
    shared: SharedKV | None = None
    error: str | None = None
    first_block: NonNegative = 0
    cuda: CudaKV | None = None
    host_cache: HostCacheKV | None = None
    layers: tuple[NonNegative, Positive] | None = None


class KVDone(msgspec.Struct, tag=True, frozen=True):
    """The puller holds its copy: the server drops req_id's staged KV."""

    req_id: str


KVPeerMessage = KVPull | KVBlocks | KVDone
