"""A request's blocks from one cache into another, every layer in one Triton launch: the
pull out of a producer's GPU cache (CUDA IPC). Torch would take two ops a layer (an
index_select and an index_copy), each with its host overhead, on the worker's thread
between steps.

Each cache is a list of layer tensors, [2, blocks, heads, slots] each (attention/
kv_cache.py); the launch takes their addresses from a table of pointers, one program
per (block, layer and keys or values, piece of a row). A row is a (kv, block)'s heads: all
of them, or the heads first .. first + count - 1 of the source into dest .. of the
destination (instances of different tensor parallel sizes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The copy moves raw elements: an integer type of the element's width does.
_WORDS = {1: tl.int8, 2: tl.int16, 4: tl.int32}
ROW_PIECE = 1024  # elements a program copies


@triton.jit
def _copy_blocks_kernel(
    dst_ptrs,
    src_ptrs,
    dst_ids,
    src_ids,
    dst_kv_stride,
    src_kv_stride,
    dst_row,
    src_row,
    dst_first,
    src_first,
    length,
    WORD: tl.constexpr,
    PIECE: tl.constexpr,
):
    i = tl.program_id(0)  # the block: axis 0, which has room for any count
    layer_kv = tl.program_id(1)
    piece = tl.program_id(2)
    layer = layer_kv // 2
    kv = layer_kv % 2
    dst = tl.load(dst_ptrs + layer).to(tl.pointer_type(WORD))
    src = tl.load(src_ptrs + layer).to(tl.pointer_type(WORD))
    d = tl.load(dst_ids + i)
    s = tl.load(src_ids + i)
    offs = piece * PIECE + tl.arange(0, PIECE)
    mask = offs < length
    x = tl.load(src + kv * src_kv_stride + s * src_row + src_first + offs, mask=mask)
    tl.store(dst + kv * dst_kv_stride + d * dst_row + dst_first + offs, x, mask=mask)


def copy_blocks(
    dst: list[torch.Tensor],
    dst_table: torch.Tensor,
    dst_ids: torch.Tensor,
    src_table: torch.Tensor,
    src_ids: torch.Tensor,
    src_shape: tuple[int, int],
    heads: tuple[int, int, int] | None = None,
) -> None:
    """Blocks src_ids of every layer of the source into blocks dst_ids of dst, on dst's
    device. The source's layers are at src_table's addresses (another process's memory
    opened here), each [2, blocks, heads, slots] contiguous, (blocks, heads) = src_shape,
    of dst's dtype and slots; dst_table: dst's data_ptr()s; all four int64 on the
    device. heads: (first, dest, count), else all of them. Queued on the current
    stream."""
    d = dst[0]
    blocks, src_heads = src_shape
    slots = d.shape[3]
    if d.stride(3) != 1 or d.stride(2) != slots or d.stride(1) != d.shape[2] * slots:
        raise ValueError(f"a cache layer of strides {d.stride()} is not contiguous")
    first, dest, count = heads if heads is not None else (0, 0, src_heads)
    if first + count > src_heads or dest + count > d.shape[2]:
        raise ValueError(
            f"heads {first}..{first + count - 1} of {src_heads} into {dest}.. of {d.shape[2]}"
        )
    if len(dst_ids) == 0:
        return
    length = count * slots
    grid = (len(dst_ids), 2 * len(dst), triton.cdiv(length, ROW_PIECE))
    _copy_blocks_kernel[grid](
        dst_table,
        src_table,
        dst_ids,
        src_ids,
        d.stride(0),
        blocks * src_heads * slots,
        d.stride(1),
        src_heads * slots,
        dest * slots,
        first * slots,
        length,
        WORD=_WORDS[d.element_size()],
        PIECE=ROW_PIECE,
    )
