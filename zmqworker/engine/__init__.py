"""The engine core: scheduler, KV block manager, requests and the batch queue, run by its
own process's busy loop (core_server.py, core_main.py) over the executor's workers, for
clients of zmqworker/frontend/. model_folder.py reads a checkpoint for both sides.

May import: everything up to zmqworker.executor.
"""

from zmqworker.engine.batch_queue import BatchQueue
from zmqworker.engine.block_manager import KVBlockManager
from zmqworker.engine.core import EngineCore
from zmqworker.engine.request import FinishReason, Request, RequestStatus
from zmqworker.engine.scheduler import Scheduler

__all__ = [
    "BatchQueue",
    "EngineCore",
    "FinishReason",
    "KVBlockManager",
    "Request",
    "RequestStatus",
    "Scheduler",
]
