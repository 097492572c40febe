"""allowed_token_ids by batch row (the last pipeline stage's: it samples): each row's
allowed tokens as a packed bitmask on the device, bit j of word j // 32 set for token j.

The table, int32 [max_num_seqs, ceil(vocab / 32)] (a 32nd of the penalties' counts), is
allocated once, so the memory a worker reports before the KV cache is sized holds it. A
request's row is written when it joins (flush(), one upload for all the step's joiners)
and never again: a step only gathers the rows of the requests that sample with a mask
(penalty_rows.py, once per batch change) and the sampler sets every token whose bit is 0
to -inf (penalties.apply_penalties). A row without allowed_token_ids costs nothing.
"""

from __future__ import annotations

import numpy as np
import torch

from zmqworker.cdiv import cdiv
from zmqworker.model_runner.host_to_device import upload

BITS = 32  # tokens a bitmask word holds


def token_bits(token_ids: np.ndarray | list[int], words: int) -> np.ndarray:
    """int32 [words]: bit j of word j // 32 set for each token j of token_ids (each in
    [0, 32 * words))."""
    present = np.zeros(words * BITS, bool)
    present[np.asarray(token_ids, np.int64)] = True
    return np.packbits(present, bitorder="little").view(np.int32)


class AllowedRows:
    def __init__(self, max_num_seqs: int, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.words = cdiv(vocab_size, BITS)
        self.bits = torch.zeros(max_num_seqs, self.words, dtype=torch.int32, device=device)
        self.has = np.zeros(max_num_seqs, bool)  # rows with allowed_token_ids
        self._joining: dict[int, np.ndarray] = {}  # row -> its packed words, not yet written

    @property
    def nbytes(self) -> int:
        return self.bits.numel() * self.bits.element_size()

    def add(self, row: int, token_ids: list[int]) -> None:
        """Row's request allows only token_ids (each in [0, vocab): the batch's check)."""
        self._joining[row] = token_bits(token_ids, self.words)
        self.has[row] = True

    def remove(self, row: int) -> None:
        self.has[row] = False
        self._joining.pop(row, None)

    def flush(self) -> None:
        """Write the joining rows' bitmasks on the device, in one upload."""
        if not self._joining:
            return
        joining, self._joining = self._joining, {}
        rows = np.fromiter(joining, np.int32, len(joining))
        rows_d, words_d = upload([rows, np.stack(list(joining.values()))], self.bits.device)
        self.bits.index_copy_(0, rows_d.long(), words_d)

    def everything(self, n: int) -> torch.Tensor:
        """Words allowing every token, for n rows (a dummy step's: it writes no row)."""
        return torch.full((n, self.words), -1, dtype=torch.int32, device=self.bits.device)
