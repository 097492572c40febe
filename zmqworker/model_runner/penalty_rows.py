"""The penalties' per-request state, by batch row (the last pipeline stage's: it samples).

On the device, allocated once for max_num_seqs rows (the memory a worker reports as used
before the KV cache is sized):
- counts, int32 [max_num_seqs, vocab]: each penalised request's output token counts,
  reset when it takes its row (to the outputs it arrived with) and then counted from the
  worker's own samples on the device (penalties.count_outputs), never rebuilt from the
  host: 4 bytes a token a row (256 rows of a 152k vocabulary: 156 MB);
- prompt_bits, int32 [max_num_seqs, ceil(vocab / 32)]: which tokens its prompt holds,
  for the repetition penalty (a 32nd of that);
- the logit_bias of every row as one flat (row, token, bias) table, uploaded when a
  request with a bias joins or leaves;
- each row's allowed_token_ids as a bitmask (allowed_rows.py), written when it joins.

On the host: each row's penalty values and min_tokens (numpy columns), its min_tokens
stop ids and its bad words (RowTable). A step's bans are found on the
host, vectorised over the batch: min_tokens from the rows' token counts, the bad words
against the token table, which holds every earlier sample by the time a step samples
(model_runner waits for the previous step's copy there anyway). A step uploads what it
uses in one copy, and a step like the one before (the same sampling rows, no row joined
or left since, no bans) uses that copy again: a decode step's host time is what sets the
pace at small batches. A step whose sampling requests use none of this costs nothing.
"""

from __future__ import annotations

import numpy as np
import torch

from messages import SamplingParams
from zmqworker.cdiv import cdiv
from zmqworker.model_runner.allowed_rows import BITS, AllowedRows, token_bits
from zmqworker.model_runner.host_to_device import upload
from zmqworker.model_runner.penalties import Dense, Entries, Mask, PenaltyStep
from zmqworker.model_runner.row_table import RowTable


class PenaltyRows:
    def __init__(self, max_num_seqs: int, vocab_size: int, device: torch.device) -> None:
        self.num_rows = max_num_seqs
        self.vocab_size = vocab_size
        self.device = device
        words = cdiv(vocab_size, BITS)
        self.counts = torch.zeros(max_num_seqs, vocab_size, dtype=torch.int32, device=device)
        self.prompt_bits = torch.zeros(max_num_seqs, words, dtype=torch.int32, device=device)
        # Rows: repetition, frequency, presence penalty (float32, neutral values when off).
        self.values = np.tile(np.array([[1.0], [0.0], [0.0]], np.float32), max_num_seqs)
        self.penalized = np.zeros(max_num_seqs, bool)
        self.min_tokens = np.zeros(max_num_seqs, np.int64)
        self.in_use = np.zeros(max_num_seqs, bool)  # the row uses something here
        self._num_in_use = 0
        self.bias = RowTable(max_num_seqs)  # [k, 2]: token, float32 bias bits
        self.stops = RowTable(max_num_seqs)  # [k, 1]: min_tokens' stop ids
        self.bad_words = RowTable(max_num_seqs)  # [k, length]: a bad word per entry
        self.allowed = AllowedRows(max_num_seqs, vocab_size, device)
        self._bias_device: tuple[int, Entries] | None = None  # (bias.version, entries)
        self._joining: list[tuple[int, np.ndarray | None, np.ndarray]] = []
        self._version = 0  # bumped when a row that uses something here joins or leaves
        # The last step without bans, by (version, its sampling rows): used again as is.
        self._kept: tuple[tuple[int, str, bytes], PenaltyStep | None] | None = None

    @property
    def nbytes(self) -> int:
        """Device bytes held from the start (the counts, the prompt bits, the allowed
        tokens' bitmasks)."""
        held = sum(t.numel() * t.element_size() for t in (self.counts, self.prompt_bits))
        return held + self.allowed.nbytes

    # rows ------------------------------------------------------------------------------

    def add(
        self,
        row: int,
        params: SamplingParams,
        token_ids: np.ndarray,
        num_prompt: int,
        eos_token_ids: list[int],
    ) -> None:
        """A request takes row: token_ids its tokens, the first num_prompt its prompt.
        Its device state is written by flush(), once for all the step's joiners."""
        uses = False
        if params.penalized:
            self.values[:, row] = (
                params.repetition_penalty,
                params.frequency_penalty,
                params.presence_penalty,
            )
            self.penalized[row] = True
            prompt = token_ids[:num_prompt] if params.repetition_penalty != 1.0 else None
            self._joining.append((row, prompt, np.asarray(token_ids[num_prompt:], np.int64)))
            uses = True
        if params.logit_bias:
            pairs = np.array(list(params.logit_bias.items()), np.float64)
            entries = np.empty((len(pairs), 2), np.int32)
            entries[:, 0] = pairs[:, 0]
            entries[:, 1] = pairs[:, 1].astype(np.float32).view(np.int32)
            self.bias.set(row, entries)
            uses = True
        stops = self._stop_ids(params, eos_token_ids) if params.min_tokens else None
        if stops is not None and len(stops):
            self.min_tokens[row] = params.min_tokens
            self.stops.set(row, stops.reshape(-1, 1))
            uses = True
        if params.bad_words_token_ids:
            self.bad_words.set(row, _right_aligned(params.bad_words_token_ids))
            uses = True
        if params.allowed_token_ids is not None:
            self.allowed.add(row, params.allowed_token_ids)
            uses = True
        if uses:
            self.in_use[row] = True
            self._num_in_use += 1
            self._version += 1

    def remove(self, row: int) -> None:
        if not self.in_use[row]:
            return
        self.in_use[row] = False
        self._num_in_use -= 1
        self._version += 1
        self.values[:, row] = (1.0, 0.0, 0.0)
        self.penalized[row] = False
        self.min_tokens[row] = 0
        for table in (self.bias, self.stops, self.bad_words):
            table.drop(row)
        self.allowed.remove(row)
        self._joining = [j for j in self._joining if j[0] != row]

    def flush(self) -> None:
        """Write the joining rows' counts and prompt bits on the device, in one upload
        (their allowed tokens in another)."""
        self.allowed.flush()
        if not self._joining:
            return
        joining, self._joining = self._joining, []
        words = self.prompt_bits.shape[1]
        rows = np.array([row for row, _, _ in joining], np.int32)
        bits = np.zeros((len(joining), words), np.int32)
        for i, (_, prompt, _) in enumerate(joining):
            if prompt is not None:
                bits[i] = token_bits(prompt, words)
        outputs = [out for _, _, out in joining]
        out_rows = np.repeat(rows, [len(o) for o in outputs]).astype(np.int32)
        out_tokens = np.concatenate(outputs).astype(np.int32)
        rows_d, bits_d, out_rows_d, out_tokens_d = upload(
            [rows, bits, out_rows, out_tokens], self.device
        )
        index = rows_d.long()
        self.counts.index_fill_(0, index, 0)
        self.prompt_bits.index_copy_(0, index, bits_d)
        if len(out_tokens):
            ones = torch.ones(len(out_tokens), dtype=torch.int32, device=self.device)
            self.counts.index_put_((out_rows_d.long(), out_tokens_d.long()), ones, accumulate=True)

    # the step --------------------------------------------------------------------------

    def step(
        self,
        rows: np.ndarray,
        num_tokens: np.ndarray,
        num_prompt: np.ndarray,
        token_ids: np.ndarray,
    ) -> PenaltyStep | None:
        """What sampling rows (batch rows, in sample order) applies this step; None when
        none of them uses anything here. num_tokens, num_prompt and token_ids: the
        batch's columns (each row's tokens so far, its samples included)."""
        if not self._num_in_use or not self.in_use[rows].any():
            return None
        ban_rows, ban_tokens = self._bans(rows, num_tokens, num_prompt, token_ids)
        key = (self._version, rows.dtype.str, rows.tobytes())
        if not len(ban_rows) and self._kept is not None and self._kept[0] == key:
            return self._kept[1]
        step = self._upload(rows, ban_rows, ban_tokens)
        self._kept = None if len(ban_rows) else (key, step)
        return step

    def _upload(
        self, rows: np.ndarray, ban_rows: np.ndarray, ban_tokens: np.ndarray
    ) -> PenaltyStep | None:
        """The step of sampling rows with these bans, in one copy to the device."""
        arrays: list[np.ndarray] = []
        dense_at = np.flatnonzero(self.penalized[rows]).astype(np.int32)
        dense_rows = rows[dense_at].astype(np.int32)
        values = np.ascontiguousarray(self.values[:, dense_rows])
        if len(dense_at):
            arrays += [dense_at, dense_rows, values]
        if len(ban_rows):
            arrays += [ban_rows, ban_tokens]
        masked_at = np.flatnonzero(self.allowed.has[rows]).astype(np.int32)
        if len(masked_at):
            arrays += [masked_at, rows[masked_at].astype(np.int32)]
        with_bias = bool(self.bias.has[rows].any())
        if len(ban_rows) or with_bias:
            index_of_row = np.full(self.num_rows, -1, np.int32)
            index_of_row[rows] = np.arange(len(rows), dtype=np.int32)
            arrays.append(index_of_row)
        if not arrays:
            return None
        device = iter(upload(arrays, self.device))
        dense = None
        if len(dense_at):
            repetition = bool((values[0] != 1.0).any())
            dense = Dense(next(device), next(device), next(device), repetition)
        bans = Entries(next(device), next(device), None) if len(ban_rows) else None
        allowed = None
        if len(masked_at):
            # Gathered once: a step like this one uses its PenaltyStep again (step()).
            at, masked_rows = next(device), next(device)
            allowed = Mask(at, self.allowed.bits.index_select(0, masked_rows.long()))
        index = next(device, None)
        return PenaltyStep(
            self.counts,
            self.prompt_bits,
            index,
            bans,
            self._bias_entries() if with_bias else None,
            dense,
            allowed,
        )

    def dummy_step(self, n: int) -> PenaltyStep:
        """Every part on rows 0..n-1 of a dummy step (profiling, warm-up), reading the
        counts and prompt bits but writing nothing of the batch's."""
        rows = np.arange(n, dtype=np.int32)
        values = np.tile(np.array([[1.1], [0.1], [0.1]], np.float32), n)
        zeros = np.zeros(n, np.int32)
        ids, rows_d, values_d, tokens_d, bias_d = upload(
            [rows, rows, values, zeros, zeros.view(np.float32)], self.device
        )
        return PenaltyStep(
            self.counts,
            self.prompt_bits,
            ids,
            Entries(rows_d, tokens_d, None),
            Entries(rows_d, tokens_d, bias_d),
            Dense(ids, rows_d, values_d, repetition=True),
            Mask(ids, self.allowed.everything(n)),
        )

    # helpers ---------------------------------------------------------------------------

    def _stop_ids(self, params: SamplingParams, eos_token_ids: list[int]) -> np.ndarray:
        """The ids min_tokens holds back: stop_token_ids and EOS, ignore_eos or not (as
        vLLM's all_stop_token_ids), those in the vocabulary (no other can be sampled)."""
        ids = list(params.stop_token_ids) + list(eos_token_ids)
        ids_array = np.unique(np.array(ids, np.int64))
        return ids_array[(ids_array >= 0) & (ids_array < self.vocab_size)].astype(np.int32)

    def _bans(
        self,
        rows: np.ndarray,
        num_tokens: np.ndarray,
        num_prompt: np.ndarray,
        token_ids: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:
        """(batch rows, tokens) that sampling rows may not sample now, int32."""
        found: list[tuple[np.ndarray, np.ndarray]] = []
        held = num_tokens[rows] - num_prompt[rows] < self.min_tokens[rows]
        if held.any():
            stop_rows, stops = self.stops.of_rows(rows[held])
            found.append((stop_rows, stops[:, 0]))
        with_bad_words = self.bad_words.has[rows]
        if with_bad_words.any():
            word_rows, words = self.bad_words.of_rows(rows[with_bad_words])
            match = _ends_with_prefix(word_rows, words, num_tokens, num_prompt, token_ids)
            found.append((word_rows[match], words[match, -1]))
        if not found:
            return np.zeros(0, np.int32), np.zeros(0, np.int32)
        return (
            np.concatenate([r for r, _ in found]).astype(np.int32),
            np.concatenate([t for _, t in found]).astype(np.int32),
        )

    def _bias_entries(self) -> Entries:
        """Every row's logit_bias on the device, uploaded again after a change."""
        cached = self._bias_device
        if cached is None or cached[0] != self.bias.version:
            rows, table = self.bias.flat()
            rows_d, tokens_d, values_d = upload(
                [rows.astype(np.int32), table[:, 0].copy(), table[:, 1].view(np.float32)],
                self.device,
            )
            cached = self._bias_device = (self.bias.version, Entries(rows_d, tokens_d, values_d))
        return cached[1]


def _right_aligned(words: list[list[int]]) -> np.ndarray:
    """int32 [k, longest]: each word ending in the last column, -1 before it."""
    table = np.full((len(words), max(len(w) for w in words)), -1, np.int32)
    for i, word in enumerate(words):
        table[i, table.shape[1] - len(word) :] = word
    return table


def _ends_with_prefix(
    rows: np.ndarray,
    words: np.ndarray,
    num_tokens: np.ndarray,
    num_prompt: np.ndarray,
    token_ids: np.ndarray,
) -> np.ndarray:
    """bool [k]: row rows[i]'s output ends with the tokens of words[i] before its last
    (right-aligned, -1 before the word); a word longer than the output plus one never
    matches, one of a single token always does."""
    prefix = words[:, :-1]
    if prefix.shape[1] == 0:
        return np.ones(len(words), bool)
    end = num_tokens[rows].astype(np.int64)[:, None]
    positions = end - prefix.shape[1] + np.arange(prefix.shape[1])
    in_output = positions >= num_prompt[rows][:, None]
    history = token_ids[rows[:, None], np.maximum(positions, 0)]
    return ((prefix < 0) | (in_output & (history == prefix))).all(axis=1)
