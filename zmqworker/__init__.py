"""zmqworker: worker processes for LLM inference engines, driven over ZeroMQ, and a
reference engine (`LLM`, `SamplingParams`) with an OpenAI-compatible server.

The engine's names load on first use: a worker process imports this package too, and
needs none of them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.2.0"

if TYPE_CHECKING:
    from messages import SamplingParams, StructuredOutputsParams
    from zmqworker.distributed.trainer_sender import TrainerWeightSender
    from zmqworker.frontend.llm import LLM
    from zmqworker.frontend.outputs import (
        EngineStats,
        PositionLogprobs,
        RequestOutput,
        TokenLogprob,
    )

_LAZY = {
    "LLM": "zmqworker.frontend.llm",
    "EngineStats": "zmqworker.frontend.outputs",
    "SamplingParams": "messages",
    "StructuredOutputsParams": "messages",
    "RequestOutput": "zmqworker.frontend.outputs",
    "PositionLogprobs": "zmqworker.frontend.outputs",
    "TokenLogprob": "zmqworker.frontend.outputs",
    "TrainerWeightSender": "zmqworker.distributed.trainer_sender",
}
__all__ = [
    "LLM",
    "EngineStats",
    "PositionLogprobs",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "TokenLogprob",
    "TrainerWeightSender",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'zmqworker' has no attribute {name!r}")
