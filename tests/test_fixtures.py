"""The golden fixtures: the encoder reproduces them byte for byte, the decoder reads them back,
the plain msgpack library (no msgspec, no numpy tricks) can read every one of them, and the
conformance JSON beside each is what decoding it gives."""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import msgpack
import numpy as np
import pytest

from messages import PROTOCOL_VERSION, Decoder, RpcRequest
from messages import examples as ex
from messages.codec import DTYPE_NAMES
from messages.compare import assert_same
from messages.conformance import conformance_json
from messages.make_fixtures import FIXTURES_DIR, decoded_json, encode_examples, unpack_frames

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")

REGENERATE = "schema changed? bump messages/version.py and run: python -m messages.make_fixtures"
ENCODED = encode_examples()


def fixture(name: str) -> bytes:
    return (FIXTURES_DIR / f"{name}.msgpack").read_bytes()


def test_every_example_has_a_fixture_and_no_fixture_is_stale() -> None:
    on_disk = {p.stem for p in FIXTURES_DIR.glob("*.msgpack")}
    assert on_disk == set(ex.EXAMPLES), REGENERATE


@pytest.mark.parametrize("name", sorted(ex.EXAMPLES))
def test_encoder_reproduces_the_fixture_byte_for_byte(name: str) -> None:
    assert ENCODED[name] == fixture(name), f"{name}: {REGENERATE}"


@pytest.mark.parametrize("name", sorted(ex.EXAMPLES))
def test_decoder_reads_the_fixture_back_to_the_example(name: str) -> None:
    decoded = Decoder().decode(unpack_frames(fixture(name)))
    assert_same(decoded, ex.EXAMPLES[name]())


def ext_values(obj: Any) -> list[msgpack.ExtType]:
    """Every ext value anywhere in a plain-msgpack object tree."""
    if isinstance(obj, msgpack.ExtType):
        return [obj]
    if isinstance(obj, dict):
        return [e for v in obj.values() for e in ext_values(v)]
    if isinstance(obj, list):
        return [e for v in obj for e in ext_values(v)]
    return []


def parse_ext(ext: msgpack.ExtType, frames: list[bytes]) -> tuple[str, tuple[int, ...], bytes]:
    """The documented layout, read by hand: dtype u8 | ndim u8 | shape ndim x u64 LE |
    the raw bytes (codes 1, 3) or the index of the frame that holds them, u32 LE (2, 4)."""
    code, ndim = ext.data[0], ext.data[1]
    shape = struct.unpack_from(f"<{ndim}Q", ext.data, 2)
    rest = ext.data[2 + 8 * ndim :]
    if ext.code in (1, 3):
        return DTYPE_NAMES[code], shape, rest
    assert ext.code in (2, 4) and len(rest) == 4
    (index,) = struct.unpack("<I", rest)
    return DTYPE_NAMES[code], shape, frames[index]


ITEMSIZE = {"bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8,
            "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}  # fmt: skip


@pytest.mark.parametrize("name", sorted(ex.EXAMPLES))
def test_plain_msgpack_reads_every_fixture(name: str) -> None:
    frames = msgpack.unpackb(fixture(name))  # the container: an array of bin frames
    assert isinstance(frames, list) and all(isinstance(f, bytes) for f in frames)
    version, msg = msgpack.unpackb(frames[0], strict_map_key=False)
    assert version == PROTOCOL_VERSION
    assert msg["type"] == type(ex.EXAMPLES[name]()).__name__
    referenced = []
    for ext in ext_values(msg):
        dtype, shape, data = parse_ext(ext, frames)
        assert len(data) == ITEMSIZE[dtype] * int(np.prod(shape)), (dtype, shape)
        if ext.code in (2, 4):
            referenced.append(struct.unpack("<I", ext.data[-4:])[0])
    assert sorted(referenced) == list(range(1, len(frames))), "every data frame, once"


def test_a_non_msgspec_reader_reconstructs_the_decode_columns() -> None:
    frames = msgpack.unpackb(fixture("request_decode_256"))
    _, msg = msgpack.unpackb(frames[0], strict_map_key=False)
    assert (msg["type"], msg["method"]) == ("RpcRequest", "execute_model")
    step = msg["args"][0]
    assert step["type"] == "SchedulerOutput" and step["scheduled_new_reqs"] == []
    dtype, shape, data = parse_ext(step["scheduled_cached_reqs"]["columns"], frames)
    assert (dtype, shape) == ("int32", (6, 256))
    columns = np.frombuffer(data, "<i4").reshape(shape)
    expected = ex.decode_step().scheduled_cached_reqs
    assert np.array_equal(columns, expected.columns)
    assert step["total_num_scheduled_tokens"] == 256


def test_a_non_msgspec_reader_reconstructs_a_bf16_tensor_from_its_frame() -> None:
    frames = msgpack.unpackb(fixture("pipeline_tensors_bf16"))
    assert len(frames) == 3
    _, msg = msgpack.unpackb(frames[0], strict_map_key=False)
    hidden = msg["tensors"]["tensors"]["hidden_states"]
    assert hidden.code == 4  # a torch tensor in a frame of its own
    dtype, shape, data = parse_ext(hidden, frames)
    assert (dtype, shape) == ("bfloat16", (16, 576))
    # bfloat16 is the top half of a float32: widen by shifting the bits up
    as_float32 = (np.frombuffer(data, "<u2").astype(np.uint32) << 16).view(np.float32)
    expected = ex.intermediate_tensors().tensors["hidden_states"].float().numpy()
    assert np.array_equal(as_float32.reshape(shape), expected)


def test_a_plain_msgpack_writer_is_understood() -> None:
    """The other direction: a message built with the msgpack library alone decodes."""
    int32 = DTYPE_NAMES.index("int32")
    columns = np.array([[7, 8], [10, 20], [1, 1], [0, 1], [0, 0]], "<i4")
    cached = {
        "type": "CachedRequestData",
        "columns": msgpack.ExtType(1, struct.pack("<BB2Q", int32, 2, 5, 2) + columns.tobytes()),
        "new_block_ids": msgpack.ExtType(1, struct.pack("<BBQi", int32, 1, 1, 99)),
    }
    step = {
        "type": "SchedulerOutput",
        "scheduled_new_reqs": [],
        "scheduled_cached_reqs": cached,
        "total_num_scheduled_tokens": 2,
    }
    call = {"type": "RpcRequest", "call_id": 5, "method": "execute_model", "args": [step]}
    decoded = Decoder().decode([msgpack.packb([PROTOCOL_VERSION, call])])
    out = decoded.args[0].scheduled_cached_reqs
    assert np.array_equal(out.columns, columns)
    assert out.new_block_ids.tolist() == [99] and out.new_token_ids is None
    assert decoded.reply_rank is None and decoded.deadline == 0.0


def test_every_fixture_has_its_json_and_no_json_is_stale() -> None:
    assert {p.stem for p in FIXTURES_DIR.glob("*.json")} == set(ex.EXAMPLES), REGENERATE


@pytest.mark.parametrize("name", sorted(ex.EXAMPLES))
def test_the_json_is_what_decoding_the_fixture_gives(name: str) -> None:
    on_disk = (FIXTURES_DIR / f"{name}.json").read_text()
    assert on_disk == decoded_json(fixture(name)), f"{name}: {REGENERATE}"


@pytest.mark.parametrize("name", sorted(ex.EXAMPLES))
def test_the_json_says_what_a_plain_msgpack_reading_says(name: str) -> None:
    """The JSON against the bytes, with neither msgspec nor our decoder in between."""
    frames = msgpack.unpackb(fixture(name))
    version, msg = msgpack.unpackb(frames[0], strict_map_key=False)
    document = json.loads((FIXTURES_DIR / f"{name}.json").read_text())
    assert (document["version"], document["data_frames"]) == (version, len(frames) - 1)
    agree(msg, document["message"], frames, "message")


def agree(raw: Any, value: Any, frames: list[bytes], path: str) -> None:
    """raw (read by the msgpack library) says what value (the JSON) says. Arrays are
    rebuilt by hand from the ext layout; a struct's fields that the writer left out are
    at their defaults in the JSON, which lists every field."""
    if isinstance(raw, msgpack.ExtType):
        dtype, shape, data = parse_ext(raw, frames)
        assert value["array"] == ("numpy" if raw.code in (1, 2) else "torch"), path
        assert (value["dtype"], tuple(value["shape"])) == (dtype, shape), path
        values = [json_number(v) for v in np.frombuffer(data, WIRE_NUMPY[dtype]).tolist()]
        assert value["values"] == values, path
    elif isinstance(raw, dict):
        assert isinstance(value, dict), path
        assert set(raw) <= set(value) if "type" in raw else set(raw) == set(value), path
        for key in raw:
            agree(raw[key], value[key], frames, f"{path}.{key}")
    elif isinstance(raw, list):
        assert isinstance(value, list) and len(raw) == len(value), path
        for i, (r, v) in enumerate(zip(raw, value, strict=True)):
            agree(r, v, frames, f"{path}[{i}]")
    elif isinstance(raw, bytes):  # a bin value: its bytes in hex
        assert value == {"bin": raw.hex()}, path
    else:
        raw = json_number(raw)
        assert type(raw) is type(value) and raw == value, f"{path}: {raw!r} vs {value!r}"


def json_number(v: Any) -> Any:
    """How the JSON writes a value: a float that is not finite as "inf", "-inf", "nan"."""
    if not isinstance(v, float) or math.isfinite(v):
        return v
    return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")


def test_the_json_writes_non_finite_floats_as_strings() -> None:
    document = json.loads((FIXTURES_DIR / "reply_logprobs.json").read_text())
    logprobs = document["message"]["result"]["logprobs"]["logprobs"]["values"]
    assert "-inf" in logprobs  # the row of the request that sampled nothing
    assert {v for v in logprobs if isinstance(v, str)} == {"-inf"}
    values = np.array([np.nan, np.inf, -np.inf, -0.5], np.float64)
    call = RpcRequest(1, "echo", [values.tolist()], deadline=math.inf)
    document = json.loads(conformance_json(call, 0))
    assert document["message"]["args"] == [["nan", "inf", "-inf", -0.5]]
    assert document["message"]["deadline"] == "inf"


# how the JSON writes each dtype's values: 16-bit floats as their raw bits
WIRE_NUMPY = {"bool": "?", "uint8": "u1", "int8": "i1", "int16": "<i2", "int32": "<i4",
              "int64": "<i8", "float16": "<u2", "bfloat16": "<u2", "float32": "<f4",
              "float64": "<f8"}  # fmt: skip
