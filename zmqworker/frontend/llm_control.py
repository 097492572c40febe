"""The methods between generations, for RL loops and operators: sleep and wake_up, live
weight updates (from this process, from a trainer's process group, from disk), the prefix
cache, and any worker method. Each is a utility call to every engine core (docs/protocol.md,
"Utility methods"), which waits for the steps in flight before it acts (docs/rl.md shows a
loop). An update from this process is pushed from here, where its tensors are: shared
memory or CUDA IPC handles of this process, announced and handed to the workers through
the engine cores' collective_rpc.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from messages import WeightUpdate, WorkerCall
from zmqworker.frontend.core_client import POLL_SLICE_S, EngineCoreClient

if TYPE_CHECKING:
    import torch

    from zmqworker.executor.weight_push import WeightPusher
    from zmqworker.frontend.utility_calls import PendingCall

DEFAULT_CHUNK_BYTES = 64 << 20  # executor/weight_push.py's, without importing torch
GROUP_TIMEOUT_S = 300.0
CONTROL_TIMEOUT_S = 3600.0 + 60.0  # the executor's own bound on such a call, and some


class ControlMethods:
    """Mixed into Frontend (an LLM, an API server), whose client and streams these use."""

    client: EngineCoreClient
    _streaming: Callable[[], bool]
    _require_open: Callable[[], None]
    _attach: Callable[[], None]
    _pusher: WeightPusher | None

    def sleep(self, level: int = 1) -> None:
        """Give the workers' device memory back until wake_up: level 1 keeps the
        weights in host memory, level 2 drops them (update or reload them after
        wake_up(["weights"])). The KV cache and the prefix cache are dropped."""
        self._control("sleep", level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take back what sleep gave: "weights", "kv_cache", or both (None)."""
        self._control("wake_up", tags)

    @property
    def is_sleeping(self) -> bool:
        """Whether sleep gave anything back (on any replica) that wake_up has not taken."""
        self._require_open()
        return any(self.client.call("is_sleeping"))

    @property
    def generating(self) -> bool:
        """Whether this process's generate_stream() streams are running."""
        return self._streaming()

    def not_ready(self) -> str | None:
        """Why generate() would refuse now (asleep, weights dropped and not loaded since,
        or left part-way by an update or reload that failed); None when it would run."""
        self._require_open()
        return next((r for r in self.client.call("not_ready") if r is not None), None)

    async def not_ready_async(self) -> str | None:
        """not_ready(), on the running event loop (an API server's)."""
        reasons = await self.call_async("not_ready")
        return next((r for r in reasons if r is not None), None)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix: no later request reuses KV computed before."""
        self._control("reset_prefix_cache")

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
        from zmqworker.executor.weight_push import WeightPusher  # torch: not at start-up

        if not all(engine.handle.owned for engine in self.client.engines):
            raise RuntimeError(
                "update_weights pushes through this host's shared memory or CUDA IPC: not to "
                "engine cores served on their own (init_weight_transfer_group sends over "
                "NCCL to any host)"
            )
        self._between_steps("update_weights")
        if self._pusher is None:
            self._pusher = WeightPusher(EngineCoreWorkers(self.client))  # type: ignore[arg-type]
        self._pusher.push(weights, chunk_bytes, timeout=CONTROL_TIMEOUT_S)
        self._control("weights_updated")

    def reload_weights(self, path: str | None = None) -> None:
        """The weights again from disk: the checkpoint the LLM started with, or another
        folder of the same architecture and sizes (a difference raises ValueError)."""
        self._control("reload_weights", path)

    @property
    def num_workers(self) -> int:
        """The worker processes of every replica (data_parallel_size x tp x pp): the
        ranks this LLM takes in a weight-transfer group."""
        self._require_open()
        return sum(self._workers_per_replica())

    def _workers_per_replica(self) -> list[int]:
        return [e.ready.num_workers for e in self.client.engines if e.ready]

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
        rank_offset .. rank_offset + num_workers - 1, of world_size (replica by replica:
        world_size = 1 + llm.num_workers for one LLM). Returns once the group is complete:
        the trainer joins at the same time. Ranks that do not fit world_size are refused
        before any worker joins; if a replica fails to join anyway, the others' calls are
        waited for (each bounded by timeout_s) before the first error is raised."""
        self._between_steps("init_weight_transfer_group")
        per_replica = self._workers_per_replica()
        workers = sum(per_replica)
        if rank_offset < 0 or rank_offset + workers > world_size:
            raise ValueError(
                f"world_size {world_size} has no ranks {rank_offset}..{rank_offset + workers - 1}"
                f" for this LLM's {workers} workers (over {len(per_replica)} replica(s)): "
                "world_size = 1 + llm.num_workers, the trainer being rank 0"
            )
        calls: list[PendingCall] = []
        offset = rank_offset
        for index, count in enumerate(per_replica):  # every replica joins at once
            args = (host, port, world_size, offset, timeout_s)
            calls.append(
                self.client.submit(
                    "init_weight_transfer_group", args, timeout=timeout_s + 60, engines=[index]
                )
            )
            offset += count
        errors = []
        for call in calls:  # every replica's, so that none is left joining
            try:
                self.client.wait(call)
            except Exception as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def update_weights_from_group(self, update: WeightUpdate) -> None:
        """Receive the update the trainer announced (TrainerWeightSender.announce) and
        sends at the same time (send); checked whole before any weight changes."""
        self._control("update_weights_from_group", update)

    def collective_rpc(
        self,
        method: str,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        """A method of every worker (the RPC allowlist and the public methods of
        worker_extension_cls) of every replica, between steps: its results, by replica
        then rank. A worker's refusal raises the builtin error it was (ValueError...)."""
        self._between_steps(method)
        return EngineCoreWorkers(self.client).collective_rpc(method, args, kwargs, timeout)

    async def call_async(self, method: str, *args: Any) -> list[Any]:
        """A utility call to every engine core, awaited on the running event loop (an
        API server's admin endpoints): the results by replica."""
        self._require_open()
        self._attach()
        return await self.client.call_async(method, args, timeout=CONTROL_TIMEOUT_S)

    def _control(self, method: str, *args: Any) -> None:
        self._between_steps(method)
        self.client.call(method, args, timeout=CONTROL_TIMEOUT_S)

    def _between_steps(self, what: str) -> None:
        self._require_open()
        if self._streaming():
            raise RuntimeError(
                f"{what}() while generate_stream() streams run: wait for them to end first"
            )


class EngineCoreWorkers:
    """The workers of every engine core, as an executor's collective_rpc sees them (for
    a WeightPusher of this process): each call goes through the engine cores."""

    def __init__(self, client: EngineCoreClient) -> None:
        self._client = client

    def collective_rpc(
        self,
        method: str,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        non_block: bool = False,
    ) -> Any:
        call = WorkerCall(method, list(args), dict(kwargs or {}), timeout)
        wait_s = CONTROL_TIMEOUT_S if timeout is None else timeout + POLL_SLICE_S
        pending = self._client.submit("collective_rpc", (call,), timeout=wait_s)
        if non_block:
            return _Results(self._client, pending)
        return _flat(self._client.wait(pending))


class _Results:
    """A collective_rpc sent and not waited for yet: result() waits (receiving)."""

    def __init__(self, client: EngineCoreClient, pending: PendingCall) -> None:
        self._client = client
        self._pending = pending

    def result(self) -> list[Any]:
        return _flat(self._client.wait(self._pending))


def _flat(per_engine: list[list[Any]]) -> list[Any]:
    return [result for results in per_engine for result in results]
