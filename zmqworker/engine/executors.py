"""The executors an engine core can run its workers with, by name."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from messages import WorkerConfig
    from zmqworker.executor.abstract import Executor

EXECUTORS = {
    "mp": "zmqworker.executor.multiproc.MultiprocExecutor",
    "ray": "zmqworker.executor.ray_executor.RayExecutor",
}


def executor_factory(name: str) -> Callable[[WorkerConfig], Executor]:
    """The executor class named name (imported when used)."""
    module_name, _, class_name = EXECUTORS[name].rpartition(".")

    def make(config: WorkerConfig) -> Executor:
        return getattr(importlib.import_module(module_name), class_name)(config)

    return make
