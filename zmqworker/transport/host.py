"""Which host a process runs on, as its peers on that host see it."""

from __future__ import annotations


def boot_id() -> str:
    """This host's boot id: two processes that share it can map each other's memfds
    (when /proc lets them, which the KV puller finds out)."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        return f.read().strip()


def host_id() -> str:
    """This host's boot id, or "" where it does not say: what an engine core's Ready
    names its host by, a hint to a router (never taken as the same host as another
    unknown one, as a KV peer's boot id is)."""
    try:
        return boot_id()
    except OSError:
        return ""
