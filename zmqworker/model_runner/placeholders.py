"""Placeholders (async scheduling): a cached request's last scheduled token that the
engine has not seen, because the worker's previous step sampled it. The worker takes it
from its own sample (the token table, or on CUDA the token feed on the device), so it
must be the very position this worker sampled last for the request."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def check_placeholders(
    last_sampled: np.ndarray,
    fail: Callable[[np.ndarray, Callable[[int], str]], None],
    placeholders: np.ndarray,
    rows: np.ndarray,
    resumed: np.ndarray,
    computed: np.ndarray,
    end: np.ndarray,
    num_tokens: np.ndarray,
) -> None:
    """Refuse (through fail, which names the request) a bad placeholder. last_sampled:
    each batch row's latest sampled position, or -1; rows: the requests' rows, -1 for
    one coming back from preemption; end: num_computed + num_scheduled."""
    fail(
        (placeholders < 0) | (placeholders > 1),
        lambda i: f"num_placeholders must be 0 or 1, got {placeholders[i]}",
    )
    has = placeholders == 1
    fail(has & ((rows < 0) | resumed), lambda i: "a resumed request cannot have a placeholder")
    last = np.full(len(rows), -1, np.int64)
    last[rows >= 0] = last_sampled[rows[rows >= 0]]
    fail(
        has & (last != end - 1),
        lambda i: (
            f"its placeholder is position {end[i] - 1}, but this worker's last sample for "
            + (f"it is position {last[i]}" if last[i] >= 0 else "it: none")
        ),
    )
    fail(
        has & (computed + num_tokens > end - 1),
        lambda i: f"new_token_ids reach position {end[i] - 1}, its placeholder",
    )
