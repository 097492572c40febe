"""Dying with the engine: the kernel sends PARENT_DEATH_SIGNAL to a worker whose parent
exits (PR_SET_PDEATHSIG, Linux), which the worker answers by leaving at once, removing
the engine's socket file as it goes (fast_exit.py). A signal of its own, not SIGTERM: a
SIGTERM may come from a live engine, whose files are not the worker's to remove. The
engine watch (a dropped connection, a changed parent) stays as the slower second way, and
the only one elsewhere.

The signal is held (blocked) from before the request until the worker's handler exists:
its default action would end the process with the engine's files left behind. One that
comes meanwhile waits, and is handled once released."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal

PR_SET_PDEATHSIG = 1
# The worker runs in a session of its own, without a terminal: no other SIGHUP comes.
PARENT_DEATH_SIGNAL = signal.SIGHUP


def exit_with_parent(parent_pid: int) -> bool:
    """Ask for PARENT_DEATH_SIGNAL when the parent dies; False when it died already (then
    nothing will come). Without prctl (not Linux), True: the engine watch still works."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is not None:
        libc = ctypes.CDLL(libc_name, use_errno=True)
        prctl = getattr(libc, "prctl", None)
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, int(PARENT_DEATH_SIGNAL), 0, 0, 0)
    # The parent may have gone before the request: then the signal never comes.
    return os.getppid() == parent_pid


def has_exited(pid: int) -> bool:
    """Whether process pid has exited; a zombie (its parent has not reaped it yet) has."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's process: there
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"
    except OSError:  # no /proc (not Linux): there, as os.kill said
        return False


def orphaned() -> bool:
    """Whether this process lost the parent that started it: init (pid 1 of its pid
    namespace) adopted it. Adoption by a child subreaper cannot be told from a parent
    of its own, and is not taken for one."""
    return os.getppid() == 1


def hold_parent_death() -> None:
    """Block PARENT_DEATH_SIGNAL in this thread and the threads it starts from now on: it
    waits until release_parent_death(), and then goes to this thread alone."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {PARENT_DEATH_SIGNAL})


def release_parent_death() -> None:
    """Unblock PARENT_DEATH_SIGNAL in this thread, once its handler is installed: one
    that came while it was held is delivered now."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {PARENT_DEATH_SIGNAL})


def follow_spawner(argv: list[str]) -> bool:
    """For a process our code spawns with its own pid as argv[1] (an engine core, an API
    server): ask for PARENT_DEATH_SIGNAL, held until release_parent_death(); False when
    the spawner is gone already (this process's parent is another by now)."""
    try:
        spawner = int(argv[1]) if len(argv) > 1 else os.getppid()
    except ValueError:
        raise SystemExit(f"{argv[0]}: error: argv[1] must be the spawner's pid") from None
    hold_parent_death()
    return exit_with_parent(spawner)
