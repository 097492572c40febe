"""Nested outputs (dataclasses, dicts, lists) compared with their floats up to rounding:
the same computation in another batch's shape, or over prefix-cached blocks, differs in
the last bits of a float."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest


def approx_tree(x: Any, tol: float = 1e-4) -> Any:
    """x with dataclasses as dicts and every float as pytest.approx(float, abs=tol):
    `plain_tree(a) == approx_tree(b)` holds when a and b differ only in float rounding."""
    if isinstance(x, float):
        return pytest.approx(x, abs=tol)
    return _walk(x, lambda y: approx_tree(y, tol))


def plain_tree(x: Any) -> Any:
    """x with dataclasses as dicts, to compare against approx_tree."""
    return x if isinstance(x, float) else _walk(x, plain_tree)


def _walk(x: Any, inner: Any) -> Any:
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        x = {f.name: getattr(x, f.name) for f in dataclasses.fields(x)}
    if isinstance(x, dict):
        return {key: inner(value) for key, value in x.items()}
    if isinstance(x, list | tuple):
        return [inner(value) for value in x]
    return x
