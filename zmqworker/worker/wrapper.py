"""WorkerWrapper: the object an executor creates first, before the worker exists.

It learns its environment (update_environment_variables), then builds the real worker
(init_worker) from a class named by string, optionally combined with a worker extension
class. Late construction is what lets CUDA_VISIBLE_DEVICES and friends be set before
torch touches the device. Calls are forwarded to the worker, but only the allowlisted
methods can be reached through execute_method, the one entry point of the RPC layer.
"""

from __future__ import annotations

import importlib
import inspect
import os
from typing import Any

from zmqworker.worker.worker_base import RPC_METHODS, WorkerBase


def resolve_class(qualname: str) -> type:
    """ "package.module.Class" -> the class, with an error naming what is missing."""
    module_name, _, class_name = qualname.rpartition(".")
    if not module_name:
        raise ValueError(f"class name {qualname!r} is not qualified (package.module.Class)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import module {module_name!r} for {qualname!r}: {e}") from e
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        raise ValueError(f"module {module_name!r} has no class {class_name!r}")
    return cls


def public_methods(cls: type) -> set[str]:
    return {
        name
        for name, value in inspect.getmembers(cls)
        if not name.startswith("_") and callable(value)
    }


def with_extension(worker_cls: type, extension_cls: type) -> type:
    """A new subclass of both; neither class is modified. A public or private attribute
    defined by the extension that the worker class already has is a clash."""
    clashes = sorted(
        name
        for name in vars(extension_cls)
        if not (name.startswith("__") and name.endswith("__")) and hasattr(worker_cls, name)
    )
    if clashes:
        raise ValueError(
            f"worker extension {extension_cls.__qualname__} redefines "
            f"{', '.join(clashes)} of {worker_cls.__qualname__}"
        )
    name = f"{worker_cls.__name__}With{extension_cls.__name__}"
    return type(name, (worker_cls, extension_cls), {"__module__": worker_cls.__module__})


class WorkerWrapper:
    def __init__(self, rpc_rank: int = 0) -> None:
        self.rpc_rank = rpc_rank
        self.worker: WorkerBase | None = None
        self.rpc_methods: frozenset[str] = RPC_METHODS

    def update_environment_variables(self, per_rank_envs: list[dict[str, str]]) -> None:
        """Apply this rank's entry of per_rank_envs to os.environ."""
        env = _pick(per_rank_envs, self.rpc_rank, "per_rank_envs")
        for key, value in env.items():
            os.environ[key] = str(value)

    def init_worker(self, per_rank_kwargs: list[dict[str, Any]]) -> None:
        """Build the worker from this rank's kwargs; "config" (a WorkerConfig) names the
        worker class and the optional extension class."""
        if self.worker is not None:
            raise RuntimeError(f"rank {self.rpc_rank}: the worker exists already")
        kwargs = dict(_pick(per_rank_kwargs, self.rpc_rank, "per_rank_kwargs"))
        config = kwargs["config"]
        cls = resolve_class(config.worker_cls)
        if not issubclass(cls, WorkerBase):
            raise ValueError(f"{config.worker_cls} is not a WorkerBase subclass")
        methods = set(RPC_METHODS)
        if config.worker_extension_cls:
            extension = resolve_class(config.worker_extension_cls)
            cls = with_extension(cls, extension)
            methods |= public_methods(extension)
        kwargs.setdefault("rank", self.rpc_rank)
        self.worker = cls(**kwargs)
        self.rpc_methods = frozenset(methods)

    def execute_method(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """The RPC entry point: only allowlisted methods are reachable."""
        if method not in self.rpc_methods:
            raise AttributeError(f"{method!r} is not callable over RPC")
        if self.worker is None:
            raise RuntimeError(f"rank {self.rpc_rank}: init_worker has not run")
        return getattr(self.worker, method)(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        # Only reached for names the wrapper itself lacks.
        worker = self.__dict__.get("worker")
        if worker is None:
            raise AttributeError(f"{name!r}: the worker does not exist yet (init_worker)")
        return getattr(worker, name)


def _pick(per_rank: list, rank: int, what: str) -> Any:
    if not 0 <= rank < len(per_rank):
        raise ValueError(f"{what} has {len(per_rank)} entries, no entry for rank {rank}")
    return per_rank[rank]
