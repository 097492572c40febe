"""A request's blocks out of one rank's KV cache into a flat buffer and back.

The cache is one tensor per layer, [2, num_blocks, heads, slots] (attention/kv_cache.py);
a request's blocks are gathered into [layers, 2, n, heads, slots], the layout peers
exchange (messages.kv_transfer.KVBlocks), so that a transfer is one contiguous buffer
whatever the block ids on either side.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np
import torch

from messages import KVCacheSpec
from messages.kv_cache import DTYPE_BYTES
from messages.kv_peer import KVLayout
from zmqworker.kv_transfer import device_copies, piece_copies
from zmqworker.kv_transfer.peer_caches import PeerCache
from zmqworker.models.registry import torch_dtype

# A peer's memfd is mapped read-only: the tensors over it are only read (as the codec's).
warnings.filterwarnings("ignore", message="The given buffer is not writable")


def layout_of(spec: KVCacheSpec) -> KVLayout:
    return KVLayout(
        num_layers=len(spec.layer_names),
        block_size=spec.block_size,
        num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_size,
        dtype=spec.dtype,
    )


def staged_shape(layout: KVLayout, num_blocks: int) -> tuple[int, ...]:
    slots = layout.block_size * layout.head_size
    return (layout.num_layers, 2, num_blocks, layout.num_kv_heads, slots)


def staged_nbytes(layout: KVLayout, num_blocks: int) -> int:
    return math.prod(staged_shape(layout, num_blocks)) * DTYPE_BYTES[layout.dtype]


def view_staged(buffer: memoryview | bytearray, layout: KVLayout, num_blocks: int) -> torch.Tensor:
    """buffer (at least staged_nbytes long) as the staged tensor, without a copy."""
    nbytes = staged_nbytes(layout, num_blocks)
    if len(buffer) < nbytes:
        raise ValueError(f"{num_blocks} blocks need {nbytes} bytes, the buffer holds {len(buffer)}")
    count = nbytes // DTYPE_BYTES[layout.dtype]
    flat = torch.frombuffer(buffer, dtype=torch_dtype(layout.dtype), count=count)
    return flat.view(staged_shape(layout, num_blocks))


def gather(kv_caches: list[torch.Tensor], block_ids: torch.Tensor, out: torch.Tensor) -> None:
    """Copy block_ids of every layer into out [layers, 2, n, heads, slots] (on the host)."""
    if kv_caches[0].device.type == "cpu":
        ids = block_ids.numpy()
        num_blocks = kv_caches[0].shape[1]
        if len(ids) and (ids.min() < 0 or ids.max() >= num_blocks):
            raise ValueError(f"block ids {ids.min()} .. {ids.max()} of {num_blocks} blocks")

        def copy(layer: int) -> None:
            # Checked above: take's default mode ("raise") gathers into a buffer of its
            # own first, a second copy of every byte.
            np.take(_rows(kv_caches[layer]), ids, axis=1, out=_rows(out[layer]), mode="clip")

        for_each_layer(copy, len(kv_caches))
        return
    device_copies.gather(kv_caches, block_ids, out)


def scatter(kv_caches: list[torch.Tensor], block_ids: torch.Tensor, staged: torch.Tensor) -> None:
    """Copy staged [layers, 2, n, heads, slots] into block_ids of every layer."""
    if kv_caches[0].device.type == "cpu":
        ids = block_ids.numpy()

        def copy(layer: int) -> None:
            _rows(kv_caches[layer])[:, ids] = _rows(staged[layer])

        for_each_layer(copy, len(kv_caches))
        return
    device_copies.scatter(kv_caches, block_ids, staged)


def scatter_heads(
    kv_caches: list[torch.Tensor],
    block_ids: torch.Tensor,
    staged: torch.Tensor,
    first: int,
    dest: int,
    count: int,
) -> None:
    """Copy heads first .. first + count - 1 of staged [layers, 2, n, heads, slots] into
    heads dest .. dest + count - 1 of block_ids of every layer (a piece of a pull from
    an instance of another tensor parallel size)."""
    if kv_caches[0].device.type == "cpu":
        ids = block_ids.numpy()

        def copy(layer: int) -> None:
            piece = _head_rows(staged[layer])[:, :, first : first + count]
            _head_rows(kv_caches[layer])[:, ids, dest : dest + count] = piece

        for_each_layer(copy, len(kv_caches))
        return
    device_copies.scatter(kv_caches, block_ids, staged, (first, dest, count))


def copy_from_peer(
    kv_caches: list[torch.Tensor],
    block_ids: np.ndarray,
    source: PeerCache,
    source_ids: np.ndarray,
    heads: tuple[int, int, int] | None,
    layers: slice = slice(None),
) -> torch.cuda.Event | None:
    """Blocks source_ids (int64) of the producer's cache's layers (opened here) into
    block_ids (int64) of kv_caches; heads as scatter's. On the host, copied on return
    (None); on a GPU, queued on the current stream: the event of its end."""
    if kv_caches[0].device.type != "cuda":
        copy_blocks(kv_caches, block_ids, source.layers[layers], source_ids, heads)
        return None
    device_copies.copy_blocks(kv_caches, torch.from_numpy(block_ids), source,
                              torch.from_numpy(source_ids), heads, layers)  # fmt: skip
    copied = torch.cuda.Event()
    copied.record()
    return copied


def copy_blocks(
    kv_caches: list[torch.Tensor],
    block_ids: np.ndarray,
    sources: list[torch.Tensor],
    source_ids: np.ndarray,
    heads: tuple[int, int, int] | None = None,
) -> None:
    """Blocks source_ids of sources (a producer's host cache, mapped here) into block_ids
    of kv_caches (host tensors too); heads as scatter's. Each run of blocks that follow
    each other on both sides (each block's heads, with heads) is one piece of keys and
    one of values, with no gathered copy in between (piece_copies.py: a call a layer)."""
    if len(sources) != len(kv_caches):
        raise ValueError(f"{len(sources)} layers copied into {len(kv_caches)}")
    for ids, cache in ((block_ids, kv_caches[0]), (source_ids, sources[0])):
        if len(ids) and (ids.min() < 0 or ids.max() >= cache.shape[1]):
            raise ValueError(f"block ids {ids.min()} .. {ids.max()} of {cache.shape[1]} blocks")
    dst_block, src_block = (c[0, 0].nbytes for c in (kv_caches[0], sources[0]))
    if heads is None:
        if dst_block != src_block:
            raise ValueError(f"blocks of {src_block} bytes copied into blocks of {dst_block}")
        to, at, lengths = _runs(block_ids, source_ids)
        to, at, lengths = to * dst_block, at * src_block, lengths * dst_block
    else:
        first, dest, count = heads
        head = kv_caches[0][0, 0, 0].nbytes
        if sources[0][0, 0, 0].nbytes != head:
            raise ValueError(f"heads of {sources[0][0, 0, 0].nbytes} bytes copied into {head}")
        if first + count > sources[0].shape[2] or dest + count > kv_caches[0].shape[2]:
            raise ValueError(
                f"heads {first} .. {first + count - 1} of {sources[0].shape[2]} copied into "
                f"heads {dest} .. of {kv_caches[0].shape[2]}"
            )
        if len(block_ids) != len(source_ids):
            raise ValueError(f"{len(source_ids)} source blocks for {len(block_ids)} blocks")
        to = block_ids.astype(np.int64) * dst_block + dest * head
        at = source_ids.astype(np.int64) * src_block + first * head
        lengths = np.full(len(to), count * head, dtype=np.int64)
    # Keys, then values: each half of a layer.
    dst_values, src_values = kv_caches[0][0].nbytes, sources[0][0].nbytes
    to, at = np.r_[to, to + dst_values], np.r_[at, at + src_values]
    lengths = np.r_[lengths, lengths]

    def copy(layer: int) -> None:
        piece_copies.copy_pieces(kv_caches[layer], sources[layer], to, at, lengths)

    # Slices hold the GIL: threads would only take turns at them.
    for_each_layer(copy, len(kv_caches), parallel=piece_copies.in_kernel())


def _runs(block_ids: np.ndarray, source_ids: np.ndarray) -> tuple[np.ndarray, ...]:
    """(block ids, source ids, lengths) of the runs of consecutive ids on both sides."""
    if len(block_ids) != len(source_ids):
        raise ValueError(f"{len(source_ids)} source blocks for {len(block_ids)} blocks")
    block_ids, source_ids = block_ids.astype(np.int64), source_ids.astype(np.int64)
    breaks = np.flatnonzero((np.diff(block_ids) != 1) | (np.diff(source_ids) != 1)) + 1
    starts = np.r_[0, breaks].astype(np.int64)[: len(block_ids)]
    lengths = np.diff(np.r_[starts, len(block_ids)])
    return block_ids[starts], source_ids[starts], lengths


def for_each_layer(copy: Callable[[int], None], num_layers: int, parallel: bool = True) -> None:
    """copy(layer) for every layer, spread over as many threads as torch computes with
    (with parallel; else one after another): those are idle while the KV is copied
    (before or after a step), and numpy's copies let go of the GIL. Returns (or raises
    the first error) once every copy has ended: the caller may then let the memory go."""
    threads = min(num_layers, torch.get_num_threads()) if parallel else 1
    if threads <= 1:
        for layer in range(num_layers):
            copy(layer)
        return
    copies = [_copy_threads(threads).submit(copy, layer) for layer in range(num_layers)]
    wait(copies)
    for done in copies:
        done.result()


@functools.cache
def _copy_threads(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(threads, thread_name_prefix="kv-copy")


def _head_rows(t: torch.Tensor) -> np.ndarray:
    """A host tensor [2, blocks, heads, slots] as numpy [2, blocks, heads] of opaque
    head rows (as _rows, a head at a time)."""
    row_bytes = t.shape[3] * t.element_size()
    flat = t.view(torch.uint8).numpy().reshape(*t.shape[:3], row_bytes)
    return flat.view(np.dtype((np.void, row_bytes)))[..., 0]


def _rows(t: torch.Tensor) -> np.ndarray:
    """A host tensor [2, blocks, heads, slots] as numpy [2, blocks] of opaque block rows:
    numpy's indexed copies move each row as one memcpy (torch's index_copy_ element by
    element, several times slower)."""
    row_bytes = t.shape[2] * t.shape[3] * t.element_size()
    flat = t.view(torch.uint8).numpy().reshape(t.shape[0], t.shape[1], row_bytes)
    return flat.view(np.dtype((np.void, row_bytes)))[..., 0]
