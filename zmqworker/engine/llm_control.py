"""The LLM's methods between generations, for RL loops and operators: sleep and wake_up,
live weight updates (from this process, from a trainer's process group, from disk), the
prefix cache, and any worker method. Each is a thin call to one EngineCore method, which
waits for the steps in flight before it acts (docs/rl.md shows a loop).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from messages import WeightUpdate
from zmqworker.engine.core import EngineCore

if TYPE_CHECKING:
    import torch

DEFAULT_CHUNK_BYTES = 64 << 20  # executor/weight_push.py's, without importing torch
GROUP_TIMEOUT_S = 300.0


class ControlMethods:
    """Mixed into LLM, whose engine core and streams these use."""

    _require_core: Callable[[], EngineCore]
    _streaming: Callable[[], bool]

    def sleep(self, level: int = 1) -> None:
        """Give the workers' device memory back until wake_up: level 1 keeps the
        weights in host memory, level 2 drops them (update or reload them after
        wake_up(["weights"])). The KV cache and the prefix cache are dropped."""
        self._between_steps("sleep").sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take back what sleep gave: "weights", "kv_cache", or both (None)."""
        self._between_steps("wake_up").wake_up(tags)

    @property
    def is_sleeping(self) -> bool:
        """Whether sleep gave anything back that wake_up has not taken again."""
        return bool(self._require_core().released)

    @property
    def generating(self) -> bool:
        """Whether generate_stream() streams are running (they step the engine)."""
        return self._streaming()

    def not_ready(self) -> str | None:
        """Why generate() would refuse now (asleep, or weights dropped and not loaded
        since); None when it would run."""
        return self._require_core().not_ready()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix: no later request reuses KV computed before."""
        self._between_steps("reset_prefix_cache").reset_prefix_cache()

    def update_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        """New values for the model's weights, by their Hugging Face names, as whole
        tensors in the model's dtype (each worker takes its shard and layers). CPU
        tensors travel through shared memory, chunk_bytes at a time; CUDA tensors
        through CUDA IPC, without a copy here. The whole update is checked first: an
        unknown name, a wrong shape or dtype raises ValueError and nothing changes."""
        self._between_steps("update_weights").update_weights(weights, chunk_bytes)

    def reload_weights(self, path: str | None = None) -> None:
        """The weights again from disk: the checkpoint the LLM started with, or another
        folder of the same architecture and sizes (a difference raises ValueError)."""
        self._between_steps("reload_weights").reload_weights(path)

    def init_weight_transfer_group(
        self,
        host: str,
        port: int,
        world_size: int,
        rank_offset: int = 1,
        timeout_s: float = GROUP_TIMEOUT_S,
    ) -> None:
        """Join every worker to a trainer's weight-transfer group: the trainer is rank 0
        (zmqworker.TrainerWeightSender, hosting host:port), this LLM's workers ranks
        rank_offset .. rank_offset + workers - 1, of world_size. Returns once the group
        is complete: the trainer joins at the same time."""
        core = self._between_steps("init_weight_transfer_group")
        core.init_weight_transfer_group(host, port, world_size, rank_offset, timeout_s)

    def update_weights_from_group(self, update: WeightUpdate) -> None:
        """Receive the update the trainer announced (TrainerWeightSender.announce) and
        sends at the same time (send); checked whole before any weight changes."""
        self._between_steps("update_weights_from_group").update_weights_from_group(update)

    def collective_rpc(
        self,
        method: str,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        """A method of every worker (the RPC allowlist and the public methods of
        worker_extension_cls), between steps; its results by rank."""
        return self._between_steps(method).collective_rpc(method, args, kwargs, timeout)

    def _between_steps(self, what: str) -> EngineCore:
        core = self._require_core()
        if self._streaming():
            raise RuntimeError(
                f"{what}() while generate_stream() streams run: wait for them to end first"
            )
        return core
