"""The codec: every message and value type round-trips exactly, large buffers move zero-copy,
and what cannot travel is refused with a clear error."""

from __future__ import annotations

import gc

import msgspec
import numpy as np
import pytest
import torch
import zmq

from messages import (
    INLINE_MAX_BYTES,
    PROTOCOL_VERSION,
    Decoder,
    Encoder,
    GrammarOutput,
    IntermediateTensors,
    PipelineTensors,
    ProtocolError,
    RpcReply,
    RpcRequest,
    examples_start,
)
from messages import examples as ex
from messages.codec import DTYPE_NAMES
from messages.compare import assert_same

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")

TORCH_DTYPES = [getattr(torch, name) for name in DTYPE_NAMES]
NUMPY_DTYPES = [np.dtype(name) for name in DTYPE_NAMES if name != "bfloat16"]


def round_trip(msg: msgspec.Struct) -> tuple[msgspec.Struct, list]:
    frames = Encoder().encode(msg)
    return Decoder().decode(frames), frames


@pytest.mark.parametrize("name", sorted(ex.EXAMPLES))
def test_every_example_round_trips(name: str) -> None:
    msg = ex.EXAMPLES[name]()
    decoded, _ = round_trip(msg)
    assert_same(decoded, msg)


@pytest.mark.parametrize(
    "value",
    [
        ex.decode_step(num_reqs=3),
        ex.prefill_step(num_reqs=2, prompt_len=5),
        ex.grammar_output(),
        ex.model_runner_output(4),
        ex.model_runner_output_with_logprobs(),
        ex.intermediate_tensors(num_tokens=1),
        examples_start.kv_cache_spec(),
        examples_start.worker_config(),
        ex.finished_and_resumed_step().scheduled_new_reqs[0].sampling_params,
    ],
    ids=lambda v: type(v).__name__,
)
def test_every_value_type_round_trips_as_argument_and_result(value: msgspec.Struct) -> None:
    for msg in (RpcRequest(9, "m", [value], {"k": value}), RpcReply(9, 0, result=value)):
        decoded, _ = round_trip(msg)
        assert_same(decoded, msg)


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random bits, so floats include NaNs with payloads, infinities, -0.0 and subnormals."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape, itemsize), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


SHAPES = {
    "0-d": (),
    "empty": (0, 7),
    "inline": (3, 5),
    "frame": (INLINE_MAX_BYTES // 2 + 10,),  # over the inline limit for every dtype but bool
}


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_tensor_dtypes_round_trip_bit_exact(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    tensor = random_tensor(dtype, shape)
    msg = PipelineTensors(1, 0, IntermediateTensors({"t": tensor}))
    decoded, frames = round_trip(msg)
    assert_same(decoded, msg)
    assert len(frames) == (2 if tensor.nbytes > INLINE_MAX_BYTES else 1)


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_non_contiguous_tensors_round_trip(dtype: torch.dtype) -> None:
    base = random_tensor(dtype, (64, 300), seed=1)
    views = {
        "transposed": base.t(),
        "strided": base[::3, 5:200:2],
        "expanded": base[:1, :10].expand(50, 10),
        "big strided": base[:, ::2],  # over the limit: copied into a frame
    }
    msg = PipelineTensors(2, 1, IntermediateTensors(views))
    decoded, _ = round_trip(msg)
    for name, out in decoded.tensors.tensors.items():
        assert out.is_contiguous(), name
    assert_same(decoded, msg)


def test_tensor_that_requires_grad_travels_as_its_values() -> None:
    tensor = torch.randn(4, 4, requires_grad=True)
    decoded, _ = round_trip(PipelineTensors(1, 0, IntermediateTensors({"h": tensor * 2})))
    out = decoded.tensors.tensors["h"]
    assert not out.requires_grad
    assert torch.equal(out, (tensor * 2).detach())


@pytest.mark.parametrize("dtype", NUMPY_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (2, 0, 3), (4, 3), (3000, 3)], ids=str)
def test_numpy_arrays_round_trip_bit_exact(dtype: np.dtype, shape: tuple[int, ...]) -> None:
    raw = np.random.default_rng(7).integers(0, 256, (*shape, dtype.itemsize), dtype=np.uint8)
    array = (raw % 2).astype(bool) if dtype == np.bool_ else raw.view(dtype).reshape(shape)
    msg = RpcRequest(
        1, "sample_tokens", [GrammarOutput(req_handles=array, grammar_bitmask=array.T)]
    )
    decoded, _ = round_trip(msg)
    assert_same(decoded, msg)


def address(buffer) -> int:
    return np.frombuffer(buffer, np.uint8).ctypes.data


def test_large_tensor_moves_zero_copy_both_ways() -> None:
    hidden = torch.randn(64, 576).to(torch.bfloat16)
    frames = Encoder().encode(PipelineTensors(3, 0, IntermediateTensors({"h": hidden})))
    assert len(frames) == 2
    assert address(frames[1]) == hidden.data_ptr()  # the encoder did not copy

    received = [bytes(f) for f in frames]  # as zmq hands them over: one buffer per frame
    out = Decoder().decode(received).tensors.tensors["h"]
    assert out.data_ptr() == address(received[1])  # the decoder did not copy
    assert torch.equal(out, hidden)


def test_large_array_moves_zero_copy_both_ways() -> None:
    bitmask = np.arange(8 * 1536, dtype=np.int32).reshape(8, 1536)
    msg = RpcRequest(1, "sample_tokens", [GrammarOutput(np.arange(8, dtype=np.int32), bitmask)])
    frames = Encoder().encode(msg)
    assert len(frames) == 2 and address(frames[1]) == bitmask.ctypes.data

    received = [bytearray(f) for f in frames]
    out = Decoder().decode(received).args[0]
    assert out.grammar_bitmask.ctypes.data == address(received[1])
    # the small array was copied into the body; decoded, it points into the body
    body_start = address(received[0])
    assert body_start < out.req_handles.ctypes.data < body_start + len(received[0])
    assert_same(out, msg.args[0])


def test_zero_copy_through_zmq() -> None:
    """Frames sent and received with copy=False: the decoded tensor is the received frame."""
    hidden = torch.randn(64, 576).to(torch.bfloat16)
    ctx = zmq.Context()
    sender, receiver = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        receiver.bind("inproc://codec-zero-copy")
        sender.connect("inproc://codec-zero-copy")
        msg = PipelineTensors(3, 0, IntermediateTensors({"h": hidden}))
        sender.send_multipart(Encoder().encode(msg), copy=False)
        received = receiver.recv_multipart(copy=False)
        out = Decoder().decode(received).tensors.tensors["h"]
        assert out.data_ptr() == address(received[1].buffer)
        assert torch.equal(out, hidden)
    finally:
        sender.close(linger=0)
        receiver.close(linger=0)
        ctx.term()


def test_decoded_frames_stay_valid_after_the_received_list_is_gone() -> None:
    hidden = torch.randn(64, 576)
    frames = [
        bytes(f)
        for f in Encoder().encode(PipelineTensors(1, 0, IntermediateTensors({"h": hidden})))
    ]
    out = Decoder().decode(frames).tensors.tensors["h"]
    del frames
    torch.randn(1000, 1000)  # reuse freed memory, if any were freed
    assert torch.equal(out, hidden)


def test_encoded_frames_keep_their_tensors_alive() -> None:
    msg = PipelineTensors(1, 0, IntermediateTensors({"h": torch.full((64, 576), 3.0)}))
    frames = Encoder().encode(msg)
    del msg
    gc.collect()
    torch.randn(1000, 1000)  # reuse freed memory, if any were freed
    assert np.all(np.frombuffer(frames[1], np.float32) == 3.0)


def test_body_given_as_a_non_byte_buffer_is_read_by_its_bytes() -> None:
    """int32 items 0x92, version look like this version's prefix; their bytes do not."""
    fake = np.array([0x92, PROTOCOL_VERSION], np.int32)  # bytes 92 00 00 00 0v 00 00 00
    with pytest.raises(ProtocolError, match="malformed body: .*trailing characters"):
        Decoder().decode([memoryview(fake)])


def test_inline_limit_is_a_parameter() -> None:
    msg = ex.execute_model_request(ex.decode_step(num_reqs=8))
    assert len(Encoder().encode(msg)) == 1
    frames = Encoder(inline_max_bytes=0).encode(msg)
    assert len(frames) == 3  # the columns and the new block ids
    assert_same(Decoder().decode(frames), msg)


def test_encoder_and_decoder_are_reusable_across_messages() -> None:
    encoder, decoder = Encoder(), Decoder()
    for name in (
        "pipeline_tensors_bf16",
        "request_decode_256",
        "reply_error",
        "pipeline_tensors_bf16",
    ):
        msg = ex.EXAMPLES[name]()
        assert_same(decoder.decode(encoder.encode(msg)), msg)


def test_tensor_off_the_cpu_is_refused() -> None:
    tensor = torch.empty(4, device="meta")  # stands for cuda: any device but the CPU
    with pytest.raises(ValueError, match="tensor on meta: copy it to the CPU"):
        Encoder().encode(PipelineTensors(1, 0, IntermediateTensors({"h": tensor})))


def test_unsupported_dtypes_are_refused() -> None:
    encoder = Encoder()
    with pytest.raises(ValueError, match="complex64 has no wire encoding"):
        encoder.encode(
            PipelineTensors(1, 0, IntermediateTensors({"h": torch.zeros(2, dtype=torch.complex64)}))
        )
    with pytest.raises(ValueError, match=">i4 has no wire encoding"):
        encoder.encode(
            RpcReply(1, 0, GrammarOutput(np.zeros(2, ">i4"), np.zeros((2, 1), np.int32)))
        )
    with pytest.raises(ValueError, match="object has no wire encoding"):
        encoder.encode(RpcReply(1, 0, GrammarOutput(np.array([None]), np.zeros((1, 1), np.int32))))


def test_value_outside_the_contract_is_refused_by_the_sender() -> None:
    with pytest.raises(ValueError, match=r"m's args\[0\]\[0\] is a complex"):
        RpcRequest(1, "m", [[1j]])
    with pytest.raises(ValueError, match=r"m's kwargs\['k'\] is a dict"):
        RpcRequest(1, "m", [], {"k": {"a": 1}})
    with pytest.raises(ValueError, match="the result is a bytes, not a Value"):
        RpcReply(1, 0, b"raw")
    assert RpcRequest(1, "m", [[1, [2.0, "x", None]], (True,)]).args[1] == (True,)
    itself: list = [1]
    itself.append(itself)  # no end to walk: refused by depth
    with pytest.raises(ValueError, match=r"m's args\[0\]\[1\]\[1\].* nests lists more than 32"):
        RpcRequest(1, "m", [itself])


@pytest.mark.parametrize("args", [[[{"a": 1}]], [[1, [b"raw"]]], [{"a": 1}]])
def test_a_list_that_holds_more_than_plain_values_does_not_decode(args: list) -> None:
    """The schema's list takes any item; the protocol's holds plain values only."""
    with pytest.raises(ProtocolError):
        Decoder().decode([body({"type": "RpcRequest", "call_id": 1, "method": "m", "args": args})])
    reply = {"type": "RpcReply", "call_id": 1, "rank": 0, "result": args}
    with pytest.raises(ProtocolError):
        Decoder().decode([body(reply)])


def body(msg: dict, version: int = PROTOCOL_VERSION) -> bytes:
    return msgspec.msgpack.encode([version, msg])


def test_version_mismatch_is_named() -> None:
    with pytest.raises(
        ProtocolError, match=f"protocol version 99 is not this side's {PROTOCOL_VERSION}"
    ):
        Decoder().decode([body({"type": "RpcRequest", "call_id": 1, "method": "m"}, version=99)])


def test_version_in_a_longer_msgpack_form_is_accepted() -> None:
    """Another language's encoder may write the version as a uint8 (0xcc) rather than the
    shortest fixint; the value is what counts."""
    msg = msgspec.msgpack.encode({"type": "RpcRequest", "call_id": 1, "method": "m"})
    decoded = Decoder().decode([bytes([0x92, 0xCC, PROTOCOL_VERSION]) + msg])
    assert_same(decoded, RpcRequest(1, "m"))


def test_unknown_message_kind_is_named() -> None:
    with pytest.raises(ProtocolError, match="Invalid value 'LaunchMissiles'"):
        Decoder().decode([body({"type": "LaunchMissiles", "call_id": 1})])


def test_wrong_field_type_names_the_field() -> None:
    with pytest.raises(ProtocolError, match=r"Expected `int`, got `str`.*call_id"):
        Decoder().decode([body({"type": "RpcRequest", "call_id": "one", "method": "m"})])
