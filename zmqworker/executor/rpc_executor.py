"""The executors whose workers answer over the engine's ROUTER socket share this."""

from __future__ import annotations

from typing import Any

from zmqworker.executor.abstract import Executor
from zmqworker.executor.errors import ExecutorError
from zmqworker.executor.rpc_client import RpcClient


class RpcExecutor(Executor):
    """collective_rpc through self.rpc, which a subclass sets once its workers said hello."""

    rpc: RpcClient | None = None
    _closed = False

    def collective_rpc(
        self,
        method: str,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | None = None,
        non_block: bool = False,
    ) -> Any:
        if self._closed or self.rpc is None:
            raise ExecutorError(f"{method}: the executor is shut down")
        call = self.rpc.call if non_block else self.rpc.call_and_wait
        return call(method, args, kwargs, timeout=timeout, reply_rank=unique_reply_rank)
