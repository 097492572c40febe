"""WorkerWrapper: the object a worker process (or a Ray actor) holds before the worker
exists, and the one entry point of the RPC layer into it.

It applies the rank's environment (update_environment), then builds the real worker
(init_worker) from a class named by string, optionally combined with a worker extension
class. Late construction is what lets CUDA_VISIBLE_DEVICES and friends be set before
torch touches the device. execute_method forwards a call to the worker, but only to the
allowlisted methods (the WorkerBase interface plus the extension's public methods).
"""

from __future__ import annotations

import importlib
import inspect
import os
import types
import typing
from collections.abc import Mapping
from typing import Any, NamedTuple

import msgspec

from messages import WorkerConfig
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


def worker_class(config: WorkerConfig) -> tuple[type, frozenset[str]]:
    """The class config names (with its extension) and the methods callable over RPC;
    an error naming what is wrong."""
    cls = resolve_class(config.worker_cls)
    if not issubclass(cls, WorkerBase):
        raise ValueError(f"{config.worker_cls} is not a WorkerBase subclass")
    methods = set(RPC_METHODS)
    if config.worker_extension_cls:
        extension = resolve_class(config.worker_extension_cls)
        cls = with_extension(cls, extension)
        methods |= public_methods(extension)
    return cls, frozenset(methods)


# (position, or None for a keyword-only parameter; name; the types it takes)
MessageParam = tuple[int | None, str, tuple[type, ...]]


class MethodShape(NamedTuple):
    """What a call checks and passes by a method's signature, read once per method."""

    call_keys: frozenset[str]  # the call's own keywords it takes (CALL_KEYS, keyword-only)
    messages: list[MessageParam]  # parameters typed as a message, checked before a call


# What the runtime passes of an RPC call to the methods that take it (execute_model):
# its id, and its deadline.
CALL_KEYS = frozenset({"call_id", "deadline"})


def method_shape(fn: Any) -> MethodShape:
    """fn's shape; message parameters are those typed as a msgspec Struct, or a union of
    those and None (none where the hints do not resolve)."""
    params = list(inspect.signature(fn).parameters.values())
    call_keys = frozenset(
        p.name for p in params if p.name in CALL_KEYS and p.kind is inspect.Parameter.KEYWORD_ONLY
    )
    try:
        hints = typing.get_type_hints(fn)
    except (NameError, TypeError):
        return MethodShape(call_keys, [])
    found: list[MessageParam] = []
    position: int | None = 0
    for param in params:
        if param.kind is inspect.Parameter.VAR_POSITIONAL:
            position = None  # those after it are keyword-only
        members = _union_members(hints.get(param.name))
        message = any(isinstance(m, type) and issubclass(m, msgspec.Struct) for m in members)
        if message and all(isinstance(m, type) for m in members):
            keyword_only = param.kind is inspect.Parameter.KEYWORD_ONLY
            found.append((None if keyword_only else position, param.name, members))
        if position is not None and param.kind in _POSITIONAL:
            position += 1
    return MethodShape(call_keys, found)


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _union_members(hint: Any) -> tuple[Any, ...]:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return typing.get_args(hint)
    return () if hint is None else (hint,)


class WorkerWrapper:
    def __init__(self, rpc_rank: int = 0) -> None:
        self.rpc_rank = rpc_rank
        self.worker: WorkerBase | None = None
        self.rpc_methods: frozenset[str] = RPC_METHODS
        self._shapes: dict[str, MethodShape] = {}  # by method

    def update_environment(self, env: Mapping[str, str]) -> None:
        """Apply this rank's environment to os.environ, before the worker is built."""
        for key, value in env.items():
            os.environ[key] = str(value)

    def init_worker(self, config: WorkerConfig, **kwargs: Any) -> None:
        """Build the worker: config names the worker class and the optional extension
        class; kwargs are the other constructor arguments (rank defaults to rpc_rank)."""
        if self.worker is not None:
            raise RuntimeError(f"rank {self.rpc_rank}: the worker exists already")
        cls, methods = worker_class(config)
        kwargs.setdefault("rank", self.rpc_rank)
        self.worker = cls(config=config, **kwargs)
        self.rpc_methods = methods

    def execute_method(
        self,
        method: str,
        *args: Any,
        call_id: int | None = None,
        deadline: float = 0.0,
        **kwargs: Any,
    ) -> Any:
        """The RPC entry point: only allowlisted methods are reachable. call_id and
        deadline: the RPC call's, passed on to the methods that take them (keyword-only,
        as execute_model's); the engine cannot set them as arguments."""
        if method not in self.rpc_methods:
            raise AttributeError(f"{method!r} is not callable over RPC")
        if self.worker is None:
            raise RuntimeError(f"rank {self.rpc_rank}: init_worker has not run")
        fn = getattr(self.worker, method)
        shape = self._shapes.get(method)
        if shape is None:
            shape = self._shapes[method] = method_shape(fn)
        _check_messages(method, shape.messages, args, kwargs)
        if call_id is None or not shape.call_keys:
            return fn(*args, **kwargs)
        call = {"call_id": call_id, "deadline": deadline}
        return fn(*args, **{k: call[k] for k in shape.call_keys}, **kwargs)

    def __getattr__(self, name: str) -> Any:
        # Only reached for names the wrapper itself lacks.
        worker = self.__dict__.get("worker")
        if worker is None:
            raise AttributeError(f"{name!r}: the worker does not exist yet (init_worker)")
        return getattr(worker, name)


def _check_messages(
    method: str, params: list[MessageParam], args: tuple, kwargs: dict[str, Any]
) -> None:
    """TypeError naming the argument where one the method types as a message is another
    value: it would fail inside the method, as some other error."""
    for position, name, wanted in params:
        if position is not None and position < len(args):
            value = args[position]
        elif name in kwargs:
            value = kwargs[name]
        else:
            continue  # not given: the call fails on it, or takes the default
        if not isinstance(value, wanted):
            names = " or ".join("None" if t is type(None) else t.__name__ for t in wanted)
            raise TypeError(f"{method}: {name} must be a {names}, got {type(value).__name__}")
