"""Test helpers: tiny random Llama-family checkpoints (built with transformers, saved as
folders) and PagedDriver, which runs our models step by step over a paged KV cache."""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import transformers

FAMILIES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
}


def make_tiny_checkpoint(
    path: str | os.PathLike,
    family: str = "llama",
    num_layers: int = 4,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int = 256,
    tie_word_embeddings: bool = False,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    shard_max_bytes: int | None = None,
    rope_scaling: dict[str, Any] | None = None,
    router_pairs: list[tuple[int, int, float]] | None = None,
    config_json: dict[str, Any] | None = None,
    **overrides: Any,
) -> str:
    """Build a random transformers model of `family`, save config + safetensors into `path`
    (sharded with an index when shard_max_bytes is given) and return path as str.

    The same arguments give the same weights. rope_scaling is merged into the config's
    rope_parameters (e.g. {"rope_type": "linear", "factor": 2.0}); router_pairs makes a
    mixture of experts' routing uneven (_pair_router_rows); overrides go to the config;
    config_json's keys are set in the saved config.json as they are (None removes one),
    for what the config class would not write so (a top-level rope field, transformers
    4's rope_scaling).
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; known: {sorted(FAMILIES)}")
    config_cls_name, model_cls_name = FAMILIES[family]
    config_cls = getattr(transformers, config_cls_name)
    model_cls = getattr(transformers, model_cls_name)
    kwargs: dict[str, Any] = dict(
        num_hidden_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if family == "mistral":
        kwargs["sliding_window"] = None
    if rope_scaling is not None:
        rope_theta = overrides.pop("rope_theta", 10000.0)
        kwargs["rope_parameters"] = {"rope_theta": rope_theta, **rope_scaling}
    kwargs.update(overrides)
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = model_cls(config)
    # Spread the weights more than the 0.02 init so that logits differ clearly between tokens.
    with torch.no_grad():
        generator = torch.Generator().manual_seed(seed)
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
            elif param.dim() >= 2 or name.endswith("bias"):
                param.copy_(0.08 * torch.randn(param.shape, generator=generator))
            if router_pairs is not None and name.endswith("mlp.gate.weight"):
                _pair_router_rows(param, router_pairs)
    model = model.to(dtype).eval()
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    save_kwargs: dict[str, Any] = {"safe_serialization": True}
    if shard_max_bytes is not None:
        save_kwargs["max_shard_size"] = shard_max_bytes
    model.save_pretrained(out, **save_kwargs)
    if config_json:
        saved = json.loads((out / "config.json").read_text())
        for key, value in config_json.items():
            if value is None:
                saved.pop(key, None)
            else:
                saved[key] = value
        (out / "config.json").write_text(json.dumps(saved, indent=2))
    return str(out)


def _pair_router_rows(weight: torch.Tensor, pairs: list[tuple[int, int, float]]) -> None:
    """For each (a, b, scale): expert b's router row is minus expert a's, both times scale,
    so every token finds one of the two far above the others (its sign picks which);
    experts in no pair are damped to 5%: with a top-k of at most the pairs, they take no
    token, and the pairs' scales order the rest."""
    rows = weight.clone()
    weight.mul_(0.05)
    for a, b, scale in pairs:
        weight[a] = scale * rows[a]
        weight[b] = -scale * rows[a]


_CACHE_ROOT: Path | None = None


def cached_tiny_checkpoint(**kwargs: Any) -> str:
    """make_tiny_checkpoint into a per-process temporary folder keyed by the arguments, so a
    test session builds each distinct checkpoint once."""
    global _CACHE_ROOT
    if _CACHE_ROOT is None:
        _CACHE_ROOT = Path(tempfile.mkdtemp(prefix="zmqworker-tiny-"))
        atexit.register(shutil.rmtree, _CACHE_ROOT, ignore_errors=True)
    key = json.dumps(kwargs, sort_keys=True, default=str)
    folder = _CACHE_ROOT / hashlib.sha1(key.encode()).hexdigest()[:16]
    if not (folder / "config.json").exists():
        make_tiny_checkpoint(folder, **kwargs)
    return str(folder)


def _linear_weights(tensors: dict[str, torch.Tensor]) -> list[str]:
    return [n for n in tensors if n.startswith("model.layers.") and n.endswith("_proj.weight")]


def make_fp8_checkpoint(src: str, dst: str | os.PathLike, with_config: bool = True) -> str:
    """A copy of the checkpoint at src with its linear weights quantized as FP8
    checkpoints store them (float8_e4m3fn, a per-tensor weight_scale and input_scale);
    config.json names quant_method "fp8" when with_config."""
    from safetensors.torch import load_file, save_file

    out = Path(shutil.copytree(src, dst))
    tensors = load_file(out / "model.safetensors")
    for name in _linear_weights(tensors):
        weight = tensors[name]
        scale = weight.abs().max().float() / torch.finfo(torch.float8_e4m3fn).max
        tensors[name] = (weight / scale).to(torch.float8_e4m3fn)
        tensors[f"{name}_scale"] = scale
        tensors[name.replace(".weight", ".input_scale")] = torch.tensor(1.0)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    if with_config:
        config = json.loads((out / "config.json").read_text())
        config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static"}
        (out / "config.json").write_text(json.dumps(config))
    return str(out)


def make_gptq_checkpoint(src: str, dst: str | os.PathLike, with_config: bool = True) -> str:
    """A copy of the checkpoint at src whose linear weights are laid out as GPTQ stores
    them (int32 qweight and qzeros, float16 scales, int32 g_idx; no .weight), with
    AutoGPTQ's quantize_config.json when with_config. The values are random: nothing runs
    them."""
    from safetensors.torch import load_file, save_file

    out = Path(shutil.copytree(src, dst))
    tensors = load_file(out / "model.safetensors")
    group = 32
    for name in _linear_weights(tensors):
        rows, cols = tensors.pop(name).shape  # [out, in]
        prefix = name.removesuffix(".weight")
        ints = torch.randint(-(2**31), 2**31 - 1, (cols // 8, rows), dtype=torch.int32)
        tensors[f"{prefix}.qweight"] = ints
        tensors[f"{prefix}.qzeros"] = ints[: cols // group, : rows // 8].clone()
        tensors[f"{prefix}.scales"] = torch.rand(cols // group, rows, dtype=torch.float16)
        tensors[f"{prefix}.g_idx"] = torch.arange(cols, dtype=torch.int32) // group
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    if with_config:
        quantize = {"bits": 4, "group_size": group, "desc_act": False, "sym": True}
        (out / "quantize_config.json").write_text(json.dumps(quantize))
    return str(out)


class PagedDriver:
    """Runs one of our models step by step over a paged KV cache, handing out block ids
    from a shuffled free list (so a request's blocks are neither contiguous nor ordered).

    `model` is one model, or the list of a pipeline's stage models (chained in order)."""

    def __init__(self, model: Any, num_blocks: int = 64, block_size: int = 4, seed: int = 0):
        import numpy as np

        from zmqworker.attention.kv_cache import allocate_kv_cache
        from zmqworker.attention.workspace import GatherWorkspace

        self.stages = list(model) if isinstance(model, (list, tuple)) else [model]
        self.device = self.stages[0].state.device
        self.workspace = GatherWorkspace()
        self.block_size = block_size
        self.caches = [
            [
                allocate_kv_cache(
                    num_blocks, block_size, m.num_kv_heads, m.head_dim, m.dtype, self.device
                )
                for _ in m.layer_names
            ]
            for m in self.stages
        ]
        self.free = [int(b) for b in np.random.default_rng(seed).permutation(num_blocks)]
        self.blocks: dict[str, list[int]] = {}
        self.lengths: dict[str, int] = {}

    def _metadata(self, schedule: dict[str, list[int]]) -> tuple[Any, Any]:
        import numpy as np

        from zmqworker.attention import build_attention_metadata
        from zmqworker.attention.decode import AttentionGeometry

        bs = self.block_size
        m = self.stages[0]
        geometry = AttentionGeometry(m.num_heads, m.num_kv_heads, m.head_dim, m.dtype)
        positions, slots = [], []
        for req, tokens in schedule.items():
            start = self.lengths.get(req, 0)
            end = start + len(tokens)
            blocks = self.blocks.setdefault(req, [])
            while len(blocks) * bs < end:
                blocks.append(self.free.pop())
            pos = np.arange(start, end)
            positions.append(pos)
            slots.append(np.asarray(blocks)[pos // bs] * bs + pos % bs)
            self.lengths[req] = end
        reqs = list(schedule)
        width = max(len(self.blocks[r]) for r in reqs)
        tables = np.full((len(reqs), width), -1, dtype=np.int32)
        for row, r in enumerate(reqs):
            tables[row, : len(self.blocks[r])] = self.blocks[r]
        query_lens = np.array([len(schedule[r]) for r in reqs], dtype=np.int32)
        seq_lens = np.array([self.lengths[r] for r in reqs], dtype=np.int32)
        slot_mapping = np.concatenate(slots).astype(np.int64)
        meta = build_attention_metadata(
            query_lens, seq_lens, tables, slot_mapping, bs, geometry, self.workspace, self.device
        )
        return meta, torch.from_numpy(np.concatenate(positions)).to(self.device)

    @torch.no_grad()
    def step(self, schedule: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        """Feed each request its new tokens (in one step); return each request's logits
        [num_new_tokens, vocab] for those tokens (on the CPU)."""
        meta, positions = self._metadata(schedule)
        input_ids = torch.tensor(
            [t for tokens in schedule.values() for t in tokens], device=self.device
        )
        carried = None
        for stage, caches in zip(self.stages, self.caches, strict=True):
            carried = stage(input_ids, positions, caches, meta, carried)
        logits = self.stages[-1].compute_logits(carried).cpu()
        out, start = {}, 0
        for req, tokens in schedule.items():
            out[req] = logits[start : start + len(tokens)]
            start += len(tokens)
        return out


# Tiny mixtures of experts, in dims no other test uses, several experts a token, and
# routers skewed so that a few experts take most tokens and some take none.
MOE_CHECKPOINTS: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(
        family="qwen3_moe",
        hidden_size=80,
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=56,
        intermediate_size=96,  # the dense MLP of mlp_only_layers
        mlp_only_layers=[2],
        norm_topk_prob=False,
        router_pairs=[(0, 3, 6.0), (1, 5, 3.0), (2, 4, 1.5)],  # 6 and 7 take no token
    ),
    "mixtral": dict(
        family="mixtral",
        hidden_size=72,
        num_heads=6,
        num_local_experts=6,
        num_experts_per_tok=2,
        intermediate_size=40,
        router_pairs=[(1, 3, 5.0), (5, 0, 2.0)],  # 2 and 4 take no token
    ),
}


def moe_checkpoint(name: str) -> str:
    return cached_tiny_checkpoint(**MOE_CHECKPOINTS[name])
