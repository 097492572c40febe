"""The reference engine: scheduler, KV block manager, requests, detokenizer, the batch
queue and the LLM API.

May import: everything up to zmqworker.executor.
"""

from zmqworker.engine.batch_queue import BatchQueue
from zmqworker.engine.block_manager import KVBlockManager
from zmqworker.engine.core import EngineCore
from zmqworker.engine.detokenizer import IncrementalDetokenizer
from zmqworker.engine.llm import LLM
from zmqworker.engine.outputs import RequestOutput
from zmqworker.engine.request import FinishReason, Request, RequestStatus, RequestTimings
from zmqworker.engine.scheduler import Scheduler

__all__ = [
    "LLM",
    "BatchQueue",
    "EngineCore",
    "FinishReason",
    "IncrementalDetokenizer",
    "KVBlockManager",
    "Request",
    "RequestOutput",
    "RequestStatus",
    "RequestTimings",
    "Scheduler",
]
