"""Llama-family models, mixtures of experts included, over the paged KV cache: the layers
(plain torch and fused Triton), weight loading (or dummy weights) and the embedded default
checkpoint.

Nothing is imported here, so that the engine can read the architecture table
(architectures.py) without torch or transformers: import the module you need.

May import: messages, zmqworker.transport, zmqworker.attention, zmqworker.distributed.
"""
