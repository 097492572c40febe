"""The models' layers: tensor-parallel linear and embedding layers, norms, rotary
embeddings, activations, and their fused Triton kernels (triton_ops.py)."""
