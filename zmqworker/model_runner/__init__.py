"""The model runner: persistent input batch, step inputs, sampler and async output."""

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
