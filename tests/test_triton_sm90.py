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
SHARDS = 2


@pytest.mark.skipif(NO_SM90_COMPILER is not None, reason=str(NO_SM90_COMPILER))
def test_every_kernel_compiles_for_sm90():
    """The cases in two processes at once (compiling is one core's work each)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    script = str(ROOT / "tests" / "triton_sm90.py")
    shards = [
        subprocess.Popen(
            [sys.executable, script, "--shard", f"{i}/{SHARDS}"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(SHARDS)
    ]
    reports = []
    try:
        for proc in shards:
            out, err = proc.communicate(timeout=600)
            lines = out.strip().splitlines()
            assert lines, f"no report (rc {proc.returncode}):\n{err[-4000:]}"
            reports.append((proc.returncode, json.loads(lines[-1])))
    finally:
        for proc in shards:
            proc.kill()
            proc.wait()
    failed = [f for _, report in reports for f in report["failed"]]
    failures = "\n\n".join(
        f"{f.get('case') or ''} [{f.get('kernel')}]\n{f['error']}" for f in failed
    )
    codes = [rc for rc, _ in reports]
    assert codes == [0] * SHARDS, f"kernels that do not compile (rc {codes}):\n\n{failures}"
    compiled = set().union(*(report["compiled"] for _, report in reports))
    missing = sorted(set(reports[0][1]["defined"]) - compiled)
    assert not missing, f"kernels no case of tests/triton_sm90.py compiles: {missing}"
