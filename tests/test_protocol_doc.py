"""docs/protocol.md is all an engine in another language needs: every message type that
can travel is defined there with all its fields, every RPC method is in its table with
the worker's own signature, every fixture is listed, and the names and numbers it quotes
are the code's."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import msgspec
import msgspec.inspect as mi
import pytest

from messages import (
    INLINE_MAX_BYTES,
    PROTOCOL_VERSION,
    Message,
    RpcRequest,
    WorkerConfig,
    config,
    kv_cache,
    rpc,
    sampling,
    step,
    weights,
)
from messages import examples as ex
from zmqworker.distributed.pp_channel import RECV_TIMEOUT_S, SHM_ENV
from zmqworker.executor.handshake import STUCK_AFTER_S
from zmqworker.executor.multiproc import SHUTDOWN_GRACE_S, SIGTERM_GRACE_S
from zmqworker.runtime.engine_watch import PARENT_POLL_S
from zmqworker.runtime.main import build_parser
from zmqworker.runtime.worker_process import HANDSHAKE_TIMEOUT_S
from zmqworker.transport.curve import CURVE_ENV
from zmqworker.transport.spawn_env import MAX_MESSAGE_ENV, TOKEN_ENV
from zmqworker.worker.worker_base import CONCURRENT_METHODS, RPC_METHODS, WorkerBase

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
    modules = (config, kv_cache, rpc, sampling, step, weights)
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


def documented_signatures() -> dict[str, str]:
    """method -> its signature, as the table of "### RPC methods" writes it."""
    section = DOC.split("### RPC methods", 1)[1].split("\n#", 1)[0]
    return {name: sig for sig, name in re.findall(r"^\| `((\w+)\([^`]*\))` \|", section, re.M)}


def signature(method: str) -> str:
    """How the table writes WorkerBase's method: its parameters but self and the
    reserved keyword-only call_id, defaults as Python writes them."""
    params = [
        p
        for p in inspect.signature(getattr(WorkerBase, method)).parameters.values()
        if p.name != "self" and p.kind is not p.KEYWORD_ONLY
    ]
    parts = [p.name if p.default is p.empty else f"{p.name}={p.default!r}" for p in params]
    return f"{method}({', '.join(parts)})"


def test_every_rpc_method_is_in_the_table_with_its_signature() -> None:
    documented = documented_signatures()
    assert set(documented) == set(RPC_METHODS)
    for method in RPC_METHODS:
        assert documented[method] == signature(method)


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
    variables = {TOKEN_ENV, MAX_MESSAGE_ENV, CURVE_ENV, SHM_ENV}
    assert {v for v in variables if f"| `{v}` |" not in table} == set()
    assert set(re.findall(r"ZMQWORKER_\w+", DOC)) == variables  # none of another name
    [worker_cls] = [
        f.default for f in msgspec.structs.fields(WorkerConfig) if f.name == "worker_cls"
    ]
    assert f'`"{worker_cls}"`' in DOC


@pytest.mark.parametrize(
    "quoted",
    [
        f"**{HANDSHAKE_TIMEOUT_S:g} s**",  # the Welcome's timeout
        f"every {PARENT_POLL_S:g} s",
        f"the stuck bound, {STUCK_AFTER_S:g} s",
        f"waits {SHUTDOWN_GRACE_S:g} s for the reply",
        f"waits {SIGTERM_GRACE_S:g} s",
        f"waited {RECV_TIMEOUT_S:g} s",
        f"more than **{INLINE_MAX_BYTES // 1024} KiB**",
    ],
)
def test_the_numbers_it_quotes_are_the_code_s(quoted: str) -> None:
    assert quoted in " ".join(DOC.split())
