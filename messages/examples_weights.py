"""Example messages of a live weight update (messages/weights.py), for the golden
fixtures: the first layer of SmolLM2-135M in bfloat16, announced, then its bytes in
shared memory and in CUDA memory of the engine's process. Deterministic, like
examples.py."""

from __future__ import annotations

from collections.abc import Callable

from messages.kinds import Message
from messages.rpc import RpcRequest
from messages.weights import (
    CudaWeightRef,
    CudaWeights,
    SharedWeightRef,
    SharedWeights,
    WeightSpec,
    WeightUpdate,
)

HIDDEN, KV_ROWS, INTER, VOCAB = 576, 192, 1536, 49_152  # SmolLM2-135M's shapes
ALIGN = 64
HEADER_BYTES = 64
PIECE_BYTES = 64 << 20


def first_layer() -> list[WeightSpec]:
    """The embedding and layer 0 of SmolLM2-135M, as a checkpoint names them."""
    layer = "model.layers.0"
    shapes = {
        "model.embed_tokens.weight": [VOCAB, HIDDEN],
        f"{layer}.input_layernorm.weight": [HIDDEN],
        f"{layer}.self_attn.q_proj.weight": [HIDDEN, HIDDEN],
        f"{layer}.self_attn.k_proj.weight": [KV_ROWS, HIDDEN],
        f"{layer}.self_attn.v_proj.weight": [KV_ROWS, HIDDEN],
        f"{layer}.self_attn.o_proj.weight": [HIDDEN, HIDDEN],
        f"{layer}.post_attention_layernorm.weight": [HIDDEN],
        f"{layer}.mlp.gate_proj.weight": [INTER, HIDDEN],
        f"{layer}.mlp.up_proj.weight": [INTER, HIDDEN],
        f"{layer}.mlp.down_proj.weight": [HIDDEN, INTER],
    }
    return [WeightSpec(name, "bfloat16", shape) for name, shape in shapes.items()]


def weight_update() -> WeightUpdate:
    return WeightUpdate(tensors=first_layer())


def shared_weights() -> SharedWeights:
    """The layer's tensors after the embedding, each whole, 64-byte aligned after the
    segment's header; then the embedding's first 1,000 rows."""
    refs, offset = [], HEADER_BYTES
    for spec in first_layer()[1:]:
        rows = spec.shape[0]
        refs.append(SharedWeightRef(spec.name, offset, 0, rows))
        size = 2
        for n in spec.shape:
            size *= n
        offset += -(-size // ALIGN) * ALIGN
    refs.append(SharedWeightRef("model.embed_tokens.weight", offset, 0, 1000))
    offset += 1000 * HIDDEN * 2
    return SharedWeights(pid=48_200, fd=31, generation=551_022_781_377, nbytes=offset, tensors=refs)


def cuda_weights() -> CudaWeights:
    """Two of the layer's tensors, views of one storage (a flat parameter buffer)."""
    handle = bytes(range(64))  # a cudaIpcMemHandle_t is 64 opaque bytes
    counter = b"/torch_48200_1375_0"
    event = bytes(range(64, 128))
    q_bytes = HIDDEN * HIDDEN * 2
    refs = [
        CudaWeightRef(
            name=f"model.layers.0.self_attn.{proj}_proj.weight",
            device_uuid="GPU-5f2c9a1e-0b7d-4c3e-9a61-2d8f0e4b7c15",
            handle=handle,
            storage_size_bytes=2 * q_bytes,
            storage_offset_bytes=0,
            ref_counter_handle=counter,
            ref_counter_offset=i,
            event_handle=event,
            event_sync_required=True,
            stride=[HIDDEN, 1],
            storage_offset=i * HIDDEN * HIDDEN,
        )
        for i, proj in enumerate(("q", "o"))
    ]
    return CudaWeights(tensors=refs)


WEIGHT_EXAMPLES: dict[str, Callable[[], Message]] = {
    "request_start_weight_update": lambda: RpcRequest(
        200, "start_weight_update", [weight_update()]
    ),
    "request_load_weight_chunk_shared": lambda: RpcRequest(
        201, "load_weight_chunk", [shared_weights()]
    ),
    "request_load_weight_chunk_cuda": lambda: RpcRequest(
        202, "load_weight_chunk", [cuda_weights()]
    ),
    "request_update_weights_from_group": lambda: RpcRequest(
        203,
        "update_weights_from_group",
        [WeightUpdate(tensors=first_layer(), piece_bytes=PIECE_BYTES)],
    ),
}
