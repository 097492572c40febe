"""The Llama family (Llama, Mistral, Qwen2, Qwen3, and the mixtures of experts Qwen3-MoE
and Mixtral) as one tensor-, pipeline- and expert-parallel implementation over the paged
KV cache. The members differ only in FamilyFlags."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zmqworker.attention.head_norms import HeadNorms
from zmqworker.attention.metadata import AttentionMetadata
from zmqworker.attention.paged_attention import paged_attention
from zmqworker.attention.triton_metadata import TritonAttentionMetadata
from zmqworker.distributed.parallel_state import ParallelState
from zmqworker.models.layers.activation import GatedActivation
from zmqworker.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from zmqworker.models.layers.linear import (
    ColumnParallelLinear,
    ColumnPart,
    RowParallelLinear,
    split_evenly,
)
from zmqworker.models.layers.norm import RMSNorm
from zmqworker.models.layers.rotary import (
    RotaryEmbedding,
    StepRope,
    apply_rotary,
    rope_parameters_of,
)
from zmqworker.models.loader import load_checkpoint
from zmqworker.models.moe import MoeFlags, SparseMoeBlock, sparse_layer


@dataclass(frozen=True)
class FamilyFlags:
    qkv_bias: bool = False  # q/k/v projections have biases (Qwen2; Llama attention_bias)
    o_bias: bool = False  # the output projection has a bias (Llama/Qwen3 attention_bias)
    mlp_bias: bool = False  # gate/up/down have biases (Llama mlp_bias)
    qk_norm: bool = False  # per-head RMSNorm of q and k before rope (Qwen3)
    moe: MoeFlags | None = None  # sparse layers' MLP is a mixture of experts (moe.py)


# The step metadata decides the attention path: plain torch (CPU) or Triton (CUDA).
StepMetadata = AttentionMetadata | TritonAttentionMetadata


def pp_layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """Layers [start, end) of a pipeline stage: an even split, earlier stages take the rest."""
    if pp_size > num_layers:
        raise ValueError(
            f"pipeline parallel size {pp_size} exceeds the model's {num_layers} layers"
        )
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)


def kv_head_layout(num_kv_heads: int, state: ParallelState) -> tuple[int, int]:
    """(kv heads per rank, first kv head of this rank): kv_heads_of_rank's."""
    return kv_heads_of_rank(num_kv_heads, state.tp_size, state.tp_rank)


def kv_heads_of_rank(num_kv_heads: int, tp: int, rank: int) -> tuple[int, int]:
    """(kv heads per rank, first kv head of tp rank rank). With fewer kv heads than TP
    ranks, each kv head is replicated on tp / num_kv_heads consecutive ranks. KV transfer
    between instances of two TP sizes maps heads by this same rule (kv_transfer/head_map.py)."""
    if num_kv_heads >= tp:
        if num_kv_heads % tp:
            raise ValueError(
                f"{num_kv_heads} key/value heads are not divisible by tensor parallel size {tp}"
            )
        per_rank = num_kv_heads // tp
        return per_rank, rank * per_rank
    if tp % num_kv_heads:
        raise ValueError(
            f"tensor parallel size {tp} is not a multiple of the {num_kv_heads} key/value heads"
        )
    return 1, rank // (tp // num_kv_heads)


class LlamaAttention(nn.Module):
    def __init__(
        self, cfg: Any, flags: FamilyFlags, prefix: str, state: ParallelState, fused: bool
    ):
        super().__init__()
        hidden = cfg.hidden_size
        self.head_dim = getattr(cfg, "head_dim", None) or hidden // cfg.num_attention_heads
        if cfg.num_attention_heads % state.tp_size:
            raise ValueError(
                f"{cfg.num_attention_heads} attention heads are not divisible by tensor "
                f"parallel size {state.tp_size}"
            )
        self.num_heads = cfg.num_attention_heads // state.tp_size
        self.num_kv_heads, first_kv = kv_head_layout(cfg.num_key_value_heads, state)
        self.scale = self.head_dim**-0.5
        d = self.head_dim
        q_rows, kv_rows = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
        kv_start, kv_len = first_kv * d, self.num_kv_heads * d
        parts = [
            split_evenly(f"{prefix}.q_proj", q_rows, state),
            ColumnPart(f"{prefix}.k_proj", kv_rows, kv_start, kv_len),
            ColumnPart(f"{prefix}.v_proj", kv_rows, kv_start, kv_len),
        ]
        self.qkv_proj = ColumnParallelLinear(hidden, parts, flags.qkv_bias, skinny=fused)
        self.o_proj = RowParallelLinear(
            q_rows, hidden, f"{prefix}.o_proj", flags.o_bias, state, skinny=fused
        )
        self.q_norm = self.k_norm = None
        if flags.qk_norm:
            # Fused, the attention kernels apply them (HeadNorms): no launch of their own.
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, f"{prefix}.q_norm")
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, f"{prefix}.k_norm")
        self._triton = None
        if fused:
            from zmqworker.attention.triton_attention import paged_attention

            self._triton = paged_attention

    def forward(
        self, rope: StepRope, hidden: torch.Tensor, kv_cache: torch.Tensor, meta: StepMetadata
    ) -> torch.Tensor:
        n, heads, kv_heads = hidden.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(hidden).view(n, heads + 2 * kv_heads, self.head_dim)
        if isinstance(meta, TritonAttentionMetadata):
            out = self._fused_attention(qkv, rope, kv_cache, meta)
            return self.o_proj(out.view(n, heads * self.head_dim))
        cos, sin = rope.cos, rope.sin
        assert cos is not None and sin is not None
        if self.q_norm is None:
            # q and k are adjacent: rotate them in one pass.
            qk = apply_rotary(qkv[:, : heads + kv_heads], cos, sin)
            q, k = qk[:, :heads], qk[:, heads:]
        else:
            q = apply_rotary(self.q_norm(qkv[:, :heads]), cos, sin)
            k = apply_rotary(self.k_norm(qkv[:, heads : heads + kv_heads]), cos, sin)
        v = qkv[:, heads + kv_heads :]
        out = paged_attention(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(n, heads * self.head_dim))

    def _fused_attention(
        self,
        qkv: torch.Tensor,
        rope: StepRope,
        kv_cache: torch.Tensor,
        meta: TritonAttentionMetadata,
    ) -> torch.Tensor:
        """The q and k norms, rotary, the cache write and attention over the cache: one
        kernel for a decode step, two for any other (triton_attention.py)."""
        if self._triton is None:
            raise RuntimeError("Triton attention metadata given to a model built unfused")
        norms = None
        if self.q_norm is not None and self.k_norm is not None:
            norms = HeadNorms(self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        return self._triton(qkv, self.num_heads, rope.table, kv_cache, meta, self.scale, norms)


class LlamaMLP(nn.Module):
    def __init__(
        self, cfg: Any, flags: FamilyFlags, prefix: str, state: ParallelState, fused: bool
    ):
        super().__init__()
        inter = cfg.intermediate_size
        parts = [
            split_evenly(f"{prefix}.gate_proj", inter, state),
            split_evenly(f"{prefix}.up_proj", inter, state),
        ]
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, parts, bias=flags.mlp_bias)
        self.act = GatedActivation(cfg.hidden_act, fused)
        self.down_proj = RowParallelLinear(
            inter, cfg.hidden_size, f"{prefix}.down_proj", flags.mlp_bias, state, skinny=fused
        )
        # Decode-sized steps on the Triton path: the projection and SiLU in one kernel.
        self._gate_up_silu = None
        self._skinny_rows = 0
        if fused and cfg.hidden_act == "silu":
            from zmqworker.models.layers import skinny_gate_up

            self._gate_up_silu = skinny_gate_up.gate_up_silu
            self._skinny_rows = skinny_gate_up.MAX_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._gate_up_silu is not None and x.shape[0] <= self._skinny_rows:
            proj = self.gate_up_proj
            return self.down_proj(self._gate_up_silu(x, proj.weight, proj.bias))
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, flags: FamilyFlags, layer: int, state: ParallelState, fused: bool):
        super().__init__()
        prefix = f"model.layers.{layer}"
        self.self_attn = LlamaAttention(cfg, flags, f"{prefix}.self_attn", state, fused)
        self.mlp: nn.Module
        if flags.moe is not None and sparse_layer(cfg, layer):
            self.mlp = SparseMoeBlock(cfg, flags.moe, prefix, state, fused)
        else:
            self.mlp = LlamaMLP(cfg, flags, f"{prefix}.mlp", state, fused)
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, f"{prefix}.input_layernorm", fused)
        self.post_attention_layernorm = RMSNorm(
            cfg.hidden_size, eps, f"{prefix}.post_attention_layernorm", fused
        )

    def forward(
        self,
        rope: StepRope,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        meta: StepMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.self_attn(rope, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm.add_and_norm(hidden, residual)
        return self.mlp(hidden), residual


def _check_sliding_window(cfg: Any, max_positions: int) -> None:
    """Full attention equals sliding-window attention while no context exceeds the window."""
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None) or []
    # Mistral, Mixtral and Qwen3-MoE window every layer whenever the config sets one.
    uses_window = "sliding_attention" in layer_types or (
        cfg.model_type in ("mistral", "mixtral", "qwen3_moe") and window is not None
    )
    if uses_window and window is not None and max_positions > window:
        raise ValueError(
            f"sliding-window attention (window {window}) is not supported; set "
            f"max_model_len <= {window} (asked for {max_positions})"
        )


class LlamaModel(nn.Module):
    """The decoder stack of one pipeline stage (named like the checkpoint's `model.`)."""

    def __init__(
        self,
        cfg: Any,
        flags: FamilyFlags,
        state: ParallelState,
        start: int,
        end: int,
        fused: bool,
    ):
        super().__init__()
        self.embed_tokens = None
        if state.is_first_stage:
            self.embed_tokens = VocabParallelEmbedding(
                cfg.vocab_size, cfg.hidden_size, "model.embed_tokens.weight", state
            )
        self.layers = nn.ModuleDict(
            {str(i): LlamaDecoderLayer(cfg, flags, i, state, fused) for i in range(start, end)}
        )
        self.norm = None
        if state.is_last_stage:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, "model.norm", fused)


class LlamaForCausalLM(nn.Module):
    """fused=True builds the layers on Triton kernels (the CUDA step); the plain-torch
    layers stay the reference and the CPU path."""

    def __init__(
        self,
        hf_config: Any,
        state: ParallelState,
        dtype: torch.dtype,
        flags: FamilyFlags,
        max_positions: int,
        fused: bool = False,
    ):
        super().__init__()
        self.hf_config = hf_config
        self.state = state
        self.dtype = dtype
        self.flags = flags
        self.fused = fused
        _check_sliding_window(hf_config, max_positions)
        self.start_layer, self.end_layer = pp_layer_range(
            hf_config.num_hidden_layers, state.pp_rank, state.pp_size
        )
        self.layer_names = [
            f"model.layers.{i}.self_attn" for i in range(self.start_layer, self.end_layer)
        ]
        self.hidden_size = hf_config.hidden_size
        self.vocab_size = hf_config.vocab_size
        self.model = LlamaModel(hf_config, flags, state, self.start_layer, self.end_layer, fused)
        first = self.model.layers[str(self.start_layer)].self_attn
        self.head_dim = first.head_dim
        self.num_heads = first.num_heads  # on this TP rank
        self.num_kv_heads = first.num_kv_heads
        self.rotary = RotaryEmbedding(
            self.head_dim,
            max_positions,
            rope_parameters_of(hf_config),
            hf_config.max_position_embeddings,
            dtype,
        )
        self.lm_head = None
        if state.is_last_stage:
            tied = bool(getattr(hf_config, "tie_word_embeddings", False))
            source = "model.embed_tokens.weight" if tied else "lm_head.weight"
            self.lm_head = ParallelLMHead(
                hf_config.vocab_size,
                hf_config.hidden_size,
                source,
                state,
                "lm_head.weight" if tied else None,
            )
            if tied and self.model.embed_tokens is not None:
                self.lm_head.tie_to(self.model.embed_tokens)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: StepMetadata,
        intermediate_tensors: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """First stage embeds input_ids, later stages continue intermediate_tensors
        {"hidden_states", "residual"}; non-last stages return that dict, the last one the
        final-normed hidden states [num_tokens, hidden]."""
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(
                f"got {len(kv_caches)} KV caches for {len(self.model.layers)} layers "
                f"[{self.start_layer}, {self.end_layer})"
            )
        if self.model.embed_tokens is not None:
            if input_ids is None:
                raise ValueError("the first pipeline stage needs input_ids")
            hidden, residual = self.model.embed_tokens(input_ids), None
        else:
            if intermediate_tensors is None:
                raise ValueError(f"pipeline stage {self.state.pp_rank} needs intermediate_tensors")
            hidden = intermediate_tensors["hidden_states"]
            residual = intermediate_tensors["residual"]
        rope = self.rotary.for_step(positions, look_up=not self.fused)
        for layer, kv_cache in zip(self.model.layers.values(), kv_caches, strict=True):
            hidden, residual = layer(rope, hidden, residual, kv_cache, attn_metadata)
        if self.model.norm is None:
            return {"hidden_states": hidden, "residual": residual}
        hidden, _ = self.model.norm.add_and_norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> float32 [n, vocab_size], the full vocabulary on every TP rank."""
        if self.lm_head is None:
            raise RuntimeError(
                f"pipeline stage {self.state.pp_rank} of {self.state.pp_size} has no LM head"
            )
        return self.lm_head(hidden_states)

    def kernel_token_starts(self) -> list[int]:
        """The fewest tokens of each kernel choice a fused step makes by its token count
        (the skinny projections' row tiles, the fused experts' tile sets): warm-up runs a
        step of each, so that none compiles while serving."""
        from zmqworker.models.layers.row_tiles import tile_starts

        starts = set(tile_starts())
        for module in self.modules():
            if isinstance(module, SparseMoeBlock):
                starts.update(module.token_starts())
        return sorted(starts)

    def load_weights(self, path: str) -> None:
        """Fill this rank's parameters from the checkpoint folder (also used on wake-up)."""
        load_checkpoint(self, path)
