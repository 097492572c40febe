"""The tokens a decode instance holds the KV of when a request ends there: its prompt
and what it decoded, as this client saw them stream. The disaggregated router records
them in the decode instance's prefix record (prefix_affinity.py) once the request ends,
so that a conversation's next turn (its history and answer, then a new message) counts
only the new message as not cached there (engine/local_prefill.py)."""

from __future__ import annotations

import numpy as np

from messages import EngineCoreOutputs


class DecodedTokens:
    def __init__(self) -> None:
        self._held: dict[str, tuple[np.ndarray, list[int]]] = {}  # prompt, tokens so far

    def start(self, request_id: str, prompt: np.ndarray, first: list[int]) -> None:
        """request_id goes to a decode instance, its first tokens (the prefill's) given."""
        self._held[request_id] = (prompt, list(first))

    def add(self, msg: EngineCoreOutputs) -> None:
        """The new tokens of msg's requests (a decode instance's step)."""
        if not self._held:
            return
        tokens = msg.new_token_ids.tolist()
        offsets = None if msg.token_offsets is None else msg.token_offsets.tolist()
        for i, request_id in enumerate(msg.request_ids):
            held = self._held.get(request_id)
            if held is None:
                continue
            if offsets is None:
                held[1].append(tokens[i])
            else:
                held[1].extend(tokens[offsets[i] : offsets[i + 1]])

    def end(self, request_id: str) -> np.ndarray | None:
        """The tokens whose KV the decode instance holds as request_id ends there: all but
        the last (sampled, never computed); None for one not started here."""
        held = self._held.pop(request_id, None)
        if held is None:
            return None
        prompt, tokens = held
        return np.concatenate([prompt, np.asarray(tokens[:-1], prompt.dtype)])

    def drop(self, request_id: str) -> None:
        self._held.pop(request_id, None)
