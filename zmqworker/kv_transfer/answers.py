"""The checks a producer's answer to a pull passes before anything of it is mapped or
copied (ValueError naming what does not fit): the puller fails the load with it."""

from __future__ import annotations

import msgspec
import zmq

from messages.kv_peer import KVBlocks, KVLayout
from messages.kv_transfer import KVLoad
from zmqworker.kv_transfer.blocks import staged_nbytes
from zmqworker.kv_transfer.head_map import HeadSource


def checked_answer(
    layout: KVLayout, load: KVLoad, source: HeadSource, reply: KVBlocks
) -> tuple[KVLayout, KVLayout, KVLayout]:
    """The layouts of the staging, of the answer's bytes over tcp (the heads asked, of all
    staged layers) and of the piece taken (those heads of the layers taken), of an
    answer to a pull of all layers of load's piece from source; layout: this rank's
    cache."""
    if reply.layers is not None:
        raise ValueError(f"an answer holding layers {reply.layers} to a pull of all of them")
    staged = source.staged_layout(layout)
    if reply.layout != staged:
        raise ValueError(f"the prefill's KV layout {reply.layout} differs from {staged}")
    if reply.num_blocks != len(load.block_ids):
        raise ValueError(f"{reply.num_blocks} blocks staged for {len(load.block_ids)} blocks here")
    if reply.first_block > load.num_cached_blocks:
        raise ValueError(
            f"the answer holds the staged blocks from {reply.first_block} on, this "
            f"load needs them from {load.num_cached_blocks} on"
        )
    sent = msgspec.structs.replace(staged, num_kv_heads=source.count)
    return staged, sent, source.taken_layout(layout)


def checked_memfd(reply: KVBlocks, staged: KVLayout) -> int:
    """The bytes of the whole staging that reply's memfd must hold."""
    assert reply.shared is not None
    nbytes = staged_nbytes(staged, reply.num_blocks)
    if reply.shared.nbytes != nbytes or reply.first_block != 0:
        raise ValueError(
            f"{reply.shared.nbytes} bytes staged from block {reply.first_block} on, "
            f"{nbytes} expected from block 0 on"
        )
    return nbytes


def checked_frames(
    reply: KVBlocks, frames: list[zmq.Frame], wanted: KVLayout, source: HeadSource
) -> int:
    """The bytes of the one data frame an answer over tcp must carry after reply."""
    nbytes = staged_nbytes(wanted, reply.num_blocks - reply.first_block)
    got = [len(f.buffer) for f in frames]
    if got != [nbytes]:
        raise ValueError(
            f"expected one frame of {nbytes} bytes after KVBlocks (heads "
            f"[{source.first}, {source.first + source.count}) of staged blocks "
            f"{reply.first_block} to {reply.num_blocks}), got frames of {got}"
        )
    return nbytes
