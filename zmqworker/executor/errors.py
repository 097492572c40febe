"""The errors an engine sees from its executor."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

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


class UndecodableReplyError(ExecutorError):
    """A worker's reply to a call that the engine could not decode (a result that is not
    a Value, from a worker of another build or language)."""

    def __init__(self, method: str, rank: int, reason: str) -> None:
        self.method = method
        self.rank = rank
        super().__init__(f"{method}: the reply of rank {rank} did not decode: {reason}")


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
        self.timeout = timeout
        super().__init__(self._text())

    def _text(self) -> str:
        ranks = ", ".join(map(str, self.missing_ranks))
        return f"{self.method} timed out after {self.timeout:.3g} s: no reply from rank(s) {ranks}"


STEP_METHODS = frozenset({"execute_model", "sample_tokens"})


class StepTimeoutError(RpcTimeoutError):
    """A step (STEP_METHODS) that got no reply within its bound: its workers are wedged
    (a rank stuck in the step holds up its peers in their collectives), so an engine
    cannot go on with them. missing_ranks: the ranks it waited on (the output rank
    alone, for a step), which need not be the rank that is stuck."""

    def _text(self) -> str:
        ranks = ", ".join(map(str, self.missing_ranks))
        return (
            f"{self.method}: the step got no reply within {self.timeout:.3g} s (its bound, "
            f"step_timeout_s) from rank(s) {ranks}, which it waited on; the step may be "
            "stuck on any rank (one that hangs holds up the others): the workers are wedged"
        )


DEATH_NEWS_S = 0.5  # the longest a live rank's error waits for the news of a death


def death_behind(
    exc: Exception, failure: Callable[[], BaseException | None]
) -> BaseException | None:
    """The death of a worker that exc, a live rank's error, may come of (failure(): the
    executor's, once it shows): a death fails the step on its peers too (a collective
    cut short), and the kernel can close the dead rank's sockets a moment before its end
    shows. A refusal (ValueError, TypeError) comes of none."""
    if not isinstance(exc, WorkerError) or exc.exc_type in ("ValueError", "TypeError"):
        return failure()
    deadline = time.monotonic() + DEATH_NEWS_S
    while (lost := failure()) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return lost


def timed_out(method: str, missing_ranks: list[int], timeout: float) -> RpcTimeoutError:
    """The error of a call that got no reply within timeout: a StepTimeoutError for a
    step, which an engine cannot outlive, an RpcTimeoutError for any other call."""
    kind = StepTimeoutError if method in STEP_METHODS else RpcTimeoutError
    return kind(method, missing_ranks, timeout)


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
    def stopped(cls, rank: int, stopped_s: float, what: str) -> WorkerStuckError:
        """Its process is stopped (SIGSTOP, a debugger) while the engine waits for what."""
        return cls(
            rank,
            stopped_s,
            f"worker rank {rank} is stopped (its process is in state T) and has been for "
            f"{stopped_s:.3g} s while the engine waited for {what}: the executor kills it",
        )

    @classmethod
    def unreachable(cls, rank: int, what: str, grace_s: float) -> WorkerStuckError:
        """Its connection is gone (heartbeats dropped it) though its process lives on."""
        return cls(
            rank,
            grace_s,
            f"{what}: worker rank {rank} is alive but its connection to the engine is gone "
            f"(no death followed within {grace_s:.3g} s: stopped, or wedged below Python): "
            "the executor kills it",
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


# What an engine cannot go on after: a worker dead, stuck, or wedged in a step.
WORKERS_LOST = (WorkerDiedError, WorkerStuckError, StepTimeoutError)


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
