"""Where a worker's sockets live: its pipeline receiver's address, and the ipc socket
files a worker removes when it leaves (the engine's too, when the engine was killed)."""

from __future__ import annotations

import os
import socket
from pathlib import Path


def default_data_bind(engine_address: str, rank: int) -> str:
    """Where the pipeline receiver binds: beside the engine's ipc socket, or on the
    interface that reaches the engine's tcp host."""
    if engine_address.startswith("ipc://"):
        folder = Path(engine_address[len("ipc://") :]).parent
        return f"ipc://{folder}/data-{rank}-{os.getpid()}.sock"
    host = engine_address[len("tcp://") :].rsplit(":", 1)[0]
    return f"tcp://{_local_ip_towards(host)}:*"


def _local_ip_towards(host: str) -> str:
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))  # no packet is sent: this only picks the route
        return probe.getsockname()[0]


def remove_socket_file(address: str) -> None:
    """Remove an ipc address's socket file, then its folder if that is empty now (an
    engine killed outright cannot remove its own: its workers do)."""
    if not address.startswith("ipc://"):
        return
    path = Path(address[len("ipc://") :])
    for remove in (path.unlink, path.parent.rmdir):
        try:
            remove()
        except OSError:
            continue  # another worker removed it first, or the folder still holds files


def socket_in_use(address: str) -> bool:
    """Whether a process listens on an ipc address's socket file (a live engine's, which
    is not a worker's to remove); False for tcp or when none does."""
    if not address.startswith("ipc://"):
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(address[len("ipc://") :])
        except OSError:  # refused (nobody listens), not a socket, not there
            return False
    return True
