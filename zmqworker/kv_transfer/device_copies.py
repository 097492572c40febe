"""A request's KV between a GPU cache and host memory (blocks.py's CUDA side), in groups
of layers of at most GROUP_BYTES, so that a long prompt's KV never needs as much spare
device memory as all of it; and from another process's GPU cache into this one's
(copy_blocks, across the peer link where that cache lies on another GPU).

Out (a staging, on the server's thread): the blocks are gathered on that thread's
current stream (which waits for the step that computed them), and each group goes to
the host in one copy (by DMA where the host memory is page-locked); the host waits
once, at the end.

In (a pull, before a step): each group crosses on a stream of its own, so the copies do
not wait for the steps already queued on the current stream, into one of two device
buffers used in turn (a buffer is refilled once the current stream has written the
previous group out of it into the cache); the current stream waits for each group
before writing it into the cache. The host waits for the copies alone before returning:
the host memory they read may then go.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from zmqworker.kv_transfer.peer_caches import PeerCache

GROUP_BYTES = 256 << 20


def gather(kv_caches: list[torch.Tensor], block_ids: torch.Tensor, out: torch.Tensor) -> None:
    """block_ids of every layer into out [layers, 2, n, heads, slots] (host memory)."""
    device = kv_caches[0].device
    ids = block_ids.to(device)
    group = _layers_a_group(out)
    buffer = torch.empty((group, *out.shape[1:]), dtype=out.dtype, device=device)
    for lo in range(0, len(kv_caches), group):
        hi = min(lo + group, len(kv_caches))
        for layer in range(lo, hi):
            torch.index_select(kv_caches[layer], 1, ids, out=buffer[layer - lo])
        out[lo:hi].copy_(buffer[: hi - lo], non_blocking=True)
    torch.cuda.current_stream(device).synchronize()  # out holds the KV on return


def scatter(
    kv_caches: list[torch.Tensor],
    block_ids: torch.Tensor,
    staged: torch.Tensor,
    heads: tuple[int, int, int] | None = None,
) -> None:
    """staged [layers, 2, n, heads, slots] (host memory) into block_ids of every layer;
    heads (first, dest, count): only staged's heads first .. first + count - 1, into heads
    dest .. of the cache (all of staged's heads cross, and the piece is cut on the
    device: cut on the host, it would first be copied into pageable memory)."""
    device = kv_caches[0].device
    current, side = torch.cuda.current_stream(device), _copy_stream(device)
    group = _layers_a_group(staged)
    starts = range(0, len(kv_caches), group)
    with torch.cuda.stream(side):
        ids = block_ids.to(device, non_blocking=True)
        shape = (group, *staged.shape[1:])
        buffers = [torch.empty(shape, dtype=staged.dtype, device=device) for _ in starts[:2]]
    written: list[torch.cuda.Event | None] = [None] * len(buffers)
    try:
        for g, lo in enumerate(starts):
            hi = min(lo + group, len(kv_caches))
            turn = g % len(buffers)
            buffer = buffers[turn][: hi - lo]
            with torch.cuda.stream(side):
                if written[turn] is not None:
                    side.wait_event(written[turn])
                _copy_in(buffer, staged[lo:hi])
            current.wait_stream(side)
            for layer in range(lo, hi):
                _write(kv_caches[layer], ids, buffer[layer - lo], heads)
            written[turn] = torch.cuda.Event()
            written[turn].record(current)
    finally:
        side.synchronize()  # the host memory is read (even where a write above failed)
    for t in (ids, *buffers):
        t.record_stream(current)  # not reused before the current stream is done with it


def copy_blocks(
    kv_caches: list[torch.Tensor],
    block_ids: torch.Tensor,
    source: PeerCache,
    source_ids: torch.Tensor,
    heads: tuple[int, int, int] | None = None,
    source_layers: slice = slice(None),
) -> None:
    """Blocks source_ids of source's layers (a producer's cache on this device or a peer,
    opened through CUDA IPC) into block_ids of kv_caches, in one launch; heads as
    scatter's.
    Queued on the current stream, after the steps already there (they may still use the
    blocks the load was given), with nothing for the host to wait on: the layers'
    addresses and the ids cross in one copy from page-locked memory, queued there too
    (the launch waits for those steps anyway; a stream of its own would only add the
    hand-over)."""
    device = kv_caches[0].device
    n, layers, sources = len(block_ids), len(kv_caches), source.layers[source_layers]
    if len(sources) != layers:
        raise ValueError(f"{len(sources)} layers copied into {layers}")
    host = torch.empty(2 * layers + 2 * n, dtype=torch.int64, pin_memory=True)
    table = host.numpy()
    table[:layers] = [cache.data_ptr() for cache in kv_caches]
    table[layers : 2 * layers] = sources
    table[2 * layers : 2 * layers + n] = block_ids.numpy()
    table[2 * layers + n :] = source_ids.numpy()
    on_device = host.to(device, non_blocking=True)
    dst_table, src_table = on_device[:layers], on_device[layers : 2 * layers]
    ids, src_ids = on_device[2 * layers : 2 * layers + n], on_device[2 * layers + n :]
    shape = (source.num_blocks, source.num_kv_heads)
    _kernel().copy_blocks(kv_caches, dst_table, ids, src_table, src_ids, shape, heads)


def warm_up_copies(kv_caches: list[torch.Tensor]) -> None:
    """Compile copy_blocks' kernel before a pull needs it (else the worker's thread would,
    between two steps): by copying block 0 of kv_caches onto itself."""
    device, cache = kv_caches[0].device, kv_caches[0]
    table = torch.tensor([c.data_ptr() for c in kv_caches], dtype=torch.int64, device=device)
    zero = torch.zeros(1, dtype=torch.int64, device=device)
    _kernel().copy_blocks(kv_caches, table, zero, table, zero, cache.shape[1:3])


def _copy_in(buffer: torch.Tensor, src: torch.Tensor) -> None:
    """src (host) into buffer (device): one copy where src is contiguous, else one per
    layer's keys or values (src is cut along blocks: each is contiguous, and crosses by
    DMA, where torch would first copy a non-contiguous src into pageable memory)."""
    if src.is_contiguous():
        buffer.copy_(src, non_blocking=True)
        return
    for layer in range(src.shape[0]):
        for kv in range(2):
            buffer[layer, kv].copy_(src[layer, kv], non_blocking=True)


def _write(
    cache: torch.Tensor,
    ids: torch.Tensor,
    piece: torch.Tensor,
    heads: tuple[int, int, int] | None,
) -> None:
    if heads is None:
        cache.index_copy_(1, ids, piece)
    else:
        first, dest, count = heads
        cache[:, ids, dest : dest + count] = piece[:, :, first : first + count]


def _layers_a_group(staged: torch.Tensor) -> int:
    layer_bytes = staged[0].numel() * staged.element_size()
    return max(1, min(staged.shape[0], GROUP_BYTES // max(1, layer_bytes)))


@functools.cache
def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    """One stream a device for the copies in: its memory pool stays warm (the caching
    allocator keeps one per stream)."""
    return torch.cuda.Stream(device)


def _kernel() -> ModuleType:
    """block_copy_kernel, imported where a copy runs: it imports Triton, which a worker
    without a GPU copy (every CPU worker) would otherwise import at start-up for nothing."""
    from zmqworker.kv_transfer import block_copy_kernel

    return block_copy_kernel
