"""One worker subprocess as the engine holds it: its pidfd, its stderr, how it is stopped."""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import threading

STDERR_TAIL_LINES = 40


class WorkerProcess:
    def __init__(self, rank: int, argv: list[str], env: dict[str, str]) -> None:
        self.rank = rank
        # A session of its own: a Ctrl-C at the terminal reaches the engine only, which
        # then stops its workers in order.
        self.proc = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        self.pid = self.proc.pid
        self.pidfd = os.pidfd_open(self.pid) if hasattr(os, "pidfd_open") else None
        self._tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        self._reader = threading.Thread(
            target=self._read_stderr, name=f"stderr-rank-{rank}", daemon=True
        )
        self._reader.start()

    def exit_status(self) -> int | None:
        return self.proc.poll()

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
        """SIGKILL, at once (a worker that no longer serves)."""
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
        prefix = f"[worker rank {self.rank}] "
        for raw in self.proc.stderr:
            line = raw.decode(errors="replace")
            self._tail.append(line)
            sys.stderr.write(prefix + line)


def spawn_all(
    argv_of: list[list[str]],
    env: dict[str, str],
    procs: list[WorkerProcess],
    until: threading.Event,
) -> None:
    """Start one worker per argv (appended to procs, in rank order) from a thread that
    stays alive until `until` is set: a worker's parent-death signal fires when the
    thread that spawned it ends, and must fire only when the engine does."""
    done = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            for rank, argv in enumerate(argv_of):
                procs.append(WorkerProcess(rank, argv, env))
        except BaseException as e:  # raised again on the caller's thread
            failure.append(e)
        finally:
            done.set()
        until.wait()

    threading.Thread(target=run, name="worker-spawner", daemon=True).start()
    done.wait()
    if failure:
        raise failure[0]
