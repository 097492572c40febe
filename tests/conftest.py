"""Shared fixtures: the repository root on the workers' import path, the Triton
interpreter on the CPU, and the server that two test files share."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

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


@pytest.fixture(scope="session")
def two_api_servers():
    """`zmqworker serve` with two API server processes on the embedded model, shared by
    test_serve.py and test_serve_sampling.py (starting one is most of their time); the
    last test of test_serve_sampling.py stops it with SIGTERM. A generous shutdown timeout:
    a loaded machine must not cut that drain short."""
    from tests.test_serve import Server

    srv = Server("--api-server-count", "2", "--shutdown-timeout", "300")
    yield srv
    srv.stop()
