"""Bad input: every malformed message raises ProtocolError saying what was wrong, and
nothing else ever leaves the decoder (hypothesis feeds it random and mutated messages)."""

from __future__ import annotations

import struct
from typing import Any, get_args

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from messages import PROTOCOL_VERSION, Decoder, Message, ProtocolError, RpcRequest
from messages.codec import DTYPE_NAMES
from messages.make_fixtures import FIXTURES_DIR, unpack_frames

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")

INT32, BF16 = DTYPE_NAMES.index("int32"), DTYPE_NAMES.index("bfloat16")
NUMPY_INLINE, NUMPY_FRAME, TORCH_INLINE = 1, 2, 3
MESSAGE_TYPES = get_args(Message)
GOLDEN = {p.stem: unpack_frames(p.read_bytes()) for p in sorted(FIXTURES_DIR.glob("*.msgpack"))}


def head(code: int, shape: tuple[int, ...]) -> bytes:
    return struct.pack(f"<BB{len(shape)}Q", code, len(shape), *shape)


def inline(
    shape: tuple[int, ...], data: bytes, code: int = INT32, kind: int = NUMPY_INLINE
) -> msgspec.msgpack.Ext:
    return msgspec.msgpack.Ext(kind, head(code, shape) + data)


def in_frame(shape: tuple[int, ...], index: int, code: int = INT32) -> msgspec.msgpack.Ext:
    return msgspec.msgpack.Ext(NUMPY_FRAME, head(code, shape) + struct.pack("<I", index))


def body(msg: Any, version: int = PROTOCOL_VERSION) -> bytes:
    return msgspec.msgpack.encode([version, msg])


def grammar(handles: Any, bitmask: Any) -> bytes:
    """The body of a sample_tokens call carrying a GrammarOutput built of these values."""
    output = {"type": "GrammarOutput", "req_handles": handles, "grammar_bitmask": bitmask}
    return body({"type": "RpcRequest", "call_id": 1, "method": "sample_tokens", "args": [output]})


def nested_args(depth: int) -> bytes:
    """An RpcRequest whose args is a list of a list of ... depth deep."""
    shell = msgspec.msgpack.encode(
        {"type": "RpcRequest", "call_id": 1, "method": "m", "args": None}
    )
    # [version, then the request map with its nil args replaced by the nested lists
    return body(None)[:-1] + shell[:-1] + b"\x91" * depth + b"\xc0"


def pull_step(num_cached_blocks: int) -> bytes:
    """The golden pull step's body, its load saying num_cached_blocks of its 44 blocks
    hold their KV already."""
    version, request = msgspec.msgpack.decode(GOLDEN["request_kv_pull_step"][0])
    request["args"][0]["kv_connector_metadata"]["loads"][0]["num_cached_blocks"] = num_cached_blocks
    return body(request, version)


def pull_from(block_ids: msgspec.msgpack.Ext | None, **more: object) -> bytes:
    """The golden pull step's body, its remote KV in these prefill blocks (and more of
    RemoteKV's fields)."""
    version, request = msgspec.msgpack.decode(GOLDEN["request_kv_pull_step"][0])
    remote = request["args"][0]["kv_connector_metadata"]["loads"][0]["remote"]
    remote.update(block_ids=block_ids, **more)
    return body(request, version)


HANDLES = inline((2,), struct.pack("<2i", 4, 9))
BITMASK = inline((2, 1), struct.pack("<2i", -1, 7))
DECODE_BODY = GOLDEN["request_decode_256"][0]

CASES = {
    "truncated body": ([DECODE_BODY[:-5]], "truncated"),
    "truncated envelope": ([DECODE_BODY[:1]], "truncated"),
    "not msgpack": ([b"\xc1"], "malformed body"),
    "empty message": ([], "empty message: no body frame"),
    "frame not a buffer": ([grammar(HANDLES, BITMASK), 42], "a frame is not a buffer"),
    "wrong version": (
        [body({"type": "RpcRequest", "call_id": 1, "method": "m"}, version=PROTOCOL_VERSION + 1)],
        f"protocol version {PROTOCOL_VERSION + 1} is not this side's {PROTOCOL_VERSION}",
    ),
    "version not an int": ([body({"type": "RpcReply"}, version="1")], "Expected `int`"),
    "unknown message kind": (
        [body({"type": "NoSuchMessage", "call_id": 1})],
        "Invalid value 'NoSuchMessage' - at `\\$\\[1\\].type`",
    ),
    "wrong field type": (
        [body({"type": "RpcRequest", "call_id": "1", "method": "m"})],
        "Expected `int`, got `str` - at `\\$\\[1\\].call_id`",
    ),
    "list for an array": (
        [grammar([4, 9], BITMASK)],
        "Expected `numpy.ndarray`, got `list` - at `\\$\\[1\\].args\\[0\\].req_handles`",
    ),
    "tensor for an array": (
        [grammar(inline((2,), bytes(8), kind=TORCH_INLINE), BITMASK)],
        "Expected `numpy.ndarray`, got `Tensor`",
    ),
    "missing field": ([body({"type": "RpcRequest", "call_id": 1})], "missing required field"),
    "frame index out of range": (
        [grammar(HANDLES, in_frame((2, 1), 5)), bytes(8)],
        "frame index 5 out of range: the message has 1 data frame",
    ),
    "frame index of the body": (
        [grammar(HANDLES, in_frame((2, 1), 0)), bytes(8)],
        "frame index 0 out of range",
    ),
    "inline size disagrees": (
        [grammar(inline((3,), bytes(8)), BITMASK)],
        "int32\\[3\\] needs 12 bytes, the buffer holds 8",
    ),
    "frame size disagrees": (
        [grammar(HANDLES, in_frame((2, 2), 1)), bytes(10)],
        "int32\\[2, 2\\] needs 16 bytes, the buffer holds 10",
    ),
    "trailing frames": (
        [grammar(HANDLES, BITMASK), bytes(8), bytes(4)],
        "2 trailing frame\\(s\\) that no field refers to",
    ),
    "frame referred to twice": (
        [grammar(in_frame((2,), 1), in_frame((2,), 1)), bytes(8)],
        "frame 1 is referred to twice",
    ),
    "unknown ext type": ([grammar(msgspec.msgpack.Ext(7, b"\x04\x00"), BITMASK)], "ext type 7"),
    "ext header too short": (
        [grammar(msgspec.msgpack.Ext(1, b"\x04"), BITMASK)],
        "array header truncated",
    ),
    "ext shape truncated": (
        [grammar(msgspec.msgpack.Ext(1, b"\x04\x02" + bytes(9)), BITMASK)],
        "array header truncated",
    ),
    "too many dimensions": (
        [grammar(msgspec.msgpack.Ext(1, b"\x04\x28" + bytes(8 * 40)), BITMASK)],
        "array of 40 dimensions: at most 32",
    ),
    "unknown dtype code": ([grammar(inline((2,), bytes(8), code=200), BITMASK)], "dtype code 200"),
    "bfloat16 numpy array": (
        [grammar(inline((4,), bytes(8), code=BF16), BITMASK)],
        "bfloat16 cannot be a numpy array",
    ),
    "frame reference not 4 bytes": (
        [grammar(msgspec.msgpack.Ext(NUMPY_FRAME, head(INT32, (2,)) + b"\x01\x00"), BITMASK)],
        "frame reference must be a 4-byte index",
    ),
    "nested too deep": ([nested_args(5000)], "recursion"),
    "more cached blocks than blocks": (
        [pull_step(45)],
        "num_cached_blocks 45 over its 44 block_ids",
    ),
    "a negative prefill block": (
        [pull_from(inline((2,), struct.pack("<2i", 4, -1)))],
        "RemoteKV.block_ids must be one row of block ids",
    ),
    "prefill ranks not a multiple of its stages": (
        [pull_from(None, pipeline_stages=2)],
        "RemoteKV of 1 addresses for 2 pipeline stages: each stage has as many ranks",
    ),
    "no pipeline stage": ([pull_from(None, pipeline_stages=0)], "Expected `int` >= 1"),
    "prefill blocks in two rows": (
        [pull_from(inline((1, 2), struct.pack("<2i", 4, 5)))],
        r"RemoteKV.block_ids must be one row of block ids \(>= 0\), got int32\[1, 2\]",
    ),
}


@pytest.mark.parametrize("frames, problem", CASES.values(), ids=CASES.keys())
def test_bad_input_raises_protocol_error_naming_the_problem(frames: list, problem: str) -> None:
    decoder = Decoder()
    with pytest.raises(ProtocolError, match=problem):
        decoder.decode(frames)
    # the decoder is left clean: the next good message decodes
    assert isinstance(decoder.decode(GOLDEN["pipeline_tensors_bf16"]), MESSAGE_TYPES)


def test_the_hand_built_messages_are_otherwise_valid() -> None:
    """The cases above break one thing each: their shells decode when nothing is broken."""
    decoded = Decoder().decode([grammar(HANDLES, in_frame((2, 1), 1)), struct.pack("<2i", 3, 5)])
    assert isinstance(decoded, RpcRequest)
    assert decoded.args[0].req_handles.tolist() == [4, 9]
    assert decoded.args[0].grammar_bitmask.tolist() == [[3], [5]]
    [load] = Decoder().decode([pull_step(44)]).args[0].kv_connector_metadata.loads
    assert load.num_cached_blocks == len(load.block_ids) == 44


def decodes_or_protocol_error(frames: list) -> None:
    try:
        msg = Decoder().decode(frames)
    except ProtocolError:
        return
    assert isinstance(msg, MESSAGE_TYPES)


FUZZ = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.lists(st.binary(max_size=64), max_size=4))
def test_random_frames(frames: list[bytes]) -> None:
    decodes_or_protocol_error(frames)


@FUZZ
@given(st.binary(max_size=48), st.lists(st.binary(max_size=48), max_size=3), st.integers(0, 8))
def test_random_ext_payloads(payload: bytes, frames: list[bytes], kind: int) -> None:
    decodes_or_protocol_error([grammar(msgspec.msgpack.Ext(kind, payload), BITMASK), *frames])


def mutate(data: st.DataObject, buf: bytes) -> bytes:
    """One random edit: flip a byte, truncate, insert bytes, or delete a span."""
    if not buf:
        return data.draw(st.binary(min_size=1, max_size=8))
    at = data.draw(st.integers(0, len(buf) - 1))
    edit = data.draw(st.sampled_from(["flip", "truncate", "insert", "delete"]))
    if edit == "flip":
        return buf[:at] + bytes([buf[at] ^ data.draw(st.integers(1, 255))]) + buf[at + 1 :]
    if edit == "truncate":
        return buf[:at]
    if edit == "insert":
        return buf[:at] + data.draw(st.binary(min_size=1, max_size=8)) + buf[at:]
    return buf[:at] + buf[at + data.draw(st.integers(1, 16)) :]


@FUZZ
@given(st.sampled_from(sorted(GOLDEN)), st.data())
def test_mutated_golden_messages(name: str, data: st.DataObject) -> None:
    frames = list(GOLDEN[name])
    for _ in range(data.draw(st.integers(1, 3))):
        change = data.draw(st.sampled_from(["body", "frame", "add frame", "drop frame"]))
        if change == "body" or (change == "frame" and len(frames) == 1):
            frames[0] = mutate(data, frames[0])
        elif change == "frame":
            i = data.draw(st.integers(1, len(frames) - 1))
            frames[i] = mutate(data, frames[i])
        elif change == "add frame":
            frames.insert(data.draw(st.integers(1, len(frames))), data.draw(st.binary(max_size=64)))
        elif len(frames) > 1:
            frames.pop(data.draw(st.integers(1, len(frames) - 1)))
    decodes_or_protocol_error(frames)
