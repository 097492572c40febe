"""Sleep mode: give device memory back between bursts of work, and take it again.

Level 1 moves the weights to host memory and frees the KV cache; level 2 frees the
weights entirely (they are reloaded from the checkpoint on wake), keeping a host copy of
the model's buffers, which are not in the checkpoint (rotary tables and the like).
"""

from __future__ import annotations

import torch

from messages import KVCacheConfig
from zmqworker.models.registry import load_weights

WAKE_TAGS = ("weights", "kv_cache")


class SleepState:
    """What a sleeping worker set aside, and how to restore it."""

    def __init__(self) -> None:
        self.level = 0
        self._weights: dict[str, torch.Tensor] = {}  # level 1: host copies
        self._shapes: dict[str, tuple[torch.Size, torch.dtype]] = {}  # level 2
        self._buffers: dict[str, torch.Tensor] = {}  # level 2: host copies
        self.weights_released = False
        self.kv_released = False

    @property
    def asleep(self) -> bool:
        return self.weights_released or self.kv_released

    def describe(self) -> str:
        parts = [
            name
            for name, gone in zip(WAKE_TAGS, (self.weights_released, self.kv_released), strict=True)
            if gone
        ]
        return f"level {self.level}, released: {', '.join(parts)}"

    def sleep(self, runner, level: int, pin: bool) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self.asleep:
            raise RuntimeError(f"already asleep ({self.describe()}): wake_up first")
        model: torch.nn.Module = runner.model
        for name, param in model.named_parameters():
            if level == 1:
                self._weights[name] = _to_host(param.data, pin)
            else:
                self._shapes[name] = (param.shape, param.dtype)
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        if level == 2:
            for name, buf in model.named_buffers():
                self._buffers[name] = _to_host(buf, pin)
                _set_buffer(model, name, torch.empty(0, dtype=buf.dtype, device=buf.device))
        runner.release_kv_cache()
        self.level, self.weights_released, self.kv_released = level, True, True

    def wake_up(
        self,
        runner,
        tags: list[str] | None,
        device: torch.device,
        kv_cache_config: KVCacheConfig | None,
    ) -> None:
        tags = list(WAKE_TAGS) if tags is None else list(tags)
        unknown = [t for t in tags if t not in WAKE_TAGS]
        if unknown:
            raise ValueError(f"unknown wake_up tags {unknown}: use {list(WAKE_TAGS)}")
        if "weights" in tags and self.weights_released:
            self._restore_weights(runner, device)
            self.weights_released = False
        if "kv_cache" in tags and self.kv_released:
            if kv_cache_config is not None:
                runner.initialize_kv_cache(kv_cache_config)
            self.kv_released = False
        if not self.asleep:
            self.level = 0

    def clear(self) -> None:
        self._weights.clear()
        self._shapes.clear()
        self._buffers.clear()

    def _restore_weights(self, runner, device: torch.device) -> None:
        model: torch.nn.Module = runner.model
        params = dict(model.named_parameters())
        if self.level == 1:
            for name, host in self._weights.items():
                params[name].data = host.to(device, non_blocking=False)
        else:
            for name, (shape, dtype) in self._shapes.items():
                params[name].data = torch.empty(shape, dtype=dtype, device=device)
            for name, host in self._buffers.items():
                _set_buffer(model, name, host.to(device))
            load_weights(model, runner.config.model)
        self.clear()


def _to_host(t: torch.Tensor, pin: bool) -> torch.Tensor:
    if t.device.type == "cpu":
        return t  # already host memory: keep the storage, no copy
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
    host.copy_(t)
    return host


def _set_buffer(model: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    owner._buffers[attr] = value
