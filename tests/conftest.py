"""Shared fixtures: the repository root on the workers' import path, and leak checks."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Worker subprocesses import test and benchmark classes (bench.echo_worker) by name.
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p
)
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors. It is chosen
# when a kernel is defined, so before any test imports one.
if os.environ.get("ZMQWORKER_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The interpreter re-patches triton.language at every call of a jit'd function inside a
# kernel; once per launch is enough (tests/triton_interpreter.py).
if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton"):
    from tests.triton_interpreter import patch_once_per_launch

    patch_once_per_launch()
