"""The row tiles of the decode-sized Triton projections (skinny_linear.py,
skinny_gate_up.py): a step of m rows runs the kernel compiled for the first tile >= m.

Each tile is a compile of its own, so warm-up runs a step of each (tile_starts), and one
of the steps above them, which take cuBLAS.
"""

from __future__ import annotations

ROW_TILES = (16, 32, 64)
MAX_ROWS = ROW_TILES[-1]


def row_tile(rows: int) -> int:
    return next(t for t in ROW_TILES if t >= rows)


def tile_starts() -> list[int]:
    """The fewest rows of each row tile, and of the steps above them: a step of each
    compiles what steps of its range run."""
    return [1] + [t + 1 for t in ROW_TILES]
