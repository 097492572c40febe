"""Every Triton kernel of zmqworker compiles for CUDA sm_90 (tests/triton_sm90.py), which the
interpreter the other kernel tests run in does not check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parent.parent


def _no_sm90_compiler() -> str | None:
    """Why Triton cannot compile for sm_90 here, if it cannot: a Triton before 3.5 (whose
    gdc_wait, PDL's, does not compile), no nvidia backend, or no ptxas or cuobjdump."""
    try:
        from triton import knobs
        from triton.backends.nvidia.compiler import get_ptxas

        tools = (get_ptxas(90).path, knobs.nvidia.cuobjdump.path)
    except Exception as e:
        return f"Triton 3.5 or newer with its nvidia backend is needed: {e!r}"
    for tool in tools:
        if not tool or not os.access(tool, os.X_OK):
            return f"{tool} is not executable"
    return None


NO_SM90_COMPILER = _no_sm90_compiler()


@pytest.mark.skipif(NO_SM90_COMPILER is not None, reason=str(NO_SM90_COMPILER))
def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "triton_sm90.py")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = proc.stdout.strip().splitlines()
    assert lines, f"no report (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    report = json.loads(lines[-1])
    failures = "\n\n".join(
        f"{f.get('case') or ''} [{f.get('kernel')}]\n{f['error']}" for f in report["failed"]
    )
    rc = proc.returncode
    assert rc == 0, f"kernels that do not compile for sm_90 (rc {rc}):\n\n{failures}"
    missing = sorted(set(report["defined"]) - set(report["compiled"]))
    assert not missing, f"kernels no case of tests/triton_sm90.py compiles: {missing}"
