"""The input precision of the Triton kernels' products, shared by attention and layers."""

import torch


def dot_precision(dtype: torch.dtype) -> str:
    """float32 keeps float32 products (the CPU path's accuracy); tf32 would cost ~1e-3.
    For 16-bit inputs the setting changes nothing."""
    return "ieee" if dtype == torch.float32 else "tf32"
