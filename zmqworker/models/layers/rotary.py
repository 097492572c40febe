"""Rotary position embedding (rotate-half layout) with the rope scalings that Llama-family
checkpoints declare: default, linear, dynamic, llama3, yarn.

cos/sin are tabulated once for every position up to max_positions (float32 maths, stored in
the model dtype); a step looks them up once and every layer reuses them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


# Rope types whose pretraining length (original_max_position_embeddings) transformers'
# model takes from the config's top level before rope_parameters' (its "Phi3 exception").
_ORIGINAL_LENGTH_TYPES = ("llama3", "yarn", "longrope")
_ABSENT = object()


def rope_parameters_of(hf_config: Any) -> dict[str, Any]:
    """The checkpoint's rope settings as one dict with rope_type and rope_theta, as
    transformers' model reads them: building the model runs standardize_rope_params again,
    where a top-level original_max_position_embeddings (set after AutoConfig's own run)
    outranks the one in rope_parameters for llama3 and yarn; without either, it is
    max_position_embeddings."""
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params = dict(params)
    params.setdefault("rope_type", params.pop("type", "default"))
    if params["rope_type"] in _ORIGINAL_LENGTH_TYPES:
        top_level = getattr(hf_config, "original_max_position_embeddings", _ABSENT)
        if top_level is not _ABSENT:
            params["original_max_position_embeddings"] = top_level
        else:
            params.setdefault(
                "original_max_position_embeddings",
                getattr(hf_config, "max_position_embeddings", None),
            )
    return params


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(
    base: float, dim: int, p: dict[str, Any], max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate the low frequencies, keep the high ones, ramp in between; cos/sin
    are scaled by the attention factor."""
    original = p["original_max_position_embeddings"]
    factor = p.get("factor") or max_position_embeddings / original
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    keep = 1.0 - ramp  # share of the original (extrapolated) frequency per dimension
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv_freq, float(attention_factor)


def rope_inv_freq(
    params: dict[str, Any], head_dim: int, max_position_embeddings: int, max_positions: int
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2], cos/sin scale) for the declared rope type.

    Dynamic NTK is the default rope while the longest context this model serves
    (max_positions) is within max_position_embeddings, as in transformers; beyond it
    transformers rescales for each call's length, which keys cached at other lengths
    cannot follow: refused.
    """
    rope_type = params.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope_type {rope_type!r}; supported: {list(SUPPORTED_ROPE_TYPES)}"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(
            f"partial_rotary_factor {params['partial_rotary_factor']} is not supported"
        )
    if rope_type == "dynamic" and max_positions > max_position_embeddings:
        raise ValueError(
            f"dynamic rope scaling beyond max_position_embeddings={max_position_embeddings} "
            f"is not supported (max_model_len={max_positions}): transformers rescales it "
            "for each sequence length; set max_model_len <= "
            f"{max_position_embeddings}"
        )
    base = float(params.get("rope_theta", 10000.0))
    if rope_type == "yarn":
        return _yarn_inv_freq(base, head_dim, params, max_position_embeddings)
    inv_freq = _base_inv_freq(base, head_dim)
    if rope_type == "linear":
        inv_freq = inv_freq / params["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, params)
    return inv_freq, 1.0


@dataclass(frozen=True)
class StepRope:
    """One step's rotary inputs, shared by every layer: the table, and for the plain-torch
    path the angles of the step's positions looked up once (the fused kernels look up
    their own, at the positions of the step's metadata)."""

    table: torch.Tensor  # [max_positions, head_dim]: cos then sin
    cos: torch.Tensor | None = None  # [num_tokens, 1, head_dim / 2]
    sin: torch.Tensor | None = None


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        params: dict[str, Any],
        max_position_embeddings: int,
        dtype: torch.dtype,
    ):
        super().__init__()
        self.max_positions = max_positions
        device = torch.get_default_device()
        # The whole model is built on the meta device to read its weights' names
        # (loader.whole_model, on every load): no table there, and the settings are checked
        # on the CPU (meta tensors take torch's reference ops, whose first use imports its
        # compiler stack, about a second).
        with torch.device("cpu" if device.type == "meta" else device):
            inv_freq, scale = rope_inv_freq(
                params, head_dim, max_position_embeddings, max_positions
            )
        if device.type == "meta":
            table = torch.empty(max_positions, head_dim, dtype=dtype)
        else:
            freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
            table = torch.cat([freqs.cos() * scale, freqs.sin() * scale], dim=-1).to(dtype)
        self.register_buffer("cos_sin", table, persistent=False)

    def for_step(self, positions: torch.Tensor, look_up: bool) -> StepRope:
        if not look_up:
            return StepRope(self.cos_sin)
        cos, sin = self.lookup(positions)
        return StepRope(self.cos_sin, cos, sin)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [num_tokens, 1, head_dim / 2], for positions int64 [num_tokens]."""
        cos, sin = self.cos_sin.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [num_tokens, heads, head_dim] (halves layout) by the looked-up angles."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
