"""The errors an engine sees from its executor."""

from __future__ import annotations

import signal

from messages import RemoteError


class ExecutorError(RuntimeError):
    """Base of every executor error."""


class WorkerError(ExecutorError):
    """An exception raised on a worker, with its remote traceback."""

    def __init__(self, method: str, error: RemoteError) -> None:
        self.method = method
        self.rank = error.rank
        self.exc_type = error.exc_type
        self.remote_message = error.message
        self.remote_traceback = error.traceback
        text = f"rank {error.rank} raised {error.exc_type} in {method}: {error.message}"
        if error.traceback:
            text += f"\n--- remote traceback (rank {error.rank}) ---\n{error.traceback}"
        super().__init__(text)


# Refusals a caller can act on, raised again in the engine as the same kind of error.
_LOCAL_KINDS = {
    "ValueError": ValueError,
    "CheckpointError": ValueError,
    "RuntimeError": RuntimeError,
    "TypeError": TypeError,
    "FileNotFoundError": FileNotFoundError,
}


def as_local(error: WorkerError) -> Exception:
    """A worker's refusal (a bad argument, a call out of order) as the builtin error it
    was, with its message and rank, for APIs whose callers catch ValueError and the
    like; any other error as it is. The remote traceback stays on error."""
    kind = _LOCAL_KINDS.get(error.exc_type)
    if kind is None:
        return error
    return kind(f"rank {error.rank}: {error.remote_message}")


class RpcTimeoutError(ExecutorError, TimeoutError):
    def __init__(self, method: str, missing_ranks: list[int], timeout: float) -> None:
        self.method = method
        self.missing_ranks = missing_ranks
        super().__init__(
            f"{method} timed out after {timeout:.3g} s: no reply from rank(s) "
            f"{', '.join(map(str, missing_ranks))}"
        )


class WorkerDiedError(ExecutorError):
    def __init__(self, rank: int, exit_status: int | None, where: str = "") -> None:
        self.rank = rank
        self.exit_status = exit_status
        status = "unknown exit status" if exit_status is None else describe_exit(exit_status)
        super().__init__(f"worker rank {rank}{where} died ({status})")


class WorkerStuckError(ExecutorError):
    """A worker that is alive but does not serve: stopped (SIGSTOP), or wedged below
    Python. silent_s: how long it gave no sign of life."""

    def __init__(self, rank: int, silent_s: float, why: str) -> None:
        self.rank = rank
        self.silent_s = silent_s
        super().__init__(why)

    @classmethod
    def queue_full(cls, rank: int, method: str, send_timeout_s: float) -> WorkerStuckError:
        """It left its messages unread until the queue to it filled, for the whole send
        timeout."""
        return cls(
            rank,
            send_timeout_s,
            f"{method}: worker rank {rank} is alive but has not read its messages for "
            f"{send_timeout_s:.3g} s (its queue is full); the call was not sent to it",
        )

    @classmethod
    def silent(cls, rank: int, silent_s: float) -> WorkerStuckError:
        """It stopped answering the socket's heartbeats (its process does not run)."""
        return cls(
            rank,
            silent_s,
            f"worker rank {rank} is alive but has given no sign of life for {silent_s:.3g} s "
            "(stopped, or wedged below Python): the executor kills it",
        )


class WorkerStartupError(ExecutorError):
    """A worker failed to start: its error and the tail of its stderr."""


def describe_exit(status: int) -> str:
    """A process's exit status in words: "exit status 1", "killed by SIGKILL, ..."."""
    if status < 0:
        try:
            return f"killed by {signal.Signals(-status).name}, exit status {status}"
        except ValueError:
            return f"killed by signal {-status}"
    return f"exit status {status}"
