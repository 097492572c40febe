"""The model runner: this rank's model, its KV cache and the persistent batch; a step's
inputs on either path (plain torch, or Triton with CUDA graphs), the sampler and the
output whose device-to-host copy may still be under way.

May import: messages, zmqworker.transport, zmqworker.attention, zmqworker.distributed,
zmqworker.models.
"""

from zmqworker.model_runner.async_output import AsyncModelRunnerOutput
from zmqworker.model_runner.input_batch import InputBatch
from zmqworker.model_runner.model_runner import ModelRunner
from zmqworker.model_runner.sampler import Sampler, SamplerOutput, SamplingMetadata

__all__ = [
    "AsyncModelRunnerOutput",
    "InputBatch",
    "ModelRunner",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
]
