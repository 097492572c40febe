"""What the layout of a same-host KV pull costs on this host's CPU, apart from the pull:
16 MiB copied on one thread as one memcpy (bench/kv_transfer.py's floor), and as the
pieces a pull copies (kv_transfer/piece_copies.py's copy_pieces, one piece at a time on
one thread), runs of consecutive blocks whole or every other block apart (the pull of
bench/kv_transfer.py, whose pieces are each a block of a layer's keys or values: 32 KiB),
and as one numpy copy of the same strided pieces (no per-piece Python at all). Medians
of --repeats, in ms, and each over the memcpy. Writes bench/results/piece_copies.json.

    python -m bench.piece_copies [--mib 16] [--repeats 40]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from bench.common import pin_threads, time_calls, write_results
from zmqworker.kv_transfer.piece_copies import copy_pieces

PIECES_KIB = (4, 32, 256, 2048)


def median_ms(action: Callable[[], object], repeats: int) -> float:
    return statistics.median(time_calls(action, repeats, warmup=1)) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    pin_threads(1)  # copy_pieces copies in slices, one at a time, on one thread
    nbytes = args.mib << 20
    src = torch.ones(2 * nbytes, dtype=torch.uint8)
    dst = torch.zeros(2 * nbytes, dtype=torch.uint8)
    whole_src, whole_dst = src[:nbytes], dst[:nbytes]
    memcpy = median_ms(lambda: whole_dst.copy_(whole_src), args.repeats)
    rows = []
    for kib in PIECES_KIB:
        piece = kib << 10
        count = nbytes // piece
        lengths = np.full(count, piece, np.int64)
        for layout, at, to in (
            ("consecutive", np.arange(count) * piece, np.arange(count) * piece),
            ("every other", 2 * np.arange(count) * piece, (2 * np.arange(count) + 1) * piece),
        ):
            pieces = median_ms(partial(copy_pieces, dst, src, to, at, lengths), args.repeats)
            rows.append({"piece_kib": kib, "layout": layout, "copy_pieces_ms": pieces,
                         "x_memcpy": pieces / memcpy})  # fmt: skip
        apart_src = src.numpy().reshape(-1, piece)[0::2]
        apart_dst = dst.numpy().reshape(-1, piece)[1::2]
        strided = median_ms(partial(np.copyto, apart_dst, apart_src), args.repeats)
        rows.append({"piece_kib": kib, "layout": "every other, one numpy copy",
                     "copy_pieces_ms": strided, "x_memcpy": strided / memcpy})  # fmt: skip
    result = {"bytes": nbytes, "repeats": args.repeats, "memcpy_ms": memcpy, "rows": rows}
    write_results("piece_copies", result, args.out)
    print(f"memcpy of {args.mib} MiB: {memcpy:.3f} ms")
    for row in rows:
        print(f"{row['piece_kib']:5d} KiB {row['layout']:28s} {row['copy_pieces_ms']:7.3f} ms "
              f"{row['x_memcpy']:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
