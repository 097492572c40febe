"""Every Python block of the README runs as it is written (the openai snippet runs in
test_serve.py, against a real server)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from zmqworker.models.embedded import default_model_path

ROOT = Path(__file__).resolve().parent.parent


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_the_readme_has_python_blocks():
    assert len(python_blocks()) >= 3


@pytest.mark.parametrize(
    "block", [b for b in python_blocks() if "import openai" not in b], ids=lambda b: b[:40]
)
def test_a_python_block_runs(block):
    require_embedded_model()
    out = subprocess.run(
        [sys.executable, "-c", block], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip(), "the block prints what it shows"


def require_embedded_model() -> None:
    try:
        default_model_path(progress=False)
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        pytest.skip(f"the embedded model is not installed: {exc}")
