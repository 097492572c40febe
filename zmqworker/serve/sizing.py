"""How many API server processes `zmqworker serve` runs by default (light: the command
line's help reads it)."""

from __future__ import annotations

import os


def default_api_server_count() -> int:
    """A quarter of the host's cores, 1 to 4: each API server is a Python process (one
    GIL) that takes a core of its own under load, and the engine cores and their workers
    need theirs. One on a 2-core host; four on a 16-core GPU host."""
    return max(1, min(4, (os.cpu_count() or 1) // 4))
