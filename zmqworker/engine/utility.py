"""Utility calls: what a client may call on an engine core by name, between two steps.

The allowlist is the public methods of EngineCoreUtilities, with the argument types they
declare: a call's arguments are converted to them (msgspec), so a bad one is an error
naming it, and nothing else of the engine core is reachable. A method named in
WAITS_FOR_STEPS runs once every step in flight has come back and its outputs have gone
to their clients: it never lands mid-step. A worker's refusal (a bad argument, a call out
of order) comes back as the builtin error it was (executor/errors.py, as_local).
"""

from __future__ import annotations

import functools
import inspect
import typing
from typing import Any

import msgspec

from messages import EngineCoreStats, UtilityCall, WeightUpdate, WorkerCall
from zmqworker.engine.core import EngineCore
from zmqworker.executor.errors import WorkerError, as_local

# What changes the workers or the cache: the steps in flight come back first.
WAITS_FOR_STEPS = frozenset(
    {
        "sleep",
        "wake_up",
        "reset_prefix_cache",
        "reload_weights",
        "init_weight_transfer_group",
        "update_weights_from_group",
        "weights_updated",
        "collective_rpc",
    }
)


class EngineCoreUtilities:
    """The calls an engine core serves, each over its EngineCore."""

    def __init__(self, core: EngineCore) -> None:
        self._core = core

    def check_health(self, timeout: float = 10.0) -> None:
        """Every worker answers check_health within timeout (beside any step)."""
        self._core.check_health(timeout)

    def stats(self) -> EngineCoreStats:
        return self._core.stats()

    def not_ready(self) -> str | None:
        """Why no request can run now (asleep, weights dropped); None when one can."""
        return self._core.not_ready()

    def is_sleeping(self) -> bool:
        """Whether sleep gave anything back that wake_up has not taken again."""
        return bool(self._core.released)

    def sleep(self, level: int = 1) -> None:
        self._core.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._core.wake_up(tags)

    def reset_prefix_cache(self) -> None:
        self._core.reset_prefix_cache()

    def reload_weights(self, path: str | None = None) -> None:
        self._core.weights.reload_weights(path)

    def init_weight_transfer_group(
        self, host: str, port: int, world_size: int, rank_offset: int, timeout_s: float
    ) -> None:
        weights = self._core.weights
        weights.init_weight_transfer_group(host, port, world_size, rank_offset, timeout_s)

    def update_weights_from_group(self, update: WeightUpdate) -> None:
        self._core.weights.update_weights_from_group(update)

    def weights_updated(self) -> None:
        """A client pushed new weights to the workers (collective_rpc calls)."""
        self._core.weights.updated()

    def collective_rpc(self, call: WorkerCall) -> list:
        """A worker method on every rank: the results by rank."""
        try:
            return self._core.collective_rpc(
                call.method, tuple(call.args), call.kwargs, call.timeout
            )
        except WorkerError as exc:
            local = as_local(exc)
            if local is exc:
                raise
            raise local from exc


UTILITY_METHODS: dict[str, bool] = {
    name: name in WAITS_FOR_STEPS
    for name, member in vars(EngineCoreUtilities).items()
    if callable(member) and not name.startswith("_")
}


def waits_for_steps(method: str) -> bool:
    return UTILITY_METHODS.get(method, False)


def call_utility(target: EngineCoreUtilities, call: UtilityCall) -> Any:
    """Run call.method of target with the call's arguments, each converted to its
    parameter's type; AttributeError for a method not in the allowlist, TypeError or
    ValueError for arguments that do not fit."""
    if call.method not in UTILITY_METHODS:
        raise AttributeError(
            f"{call.method!r} is not an engine core utility; those are "
            f"{', '.join(sorted(UTILITY_METHODS))}"
        )
    method = getattr(target, call.method)
    bound = inspect.signature(method).bind(*call.args, **call.kwargs)
    hints = parameter_types(call.method)
    for name, value in bound.arguments.items():
        try:
            bound.arguments[name] = msgspec.convert(value, hints[name])
        except msgspec.ValidationError as exc:
            raise ValueError(f"{call.method}: argument {name}: {exc}") from None
    return method(*bound.args, **bound.kwargs)


@functools.cache
def parameter_types(method: str) -> dict[str, Any]:
    """The declared types of a utility method's parameters."""
    function = getattr(EngineCoreUtilities, method)
    hints = typing.get_type_hints(function)
    names = list(inspect.signature(function).parameters)[1:]  # not self
    return {name: hints[name] for name in names}
