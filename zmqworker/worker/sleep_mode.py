"""Sleep mode: give device memory back between bursts of work, and take it again.

Level 1 copies the weights into one host pool (pinned on CUDA, so that the copies run
at the bus's speed; made by the first sleep that needs it, then kept and reused), one
copy per tensor and one wait for them all, and frees them on the device; wake_up gives
them device memory again and copies them back the same way. Level 2 keeps no copy:
wake_up gives the weights their memory back, uninitialised, and the worker refuses
steps until they are updated or reloaded (the WeightTransferEngine says so). Both levels
free the KV cache and the CUDA graphs captured over it; wake_up allocates the cache
again (its contents are lost) and the worker captures the graphs again. Buffers (rotary
tables, kernel counters, the penalties' per-row counts: 4 bytes a vocabulary entry a
batch row) are small beside those and stay where they are. The same code runs on the
CPU device, where the pool is plain host memory.
"""

from __future__ import annotations

import mmap

import torch
from torch import nn

from messages import KVCacheConfig
from zmqworker.distributed.page_lock import page_lock, page_unlock

WAKE_TAGS = ("weights", "kv_cache")
POOL_ALIGN = 512  # each tensor's place in the pool: DMA-friendly


class HostPool:
    """One host buffer, reused from one sleep to the next; replaced only when a larger
    one is asked for. On CUDA it is page-locked in place (cudaHostRegister) at its exact
    size: torch's pinned allocator would round 16 GB of weights up to 32. Its memory is
    an anonymous mapping of its own (page-aligned), given back when it is released."""

    def __init__(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self._locked_for: torch.device | None = None  # the device it is page-locked for

    def take(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """At least nbytes of it, page-locked where device is a GPU."""
        if self.buffer.numel() < nbytes:
            self.release()
            self.buffer = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)
            if device.type == "cuda" and page_lock(self.buffer.data_ptr(), nbytes, device):
                self._locked_for = device
        return self.buffer

    def release(self) -> None:
        if self._locked_for is not None:
            page_unlock(self.buffer.data_ptr(), self._locked_for)
            self._locked_for = None
        self.buffer = torch.empty(0, dtype=torch.uint8)


class SleepState:
    """What a sleeping worker set aside, and how to restore it."""

    def __init__(self) -> None:
        self.level = 0
        self.weights_released = False
        self.kv_released = False
        self._pool = HostPool()
        # Each released parameter, its shape and dtype, and at level 1 its pool offset.
        self._released: list[tuple[nn.Parameter, torch.Size, torch.dtype, int]] = []

    @property
    def asleep(self) -> bool:
        return self.weights_released or self.kv_released

    def describe(self) -> str:
        flags = (self.weights_released, self.kv_released)
        parts = [name for name, gone in zip(WAKE_TAGS, flags, strict=True) if gone]
        return f"level {self.level}, released: {', '.join(parts)}"

    @torch.no_grad()
    def sleep(self, runner, level: int) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self.asleep:
            raise RuntimeError(f"already asleep ({self.describe()}): wake_up first")
        params = list(runner.model.parameters())  # a tied parameter once
        device = params[0].device
        offsets, end = [], 0
        for param in params:
            offsets.append(end)
            end += -(-param.nbytes // POOL_ALIGN) * POOL_ALIGN
        if level == 1:
            pool = self._pool.take(end, device)
            for param, offset in zip(params, offsets, strict=True):
                _place(pool, offset, param).copy_(param.data, non_blocking=True)
            _wait_for_copies(device)
        self._released = [
            (param, param.shape, param.dtype, offset)
            for param, offset in zip(params, offsets, strict=True)
        ]
        for param in params:
            param.data = torch.empty(0, dtype=param.dtype, device=device)
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
            self._restore_weights(device)
            self.weights_released = False
        if "kv_cache" in tags and self.kv_released:
            if kv_cache_config is not None:
                runner.initialize_kv_cache(kv_cache_config)
            self.kv_released = False
        if not self.asleep:
            self.level = 0

    def clear(self) -> None:
        self._released = []
        self._pool.release()

    @torch.no_grad()
    def _restore_weights(self, device: torch.device) -> None:
        """Device memory for every released weight; at level 1 its values from the pool."""
        pool = self._pool.buffer
        for param, shape, dtype, offset in self._released:
            fresh = torch.empty(shape, dtype=dtype, device=device)
            if self.level == 1:
                fresh.copy_(_place(pool, offset, fresh), non_blocking=True)
            param.data = fresh
        _wait_for_copies(device)
        self._released = []


def _place(pool: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """The pool's bytes at offset as a tensor of like's shape and dtype."""
    return pool[offset : offset + like.nbytes].view(like.dtype).view(like.shape)


def _wait_for_copies(device: torch.device) -> None:
    if device.type == "cuda":
        done = torch.cuda.Event()
        done.record()
        done.synchronize()
