"""The conversation of docs/protocol.md, driven as an engine in another language drives
it: a pyzmq ROUTER, the msgpack library and arrays packed by hand with struct; nothing of
messages/ or zmqworker on the engine's side. One worker process, on the tiny Llama."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from tests.runner_helpers import checkpoint, hf_greedy

VERSION = 23  # docs/protocol.md's; a mismatch with the worker's fails the handshake test
BLOCK_SIZE = 4
KV_CACHE_BYTES = 64 * 1024
PROMPT = [5, 17, 42, 9, 100, 3, 77]
GREEDY = {"type": "SamplingParams", "temperature": 0.0}
# the dtypes this engine writes: their codes in the doc's table, their struct formats
CODES = {"<i4": 4, "<i8": 5}
FORMATS = {"<i4": "i", "<i8": "q"}


def ext(values: list[int], shape: list[int] | None = None, dtype: str = "<i4") -> msgpack.ExtType:
    """An inline numpy array (ext 1): dtype u8, ndim u8, shape as u64, the raw bytes."""
    shape = [len(values)] if shape is None else shape
    head = struct.pack(f"<BB{len(shape)}Q", CODES[dtype], len(shape), *shape)
    return msgpack.ExtType(1, head + struct.pack(f"<{len(values)}{FORMATS[dtype]}", *values))


def int32_values(value: msgpack.ExtType, frames: list[bytes]) -> list[int]:
    """The values of an int32 array, inline (ext 1) or in a data frame (ext 2)."""
    code, ndim = value.data[0], value.data[1]
    assert code == CODES["<i4"]
    data = value.data[2 + 8 * ndim :]
    if value.code == 2:
        data = frames[struct.unpack("<I", data)[0]]
    return list(struct.unpack(f"<{len(data) // 4}i", data))


def columns(*rows: list[int]) -> msgpack.ExtType:
    """CachedRequestData.columns: int32 [6, n], a row per field, a column per request."""
    assert len(rows) == 6
    return ext([v for row in rows for v in row], [6, len(rows[0])])


def cached(*rows: list[int], **fields: Any) -> dict:
    return {"type": "CachedRequestData", "columns": columns(*rows), **fields}


EMPTY = {"type": "CachedRequestData", "columns": ext([], [6, 0])}


def new_request(handle: int, prompt: list[int], blocks: list[int], dtype: str = "<i4") -> dict:
    return {
        "type": "NewRequestData",
        "req_id": f"r{handle}",
        "req_handle": handle,
        "prompt_token_ids": ext(prompt, dtype=dtype),
        "sampling_params": GREEDY,
        "block_ids": ext(blocks, dtype=dtype),
        "num_scheduled_tokens": len(prompt),
    }


def step(new: list[dict], cached_reqs: dict, total: int, **fields: Any) -> dict:
    return {
        "type": "SchedulerOutput",
        "scheduled_new_reqs": new,
        "scheduled_cached_reqs": cached_reqs,
        "total_num_scheduled_tokens": total,
        **fields,
    }


class RawEngine:
    """A ROUTER bound on ipc and one worker process (`zmqworker worker`) connected to it,
    its Hello received."""

    def __init__(self, folder: Path) -> None:
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        address = f"ipc://{folder}/engine.sock"
        self.router.bind(address)
        self.worker = subprocess.Popen(
            [sys.executable, "-m", "zmqworker", "worker", "--engine", address, "--rank", "0"],
            env={**os.environ, "ZMQWORKER_TOKEN": "raw-engine-token"},
        )
        assert self.router.poll(60_000), "no Hello from the worker"
        self.identity, body = self.router.recv_multipart()
        self.hello = msgpack.unpackb(body)
        self.next_id = 0
        # what the start-up found (the engine fixture)
        self.available = 0
        self.spec: dict = {}
        self.num_blocks = 0

    def send(self, message: dict, *frames: bytes, version: int = VERSION) -> None:
        self.router.send_multipart([self.identity, msgpack.packb([version, message]), *frames])

    def receive(self, timeout_ms: int = 60_000) -> tuple[dict, list[bytes]] | None:
        if not self.router.poll(timeout_ms):
            return None
        _, body, *frames = self.router.recv_multipart()
        version, message = msgpack.unpackb(body, strict_map_key=False)
        assert version == VERSION
        return message, frames

    def request(self, method: str, *args: Any, **kwargs: Any) -> dict:
        self.next_id += 1
        return {
            "type": "RpcRequest",
            "call_id": self.next_id,
            "method": method,
            "args": list(args),
            "kwargs": kwargs,
        }

    def call(self, method: str, *args: Any, **kwargs: Any) -> tuple[dict, list[bytes]]:
        """The reply to one call, checked to answer it."""
        request = self.request(method, *args, **kwargs)
        self.send(request)
        reply = self.receive()
        assert reply is not None, f"no reply to {method}"
        assert (reply[0]["type"], reply[0]["call_id"]) == ("RpcReply", request["call_id"])
        return reply

    def result(self, method: str, *args: Any, **kwargs: Any) -> Any:
        reply, _ = self.call(method, *args, **kwargs)
        assert reply["error"] is None, reply["error"]
        return reply["result"]

    def error(self, method: str, *args: Any, **kwargs: Any) -> tuple[str, str]:
        reply, _ = self.call(method, *args, **kwargs)
        assert reply["result"] is None and reply["error"] is not None
        return reply["error"]["exc_type"], reply["error"]["message"]

    def sampled(self, method: str, *args: Any, **kwargs: Any) -> list[int]:
        """The sampled token ids of a ModelRunnerOutput result, by request."""
        reply, frames = self.call(method, *args, **kwargs)
        assert reply["error"] is None, reply["error"]
        output = reply["result"]
        assert output["type"] == "ModelRunnerOutput"
        return int32_values(output["sampled_token_ids"], frames)

    def shutdown(self) -> int:
        """shutdown, its nil reply, then the worker's exit status."""
        assert self.result("shutdown") is None
        return self.worker.wait(timeout=30)

    def close(self) -> None:
        if self.worker.poll() is None:
            self.worker.kill()
            self.worker.wait()
        self.router.close()
        self.ctx.term()


def welcome(engine: RawEngine) -> None:
    config = {
        "type": "WorkerConfig",
        "model": {"type": "ModelConfig", "path": checkpoint(), "max_model_len": 64},
        "cache": {"block_size": BLOCK_SIZE, "kv_cache_bytes": KV_CACHE_BYTES},
        "scheduler": {"max_num_seqs": 4, "max_num_batched_tokens": 32, "warmup_batch_sizes": [1]},
    }
    engine.send({"type": "Welcome", "config": config})


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RawEngine]:
    """A worker through the handshake and the start-up RPCs, as the doc orders them."""
    engine = RawEngine(tmp_path_factory.mktemp("raw-engine"))
    try:
        welcome(engine)
        assert engine.result("init_device") is None
        assert engine.result("load_model") is None
        engine.available = engine.result("determine_available_memory")
        engine.spec = engine.result("get_kv_cache_spec")
        spec = engine.spec
        item_size = {"float32": 4, "bfloat16": 2, "float16": 2}[spec["dtype"]]
        page = 2 * spec["block_size"] * spec["num_kv_heads"] * spec["head_size"] * item_size
        engine.num_blocks = engine.available // (page * len(spec["layer_names"]))
        names = spec["layer_names"]
        kv_cache_config = {
            "type": "KVCacheConfig",
            "num_blocks": engine.num_blocks,
            "tensors": [
                {"type": "KVCacheTensor", "size_bytes": engine.num_blocks * page, "shared_by": [n]}
                for n in names
            ],
            "groups": [{"type": "KVCacheGroup", "layer_names": names, "spec": spec}],
        }
        assert engine.result("initialize_from_config", kv_cache_config) is None
        assert isinstance(engine.result("compile_or_warm_up_model"), float)
        yield engine
        assert engine.shutdown() == 0
    finally:
        engine.close()


def test_handshake_and_start_up(engine: RawEngine) -> None:
    version, hello = engine.hello
    assert version == VERSION and hello["type"] == "Hello"
    assert (hello["protocol_version"], hello["rank"]) == (VERSION, 0)
    assert hello["pid"] == engine.worker.pid
    assert hello["token"] == "raw-engine-token" and hello["data_address"].startswith("ipc://")
    assert engine.available == KV_CACHE_BYTES  # kv_cache_bytes set: exactly that
    assert engine.spec["layer_names"] == [f"model.layers.{i}.self_attn" for i in range(4)]
    # 2 (K, V) x 4 tokens x 2 kv heads x 16 x 4 bytes = 1 KiB a block and layer; 4 layers
    assert engine.num_blocks == KV_CACHE_BYTES // (1024 * 4) == 16


def test_greedy_tokens_of_a_prefill_and_single_stage_decode_steps(engine: RawEngine) -> None:
    """Block 0 is a block like any other; the engine sends no tokens: new_token_ids nil,
    NUM_NEW_TOKENS 0, and the worker computes the token it sampled itself."""
    tokens = engine.sampled("execute_model", step([new_request(0, PROMPT, [0, 1])], EMPTY, 7))
    for computed in range(7, 12):
        new_blocks = [2] if computed == 8 else []  # position 8 starts the third block
        rows = ([0], [computed], [1], [len(new_blocks)], [0], [0])
        delta = cached(*rows, new_block_ids=ext(new_blocks) if new_blocks else None)
        tokens += engine.sampled("execute_model", step([], delta, 1))
    assert tokens == hf_greedy(checkpoint(), tuple(PROMPT), 6)
    engine.sampled("execute_model", step([], EMPTY, 0, finished_req_handles=[0]))


def test_split_sampling_and_what_breaking_its_order_does(engine: RawEngine) -> None:
    prefill = step([new_request(1, PROMPT, [3, 4])], EMPTY, 7)
    assert engine.result("execute_model", prefill, sample=False) is None
    assert engine.sampled("sample_tokens", None) == hf_greedy(checkpoint(), tuple(PROMPT), 1)
    assert engine.error("sample_tokens") == (
        "RuntimeError",
        "sample_tokens without a preceding execute_model(sample=False)",
    )
    decode = step([], cached([1], [7], [1], [0], [0], [0]), 1)
    assert engine.result("execute_model", decode, sample=False) is None
    again = step([], cached([1], [8], [1], [0], [0], [0]), 1)
    assert engine.error("execute_model", again, sample=False) == (
        "RuntimeError",
        "execute_model before sample_tokens consumed the previous step",
    )
    assert len(engine.sampled("sample_tokens", grammar_output=None)) == 1
    engine.sampled("execute_model", step([], EMPTY, 0, finished_req_handles=[1]))


def test_empty_steps(engine: RawEngine) -> None:
    # nothing scheduled, only finished handles (an unknown one included): 0 requests
    assert engine.sampled("execute_model", step([], EMPTY, 0, finished_req_handles=[99])) == []
    exc_type, message = engine.error("execute_model", step([], cached_of_five_rows(), 0))
    assert (exc_type, message) == (
        "ValueError",
        "CachedRequestData.columns must be int32 [6, n], got shape [5, 0]",
    )
    exc_type, message = engine.error("execute_model", step([], None, 0))
    assert exc_type == "ProtocolError" and "scheduled_cached_reqs" in message
    # Host copies for a worker without a host tier: refused, not dropped.
    host = {"type": "KVHostCopies", "store_blocks": ext([0]), "store_slots": ext([0]),
            "load_slots": ext([]), "load_blocks": ext([])}  # fmt: skip
    orders = {"type": "KVConnectorMetadata", "host": host}
    assert engine.error("execute_model", step([], EMPTY, 0, kv_connector_metadata=orders)) == (
        "ValueError",
        "KV orders for a worker without KV transfer or a host tier: host",
    )
    # Another value where the method takes a message: the arguments do not fit it.
    assert engine.error("execute_model", 5) == (
        "TypeError",
        "execute_model: scheduler_output must be a SchedulerOutput, got int",
    )


def cached_of_five_rows() -> dict:
    return {"type": "CachedRequestData", "columns": ext([], [5, 0])}


def test_block_ids_lie_in_0_to_num_blocks_and_int64_arrays_are_taken(engine: RawEngine) -> None:
    last = engine.num_blocks - 1
    too_far = step([new_request(2, PROMPT, [last, engine.num_blocks])], EMPTY, 7)
    assert engine.error("execute_model", too_far) == (
        "ValueError",
        f"request 'r2' (handle 2): block id {engine.num_blocks} outside [0, {engine.num_blocks})",
    )
    wide = step([new_request(2, PROMPT, [last, 5], dtype="<i8")], EMPTY, 7)
    assert engine.sampled("execute_model", wide) == hf_greedy(checkpoint(), tuple(PROMPT), 1)
    decode = {"type": "CachedRequestData", "columns": ext([2, 7, 1, 0, 0, 0], [6, 1], "<i8")}
    assert len(engine.sampled("execute_model", step([], decode, 1))) == 1
    engine.sampled("execute_model", step([], EMPTY, 0, finished_req_handles=[2]))


def test_which_call_id_an_error_reply_carries(engine: RawEngine) -> None:
    def answer(*frames: bytes) -> tuple[int, str, str]:
        engine.router.send_multipart([engine.identity, *frames])
        reply = engine.receive()
        assert reply is not None
        error = reply[0]["error"]
        return reply[0]["call_id"], error["exc_type"], error["message"]

    request = engine.request("check_health")
    body = msgpack.packb([VERSION, request])
    # a body that is no MessagePack array: no id to answer with
    assert answer(b"\x93garbage")[:2] == (-1, "ProtocolError")
    assert answer(msgpack.packb({"call_id": 5}))[:2] == (-1, "ProtocolError")
    assert answer(msgpack.packb({1: request}))[:2] == (-1, "ProtocolError")
    assert answer(msgpack.packb([VERSION, {**request, "call_id": True}]))[:2] == (
        -1,
        "ProtocolError",
    )
    # a body whose second element is a map with an integer call_id: that id
    assert answer(body, b"stray frame") == (
        request["call_id"],
        "ProtocolError",
        "1 trailing frame(s) that no field refers to",
    )
    assert answer(msgpack.packb([4, request])) == (
        request["call_id"],
        "ProtocolError",
        f"protocol version 4 is not this side's {VERSION}",
    )
    assert answer(msgpack.packb([VERSION, {**request, "method": 7}]))[:2] == (
        request["call_id"],
        "ProtocolError",
    )
    assert engine.error("no_such_method") == (
        "AttributeError",
        "'no_such_method' is not callable over RPC",
    )
    late = {**engine.request("check_health"), "deadline": time.time() - 1}
    assert answer(msgpack.packb([VERSION, late]))[1:] == (
        "TimeoutError",
        "check_health arrived after its deadline",
    )
    # no reply at all: a Ping, and a call whose reply_rank names another rank
    engine.send({"type": "Ping"})
    engine.send({**engine.request("check_health"), "reply_rank": 1})
    assert engine.receive(timeout_ms=500) is None
    assert engine.result("check_health") is None


def test_shutdown_replies_then_the_worker_exits_with_status_0(tmp_path: Path) -> None:
    engine = RawEngine(tmp_path)
    try:
        welcome(engine)
        started = time.monotonic()
        assert engine.shutdown() == 0
        assert time.monotonic() - started < 5.0
    finally:
        engine.close()
