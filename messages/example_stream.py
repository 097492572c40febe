"""Deterministic pseudo-random numbers for the example messages (messages/examples.py),
whose bytes are the golden fixtures': the same numbers on every machine and release."""

from __future__ import annotations

import hashlib
import math

import numpy as np


def req_id(i: int) -> str:
    """A request id shaped like vLLM's completion ids, "cmpl-<32 hex>-0", derived from i."""
    return f"cmpl-{hashlib.md5(str(i).encode()).hexdigest()}-0"


class Stream:
    """Deterministic pseudo-random numbers (splitmix64 over a counter). Not
    np.random.Generator: numpy does not promise its streams stay the same across
    releases, and the fixtures' bytes must not change with the numpy version."""

    def __init__(self, seed: int) -> None:
        self._next = seed << 32

    def _u64(self, n: int) -> np.ndarray:
        x = np.arange(self._next, self._next + n, dtype=np.uint64)
        self._next += n
        # integer arrays wrap silently: the multiplications are mod 2**64 on purpose
        x = x * np.uint64(0x9E3779B97F4A7C15)
        z = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))

    def ints(self, shape: int | tuple[int, ...], low: int, high: int) -> np.ndarray:
        """int32 values in [low, high)."""
        n = math.prod(shape) if isinstance(shape, tuple) else shape
        values = (self._u64(n) % np.uint64(high - low)).astype(np.int64) + low
        return values.astype(np.int32).reshape(shape)

    def floats(self, shape: tuple[int, ...], low: float, high: float) -> np.ndarray:
        """float32 values in [low, high), multiples of (high - low) / 2**24."""
        unit = (self._u64(math.prod(shape)) >> np.uint64(40)).astype(np.float32) / 2**24
        return (unit * np.float32(high - low) + np.float32(low)).reshape(shape)

    def distinct(self, n: int, high: int) -> np.ndarray:
        """n distinct int32 values in [0, high)."""
        return np.argsort(self._u64(high), kind="stable")[:n].astype(np.int32)
