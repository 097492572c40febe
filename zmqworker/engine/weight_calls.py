"""The engine core's calls that change the workers' weights (from a trainer's group, from
disk, or pushed by a client through collective_rpc), and what it knows of them: the
weights are ready for a step, or why not (dropped by sleep(level=2), an update under way,
or one that failed once weights may have changed).

A worker says its weights may have changed when a call fails by raising
PartialLoadError (zmqworker.models.loader: a reload that failed after copying began, an
update from the group that failed past the ranks' agreement, a pushed update's chunk or
end that failed after rows had come). The engine core keeps that reason until a complete
update or a reload, refuses requests and steps with it (not_ready), and forgets its
cached prefixes, whose keys and values may come from either weights. A refusal before
any change (a bad name or shape, a folder that does not fit: every rank refuses it alike)
leaves the weights serving.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from messages import WeightUpdate
from zmqworker.executor.errors import WorkerError, as_local

if TYPE_CHECKING:
    from zmqworker.engine.block_manager import KVBlockManager
    from zmqworker.executor.abstract import Executor

# The worker's error for weights that may have changed (zmqworker.models.loader's: the
# engine imports no torch).
PARTIAL_LOAD = "PartialLoadError"
RELEASED = (
    "the weights were released by sleep(level=2) and have not been loaded since: "
    "update_weights() or reload_weights() first"
)
PUSHING = "a weight update is in progress: its chunks are coming (finish_weight_update ends it)"
PUSH_ENDED = (
    "a weight update ended before all of its tensors came, after some had: send a complete "
    "update or reload the weights before a step"
)
# Worker methods of an update pushed by a client (executor/weight_push.py), in order.
PUSH_METHODS = frozenset(
    {"start_weight_update", "load_weight_chunk", "finish_weight_update", "abort_weight_update"}
)


class WeightCalls:
    """The engine core's weight calls and the state they leave (EngineCore.weights): the
    core's executor and block manager, and its drain, which each call runs first."""

    def __init__(
        self, executor: Executor, block_manager: KVBlockManager, drain: Callable[[], None]
    ) -> None:
        self._executor = executor
        self._block_manager = block_manager
        self._drain = drain
        self.released = False  # sleep(2) dropped them; no update or reload since
        self.broken: str | None = None  # a failure once weights may have changed
        self.pushing = False  # a pushed update's rows have started coming

    def not_ready(self) -> str | None:
        """Why the weights cannot serve a step; None when they can."""
        if self.released:
            return RELEASED
        if self.broken is not None:
            return self.broken
        return PUSHING if self.pushing else None

    def init_weight_transfer_group(
        self, host: str, port: int, world_size: int, rank_offset: int, timeout_s: float
    ) -> None:
        self._drain()
        with refusals():
            self._executor.collective_rpc(
                "init_weight_transfer_group",
                (host, port, world_size, rank_offset, timeout_s),
                timeout=timeout_s + 60.0,  # the group's own waits are bounded by timeout_s
            )

    def update_weights_from_group(self, update: WeightUpdate) -> None:
        self._drain()
        with self._weight_change():
            self._executor.collective_rpc(
                "update_weights_from_group", (update,), timeout=self._executor.call_timeout_s
            )
        self.updated()

    def reload_weights(self, path: str | None) -> None:
        self._drain()
        with self._weight_change():
            self._executor.collective_rpc(
                "reload_weights", (path,), timeout=self._executor.call_timeout_s
            )
        self.updated()

    def updated(self) -> None:
        """New weights are in, whole (a client pushed them, or a group or the disk gave
        them): cached blocks hold keys and values of the old ones."""
        self._block_manager.reset_prefix_cache(new_weights=True)
        self.released = False
        self.broken = None
        self.pushing = False

    def worker_call(self, method: str, args: tuple, run: Callable[[], Any]) -> Any:
        """run() (a collective_rpc of method), following a pushed update's calls: rows
        that came (a chunk taken) make it under way until its end; an end without them
        all, or a failure the workers report as PartialLoadError, leaves the weights
        refusing steps until a complete update or a reload."""
        if method not in PUSH_METHODS:
            return run()
        if method == "start_weight_update" and self.pushing:  # the workers abandon it
            self._broken(PUSH_ENDED)
        with self._weight_change():
            try:
                result = run()
            except Exception:
                if method in ("finish_weight_update", "abort_weight_update"):
                    self.pushing = False  # ended: refused before any weight changed
                raise
        if method == "load_weight_chunk" and args and getattr(args[0], "tensors", None):
            self.pushing = True
        elif method == "abort_weight_update" and self.pushing:
            self._broken(PUSH_ENDED)
        elif method == "finish_weight_update":  # complete: what the workers serve now
            self.updated()
        return result

    @contextlib.contextmanager
    def _weight_change(self) -> Iterator[None]:
        """A worker's refusal as the builtin error it was; a PartialLoadError recorded
        (its reason, for not_ready) and raised as a RuntimeError naming its rank."""
        try:
            yield
        except WorkerError as e:
            if e.exc_type != PARTIAL_LOAD:
                local = as_local(e)
                if local is e:
                    raise
                raise local from e
            reason = f"rank {e.rank}: {e.remote_message}"
            self._broken(reason)
            raise RuntimeError(reason) from e

    def abandon_push(self) -> None:
        """The client pushing an update is gone: its update ends where it is."""
        if self.pushing:
            self._broken(PUSH_ENDED)

    def _broken(self, reason: str) -> None:
        self.pushing = False
        self.broken = self.broken or reason
        # Its blocks may hold either weights' KV. Not counted as new weights: no step runs
        # until an update or a reload does, which counts.
        self._block_manager.reset_prefix_cache()


@contextlib.contextmanager
def refusals() -> Iterator[None]:
    """A worker's refusal raised as the builtin error it was (executor/errors.py)."""
    try:
        yield
    except WorkerError as e:
        local = as_local(e)
        if local is e:
            raise
        raise local from e
