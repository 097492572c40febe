"""Anonymous shared memory between processes of one host: a memfd that its maker seals
against resizing, and that a peer (same user, same host) opens through
/proc/<pid>/fd/<fd>. The kernel frees it with the last process that maps it, however
that process ends, so nothing is left behind. A peer opens only a memfd of the expected
name (another fd of the maker's could be a device) that is sealed against shrinking (a
file shrunk under a mapping would SIGBUS the reader).
"""

from __future__ import annotations

import fcntl
import mmap
import os

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def create_sealed(name: str, nbytes: int) -> tuple[int, mmap.mmap]:
    """A new memfd of nbytes, sealed, and its mapping; the caller owns the fd."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        return fd, mmap.mmap(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise


def open_peer(
    pid: int,
    peer_fd: int,
    name: str,
    error: type[Exception],
    what: str,
    writable: bool = True,
    inode: int = 0,
) -> tuple[int, int]:
    """(fd, size in bytes) of the peer's memfd, checked as the module says (error naming
    the path otherwise), opened for writing too unless not writable; the caller closes
    the fd. OSError where it cannot be reached; ValueError where it is another memfd
    than inode (0: unchecked): the peer closed the one named and reused its number."""
    path = f"/proc/{pid}/fd/{peer_fd}"
    target = os.readlink(path)
    if target.removesuffix(" (deleted)") != f"/memfd:{name}":
        raise error(f"{path} is {target!r}, not a {what}")
    fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC)
    try:
        if not fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK:
            raise error(f"{path} is not sealed against shrinking")
        stat = os.fstat(fd)
        if inode and stat.st_ino != inode:
            raise ValueError(
                f"the peer's fd {peer_fd} is another memfd now (inode {stat.st_ino}, not "
                f"{inode}): the {what} it held is gone"
            )
        return fd, stat.st_size
    except BaseException:
        os.close(fd)
        raise
