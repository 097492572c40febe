"""The worker layer: the interface (WorkerBase), the torch Worker and the WorkerWrapper."""

from zmqworker.worker.worker_base import RPC_METHODS, WorkerBase
from zmqworker.worker.wrapper import WorkerWrapper

__all__ = ["RPC_METHODS", "WorkerBase", "WorkerWrapper"]
