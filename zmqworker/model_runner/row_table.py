"""Per-row lists of a batch (each row's entries an int32 array [k, width]), flattened for
the whole batch when they change, so that a step selects its rows' entries with a few
vectorised numpy operations and no loop over requests.
"""

from __future__ import annotations

import numpy as np


class RowTable:
    """Rows 0..num_rows-1, each with an int32 [k, width] array of entries (or none).
    Rows of different widths are right-aligned in the flat table, padded with `fill`."""

    def __init__(self, num_rows: int, fill: int = -1) -> None:
        self.fill = fill
        self.has = np.zeros(num_rows, bool)  # rows holding entries
        self._by_row: dict[int, np.ndarray] = {}
        self._flat: tuple[np.ndarray, np.ndarray] | None = None
        self.version = 0  # changes with the entries: a copy elsewhere knows it is stale

    def set(self, row: int, entries: np.ndarray) -> None:
        """The row's entries (int32 [k, width], k >= 1), replacing any it had."""
        self._by_row[row] = entries
        self.has[row] = True
        self._changed()

    def drop(self, row: int) -> None:
        if self._by_row.pop(row, None) is not None:
            self.has[row] = False
            self._changed()

    def get(self, row: int) -> np.ndarray | None:
        return self._by_row.get(row)

    def flat(self) -> tuple[np.ndarray, np.ndarray]:
        """(rows int64 [E], entries int32 [E, max width]) of every row, by row."""
        if self._flat is None:
            rows = sorted(self._by_row)
            parts = [self._by_row[r] for r in rows]
            width = max((p.shape[1] for p in parts), default=1)
            table = np.full((sum(len(p) for p in parts), width), self.fill, np.int32)
            counts = np.array([len(p) for p in parts], np.int64)
            start = 0
            for part in parts:
                table[start : start + len(part), width - part.shape[1] :] = part
                start += len(part)
            self._flat = (np.repeat(np.array(rows, np.int64), counts), table)
        return self._flat

    def of_rows(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The flat (rows, entries) of the given rows only."""
        flat_rows, table = self.flat()
        member = np.zeros(len(self.has), bool)
        member[rows] = True
        keep = member[flat_rows]
        return flat_rows[keep], table[keep]

    def _changed(self) -> None:
        self._flat = None
        self.version += 1
