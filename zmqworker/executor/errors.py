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
        status = "unknown exit status" if exit_status is None else _describe(exit_status)
        super().__init__(f"worker rank {rank}{where} died ({status})")


class WorkerStuckError(ExecutorError):
    """A worker that is alive has left its messages unread until the engine's queue to it
    filled up, and stayed so for the whole send timeout (stopped, or wedged)."""

    def __init__(self, rank: int, method: str, send_timeout_s: float) -> None:
        self.rank = rank
        self.method = method
        super().__init__(
            f"{method}: worker rank {rank} is alive but has not read its messages for "
            f"{send_timeout_s:.3g} s (its queue is full); the call was not sent to it"
        )


class WorkerStartupError(ExecutorError):
    """A worker failed to start: its error and the tail of its stderr."""


def _describe(status: int) -> str:
    if status < 0:
        try:
            return f"killed by {signal.Signals(-status).name}, exit status {status}"
        except ValueError:
            return f"killed by signal {-status}"
    return f"exit status {status}"
