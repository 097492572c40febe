"""A subprocess as its parent holds it (a worker, an engine core, an API server): its
pidfd, its stderr (relayed line by line, its tail kept), how it is stopped; and the thread
that spawns a set of them, whose life their parent-death signal follows."""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

STDERR_TAIL_LINES = 40


class ChildProcess:
    """name: how its log lines and errors call it ("worker rank 1"). stdin: bytes written
    to its stdin, which is then closed (its configuration, out of sight of ps); None:
    no stdin. pass_fds: file descriptors it inherits (a listening socket)."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str],
        stdin: bytes | None = None,
        pass_fds: tuple[int, ...] = (),
    ) -> None:
        self.name = name
        # A session of its own: a Ctrl-C at the terminal reaches its parent only, which
        # then stops it in order.
        self.proc = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            pass_fds=pass_fds,
        )
        self.pid = self.proc.pid
        self.pidfd = os.pidfd_open(self.pid) if hasattr(os, "pidfd_open") else None
        if stdin is not None:
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.write(stdin)
                self.proc.stdin.close()
            except BrokenPipeError:  # it died at once: its exit status and stderr say why
                pass
        self._tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        self._reader = threading.Thread(
            target=self._read_stderr, name=f"stderr-{name.replace(' ', '-')}", daemon=True
        )
        self._reader.start()

    def exit_status(self) -> int | None:
        return self.proc.poll()

    def stopped(self) -> bool:
        """Whether it is stopped (SIGSTOP, a debugger): it runs nothing, until SIGCONT."""
        return self.exit_status() is None and process_state(self.pid) in ("T", "t")

    def stderr_tail(self) -> str:
        self._reader.join(timeout=0.5)  # a dead worker's last lines may still be in the pipe
        return "".join(self._tail)

    def wait(self, timeout: float) -> bool:
        try:
            self.proc.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False

    def kill(self) -> None:
        """SIGKILL, at once (a process that no longer serves)."""
        try:
            self.proc.send_signal(signal.SIGKILL)
        except ProcessLookupError:
            return

    def stop(self, grace_s: float, term_s: float) -> None:
        """Wait grace_s for a polite exit, then SIGTERM, then SIGKILL."""
        if self.wait(grace_s):
            return
        for sig, wait_s in ((signal.SIGTERM, term_s), (signal.SIGKILL, 5.0)):
            try:
                self.proc.send_signal(sig)
                if sig == signal.SIGTERM:  # a stopped process handles it once continued
                    self.proc.send_signal(signal.SIGCONT)
            except ProcessLookupError:
                return
            if self.wait(wait_s):
                return

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
        self._reader.join(timeout=1.0)
        if self.proc.stderr is not None:
            self.proc.stderr.close()

    def _read_stderr(self) -> None:
        prefix = f"[{self.name}] "
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            # Its last line may lack an end: what the parent writes next starts a line.
            line = raw.decode(errors="replace").removesuffix("\n") + "\n"
            self._tail.append(line)
            sys.stderr.write(prefix + line)


class WorkerProcess(ChildProcess):
    def __init__(self, rank: int, argv: list[str], env: dict[str, str]) -> None:
        self.rank = rank
        super().__init__(f"worker rank {rank}", argv, env)


def process_state(pid: int) -> str:
    """The state letter of /proc/PID/stat (R, S, T for stopped, Z...); "" when unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):  # gone, or no /proc (not Linux)
        return ""


P = TypeVar("P")


def spawn_all(makers: list[Callable[[], P]], procs: list[P], until: threading.Event) -> None:
    """Start a process per maker (appended to procs, in order) from a thread that stays
    alive until `until` is set: a child's parent-death signal fires when the thread that
    spawned it ends, and must fire only when its parent process does."""
    done = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            for make in makers:
                procs.append(make())
        except BaseException as e:  # raised again on the caller's thread
            failure.append(e)
        finally:
            done.set()
        until.wait()

    threading.Thread(target=run, name="spawner", daemon=True).start()
    done.wait()
    if failure:
        raise failure[0]
