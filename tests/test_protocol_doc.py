"""docs/protocol.md is all an engine in another language needs: every message type that
can travel is defined there with all its fields, every RPC method is in its table with
the worker's own signature, every fixture is listed, and the names and numbers it quotes
are the code's."""

from __future__ import annotations

import inspect
import json
import re
import types
import typing
from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect as mi
import numpy as np
import pytest

from messages import (
    INLINE_MAX_BYTES,
    PROTOCOL_VERSION,
    Message,
    RpcRequest,
    UtilityValue,
    WorkerConfig,
    config,
    engine_core,
    kv_cache,
    kv_transfer,
    rpc,
    sampling,
    step,
    structured_outputs,
    weights,
)
from messages import examples as ex
from messages.rpc import CONCURRENT_METHODS, Value
from zmqworker.distributed.pp_channel import SHM_ENV
from zmqworker.engine.core_clients import PROBE_EVERY_S, PROBE_WINDOW_S
from zmqworker.engine.core_server import CLIENT_SILENT_S, HEARTBEAT_IVL_S, SHUTDOWN
from zmqworker.engine.utility import UTILITY_METHODS, EngineCoreUtilities
from zmqworker.executor.handshake import STUCK_AFTER_S, Handshake, bind_router, new_token
from zmqworker.executor.message_limits import BODY_ROOM, LARGE_HIDDEN, LARGE_VOCAB
from zmqworker.executor.multiproc import SHUTDOWN_GRACE_S, SIGTERM_GRACE_S
from zmqworker.frontend.core_client import LOST_GRACE_S
from zmqworker.frontend.core_process import EXIT_GRACE_S
from zmqworker.frontend.core_process import SIGTERM_GRACE_S as CORE_SIGTERM_GRACE_S
from zmqworker.frontend.engine_connection import ENGINE_SILENT_S, PING_EVERY_S
from zmqworker.runtime.engine_watch import PARENT_POLL_S
from zmqworker.runtime.main import build_parser
from zmqworker.runtime.worker_process import HANDSHAKE_TIMEOUT_S
from zmqworker.transport.curve import CURVE_ENV, KV_CURVE_ENV
from zmqworker.transport.heartbeats import keep_alive
from zmqworker.transport.spawn_env import (
    ENGINE_SILENT_ENV,
    MAX_MESSAGE_ENV,
    SHARE_GPUS_ENV,
    TOKEN_ENV,
    WELCOME_TIMEOUT_ENV,
)
from zmqworker.worker.worker_base import RPC_METHODS, WorkerBase

DOC = (Path(__file__).resolve().parent.parent / "docs" / "protocol.md").read_text()
LINES = DOC.splitlines()


def traveling_structs() -> set[type]:
    """Every Struct that can travel: what the envelope's Message union reaches, RPC
    argument and result values included, as msgspec itself sees the types."""
    found: set[type] = set()

    def walk(info: mi.Type) -> None:
        if isinstance(info, mi.StructType):
            if info.cls not in found:
                found.add(info.cls)
                for f in info.fields:
                    walk(f.type)
        elif isinstance(info, mi.UnionType):
            for member in info.types:
                walk(member)
        elif isinstance(info, mi.Metadata):
            walk(info.type)
        elif isinstance(info, mi.ListType):
            walk(info.item_type)
        elif isinstance(info, mi.DictType):
            walk(info.value_type)

    walk(mi.type_info(Message))
    return found


def declared_structs() -> set[type]:
    """The public Structs of the wire contract's modules."""
    modules = (
        config,
        engine_core,
        kv_cache,
        kv_transfer,
        rpc,
        sampling,
        step,
        structured_outputs,
        weights,
    )
    return {
        value
        for module in modules
        for name, value in vars(module).items()
        if isinstance(value, type)
        and issubclass(value, msgspec.Struct)
        and value.__module__ == module.__name__
        and not name.startswith("_")
    }


def test_every_declared_struct_travels_and_only_those() -> None:
    assert traveling_structs() == declared_structs()


# Where a struct is defined: its heading, a bold name opening a line, or its table row.
DEFINITION = re.compile(r"^(?:#{2,4} (\w+)\b|\*\*(\w+)\*\*|\| (\w+) \|)")


def definition(name: str) -> str:
    """The text that defines name: from its heading or bold name to the next of either,
    or its table row."""
    for i, line in enumerate(LINES):
        match = DEFINITION.match(line)
        if match is None or name not in match.groups():
            continue
        if match.group(3):
            return line
        end = next(
            (j for j in range(i + 1, len(LINES)) if LINES[j].startswith(("#", "**"))),
            len(LINES),
        )
        return "\n".join(LINES[i:end])
    raise AssertionError(f"docs/protocol.md does not define {name}")


@pytest.mark.parametrize("cls", sorted(traveling_structs(), key=lambda c: c.__name__))
def test_every_message_type_is_defined_with_every_field(cls: type) -> None:
    text = definition(cls.__name__)
    missing = [f for f in cls.__struct_fields__ if f"`{f}`" not in text]
    assert not missing, f"{cls.__name__}: fields {missing} are not in its definition"


def field_table(name: str) -> list[dict[str, str]]:
    """The rows of the first table in name's definition, each a dict by the header's
    column names; [] when it has no table (a struct of no fields)."""
    lines = [line for line in definition(name).splitlines() if line.startswith("|")]
    if not lines:
        return []
    header, _, *rows = ([c.strip() for c in line.strip()[1:-1].split("|")] for line in lines)
    assert header[:2] == ["field", "type"] and "default" in header, f"{name}: {header}"
    assert all(len(row) == len(header) for row in rows), f"{name}: a row of another width"
    return [dict(zip(header, row, strict=True)) for row in rows]


def doc_type(hint: Any) -> str:
    """The pattern of how the tables write a field's type: int, float, str, bool, a struct
    by its name, "X or nil" ("X, Y or nil"), "list of X", "map str -> X", Value (an RPC
    value), tensor (IntermediateTensors' values), and "<dtype> array [shape]", the dtype
    captured."""
    if hint == Value:
        return "Value"
    if hint == UtilityValue:
        return "UtilityValue"
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return "str"
    if origin is typing.Annotated:
        return doc_type(args[0])
    if origin in (typing.Union, types.UnionType):
        others = [doc_type(a) for a in args if a is not type(None)]
        return f"{', '.join(others)} or nil"
    if origin is list:
        return f"list of {doc_type(args[0])}"
    if origin is dict:
        return f"map {doc_type(args[0])} -> {doc_type(args[1])}"
    if hint is np.ndarray:
        return r"(?P<dtype>\w+) array \[[^\]]+\]"
    if hint is Any:
        return "tensor"
    if hint is bytes:
        return "bin"  # MessagePack's name
    return re.escape(hint.__name__)


def doc_range(hint: Any) -> str:
    """How the range column writes a field's constraints (msgspec.Meta), "" for none:
    ">= 0", "(0, 1]", "each non-empty", "each >= 0", "length <= 8", "length 1 to 8",
    "keys >= 0, values [-1, 1]", 'one of "a", "b"'."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return "one of " + ", ".join(f'"{a}"' for a in args)
    if origin is typing.Annotated:
        own = [_bounds(m) for m in args[1:] if isinstance(m, msgspec.Meta)]
        return ", ".join(r for r in [*own, doc_range(args[0])] if r)
    if origin in (typing.Union, types.UnionType):
        return "".join(doc_range(a) for a in args)
    if origin is list:
        return f"each {doc_range(args[0])}" if doc_range(args[0]) else ""
    if origin is dict:
        keys, values = doc_range(args[0]), doc_range(args[1])
        return ", ".join(r for r in [keys and f"keys {keys}", values and f"values {values}"] if r)
    return ""


def _bounds(meta: msgspec.Meta) -> str:
    if meta.max_length is not None:
        low = meta.min_length or 0
        return f"length {low} to {meta.max_length}" if low else f"length <= {meta.max_length}"
    if meta.min_length == 1:
        return "non-empty"
    low = ("[", meta.ge) if meta.ge is not None else ("(", meta.gt)
    high = ("]", meta.le) if meta.le is not None else (")", meta.lt)
    if low[1] is not None and high[1] is not None:
        return f"{low[0]}{low[1]}, {high[1]}{high[0]}"
    if low[1] is not None:
        return f"{'>=' if low[0] == '[' else '>'} {low[1]}"
    assert high[1] is None, meta  # an upper bound alone: say how the table writes it
    return ""


def doc_default(field: msgspec.structs.FieldInfo) -> str:
    """How the default column writes a field's default: empty for a required field."""
    if field.default_factory is not msgspec.NODEFAULT:
        value = field.default_factory()
    elif field.default is not msgspec.NODEFAULT:
        value = field.default
    else:
        return ""
    if value is None:
        return "nil"
    if isinstance(value, msgspec.Struct):
        return "its defaults"
    return f"`{json.dumps(value)}`"


def example_dtypes() -> dict[tuple[type, str], set[str]]:
    """(struct, array field) -> the dtypes the examples' arrays of that field have."""
    found: dict[tuple[type, str], set[str]] = {}

    def walk(value: Any) -> None:
        if isinstance(value, msgspec.Struct):
            for name in value.__struct_fields__:
                field = getattr(value, name)
                if isinstance(field, np.ndarray):
                    found.setdefault((type(value), name), set()).add(str(field.dtype))
                walk(field)
        elif isinstance(value, list | tuple):
            for v in value:
                walk(v)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)

    for build in ex.EXAMPLES.values():
        walk(build())
    return found


EXAMPLE_DTYPES = example_dtypes()


@pytest.mark.parametrize("cls", sorted(traveling_structs(), key=lambda c: c.__name__))
def test_every_field_table_is_the_struct_s(cls: type) -> None:
    """Every field, in declaration order (the order of the conformance JSON), with its
    type, its default (none: required), its range; an array field with the dtype the
    fixtures have."""
    rows = field_table(cls.__name__)
    fields = msgspec.structs.fields(cls)
    assert [r["field"] for r in rows] == [f"`{f.name}`" for f in fields], cls.__name__
    hints = typing.get_type_hints(cls, include_extras=True)
    for field, row in zip(fields, rows, strict=True):
        where = f"{cls.__name__}.{field.name}"
        hint = hints[field.name]
        match = re.fullmatch(doc_type(hint), row["type"])
        assert match, f"{where}: type {row['type']!r}, the struct's {doc_type(hint)!r}"
        assert row["default"] == doc_default(field), f"{where}: default {row['default']!r}"
        assert row.get("range", "").startswith(doc_range(hint)), f"{where}: range"
        if not doc_range(hint):
            assert row.get("range", "") == "", f"{where}: a range the struct does not check"
        if "dtype" in match.groupdict():
            assert EXAMPLE_DTYPES.get((cls, field.name)) == {match["dtype"]}, where


def documented_signatures() -> dict[str, str]:
    """method -> its signature, as the table of "### RPC methods" writes it."""
    section = DOC.split("### RPC methods", 1)[1].split("\n#", 1)[0]
    return {name: sig for sig, name in re.findall(r"^\| `((\w+)\([^`]*\))` \|", section, re.M)}


def signature(method: str, cls: type = WorkerBase) -> str:
    """How a table writes cls's method: its parameters but self and the reserved
    keyword-only call_id, defaults as Python writes them."""
    params = [
        p
        for p in inspect.signature(getattr(cls, method)).parameters.values()
        if p.name != "self" and p.kind is not p.KEYWORD_ONLY
    ]
    parts = [p.name if p.default is p.empty else f"{p.name}={p.default!r}" for p in params]
    return f"{method}({', '.join(parts)})"


def test_every_rpc_method_is_in_the_table_with_its_signature() -> None:
    documented = documented_signatures()
    assert set(documented) == set(RPC_METHODS)
    for method in RPC_METHODS:
        assert documented[method] == signature(method)


def test_every_utility_method_is_in_its_table_with_its_signature() -> None:
    section = DOC.split("### Utility methods", 1)[1].split("\n#", 1)[0]
    rows = {
        name: line for line in section.splitlines() for name in re.findall(r"^\| `(\w+)\(", line)
    }
    assert set(rows) == {*UTILITY_METHODS, SHUTDOWN}
    for method, waits in UTILITY_METHODS.items():
        assert rows[method].startswith(f"| `{signature(method, EngineCoreUtilities)}` |"), method
        assert ("*waits*" in rows[method]) == waits, method


def test_the_methods_that_run_beside_the_others_are_named() -> None:
    section = DOC.split("### RPC methods", 1)[1]
    beside = section.split("which runs beside them", 1)[0]
    assert all(f"`{m}`" in beside for m in CONCURRENT_METHODS)


def test_every_method_the_fixtures_call_is_named() -> None:
    methods = {m.method for m in (b() for b in ex.EXAMPLES.values()) if isinstance(m, RpcRequest)}
    assert [m for m in methods if f"`{m}" not in DOC] == []


def test_every_fixture_is_in_the_conformance_table() -> None:
    section = DOC.split("### Conformance", 1)[1]
    listed = set(re.findall(r"^\| `(\w+)` \|", section, re.M))
    assert listed == set(ex.EXAMPLES)


def test_the_version_and_the_encoded_examples_are_this_protocols() -> None:
    assert f"Protocol version: **{PROTOCOL_VERSION}**" in DOC
    quoted = re.findall(r"packb\(\[(\d+),|Encode `\[(\d+),", DOC)
    assert quoted and {int(a or b) for a, b in quoted} == {PROTOCOL_VERSION}


def test_the_worker_command_line_and_environment_are_the_code_s() -> None:
    options = set(re.findall(r"--[a-z][\w-]*", build_parser().format_usage()))
    assert {"--engine", "--rank"} <= options
    table = DOC.split("## The worker process", 1)[1].split("\n## ", 1)[0]
    assert {o for o in options if f"| `{o}` |" not in table} == set()
    variables = {TOKEN_ENV, MAX_MESSAGE_ENV, CURVE_ENV, KV_CURVE_ENV, SHM_ENV, SHARE_GPUS_ENV}
    variables |= {WELCOME_TIMEOUT_ENV, ENGINE_SILENT_ENV}
    assert {v for v in variables if f"| `{v}` |" not in table} == set()
    assert set(re.findall(r"ZMQWORKER_\w+", DOC)) == variables  # none of another name
    [worker_cls] = [
        f.default for f in msgspec.structs.fields(WorkerConfig) if f.name == "worker_cls"
    ]
    assert f'`"{worker_cls}"`' in DOC


def test_the_run_id_is_what_the_engine_makes() -> None:
    assert "32 random hex digits (lowercase)" in DOC
    assert re.fullmatch(r"[0-9a-f]{32}", Handshake(1, new_token(), [1]).run_id)


def test_every_socket_option_the_engine_sets_is_named_where_an_engine_is_told_to() -> None:
    """The heartbeat and size options of the engine's ROUTER: in "Heartbeats" and in
    "Speaking it from another language"."""
    options = {
        f"ZMQ_{o}"
        for source in (inspect.getsource(bind_router), inspect.getsource(keep_alive))
        for o in re.findall(r"zmq\.(HEARTBEAT_\w+|MAXMSGSIZE)", source)
    }
    assert {"ZMQ_HEARTBEAT_IVL", "ZMQ_HEARTBEAT_TIMEOUT", "ZMQ_HEARTBEAT_TTL"} <= options
    heartbeats = DOC.split("- **Heartbeats.**", 1)[1].split("\n- ", 1)[0]
    speaking = DOC.split("## Speaking it from another language", 1)[1]
    for option in options:
        assert option in speaking, option
        assert option in heartbeats or option == "ZMQ_MAXMSGSIZE", option


@pytest.mark.parametrize(
    "quoted",
    [
        f"**{HANDSHAKE_TIMEOUT_S:g} s**",  # the Welcome's timeout
        f"plus {BODY_ROOM >> 20} MiB",  # the size limits' room for a body
        f"2**{LARGE_VOCAB.bit_length() - 1}, 2**{LARGE_HIDDEN.bit_length() - 1}",
        f"every {PARENT_POLL_S:g} s",
        f"the stuck bound, {STUCK_AFTER_S:g} s",
        f"waits {SHUTDOWN_GRACE_S:g} s for the reply",
        f"waits {SIGTERM_GRACE_S:g} s",
        f"more than **{INLINE_MAX_BYTES // 1024} KiB**",
        f"`ZMQ_HEARTBEAT_IVL` {HEARTBEAT_IVL_S:g} s",
        f"`ZMQ_HEARTBEAT_TTL` {CLIENT_SILENT_S:g} s",
        f"for {PROBE_WINDOW_S:g} s it then Pings every client",
        f"ignores) every {PROBE_EVERY_S * 1000:g} ms",
        f"Our clients wait {EXIT_GRACE_S:g} s for that exit",
        f"then send SIGTERM, wait {CORE_SIGTERM_GRACE_S:g} s",
        f"has not exited {LOST_GRACE_S:g} s later",
        f"it pings every {PING_EVERY_S:g} s and drops a connection that has left a ping "
        f"unanswered for {ENGINE_SILENT_S:g} s",
    ],
)
def test_the_numbers_it_quotes_are_the_code_s(quoted: str) -> None:
    assert quoted in " ".join(DOC.split())
