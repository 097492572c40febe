"""The model runner: this rank's model, its KV cache and the persistent batch; a step's
inputs on either path (plain torch, or Triton with CUDA graphs), the sampler and the
output whose device-to-host copy may still be under way.

Nothing is imported here, so that the worker process can know the output class
(async_output.py) without torch or transformers: import the module you need.

May import: messages, zmqworker.transport, zmqworker.attention, zmqworker.distributed,
zmqworker.models.
"""
