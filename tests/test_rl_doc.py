"""Every Python block of docs/rl.md runs as it is written, each as a script of its own
(the second spawns its trainer process, which imports the script as its main module)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_readme import require_embedded_model

ROOT = Path(__file__).resolve().parent.parent


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "rl.md").read_text(), re.S)


def test_the_page_has_its_loops():
    assert len(python_blocks()) == 2


@pytest.mark.parametrize("block", python_blocks(), ids=["in_process", "trainer_process"])
def test_a_python_block_runs(block, tmp_path):
    require_embedded_model()
    script = tmp_path / "loop.py"
    script.write_text(block)
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip(), "the block prints what it shows"
