"""The worker layer: the interface an executor drives (WorkerBase), the torch Worker
that holds a rank's device, process groups and model runner, and the WorkerWrapper that
builds a worker late and is the RPC layer's one entry into it.

May import: everything below it (messages up to zmqworker.model_runner); never the
runtime that serves it.
"""

from zmqworker.worker.worker_base import RPC_METHODS, WorkerBase
from zmqworker.worker.wrapper import WorkerWrapper

__all__ = ["RPC_METHODS", "WorkerBase", "WorkerWrapper"]
