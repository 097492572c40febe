"""Which host a process runs on, as its peers on that host see it."""

from __future__ import annotations


def boot_id() -> str:
    """This host's boot id: two processes that share it can map each other's memfds
    (when /proc lets them, which the KV puller finds out)."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        return f.read().strip()
