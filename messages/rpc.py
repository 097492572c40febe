"""The RPC envelope, the start-up handshake and the pipeline-parallel tensor messages."""

from __future__ import annotations

import typing
from typing import Annotated

import msgspec

from messages.config import WorkerConfig
from messages.kv_cache import KVCacheConfig, KVCacheSpec
from messages.kv_transfer import KVConnectorOutput
from messages.sampling import SamplingParams
from messages.step import (
    GrammarOutput,
    IntermediateTensors,
    ModelRunnerOutput,
    SchedulerOutput,
)
from messages.weights import CudaWeights, SharedWeights, WeightUpdate

# What an RPC argument or result may be: plain values, or one of the declared messages.
# Lists hold plain values only (checked by value_problem: the schema's list takes any
# item). There is deliberately no catch-all: anything else fails to encode on the
# sender's side.
Value = (
    None
    | bool
    | int
    | float
    | str
    | list
    | SchedulerOutput
    | GrammarOutput
    | ModelRunnerOutput
    | IntermediateTensors
    | KVConnectorOutput
    | KVCacheConfig
    | KVCacheSpec
    | WorkerConfig
    | SamplingParams
    | WeightUpdate
    | SharedWeights
    | CudaWeights
)

_PLAIN = (type(None), bool, int, float, str)
_VALUES = _PLAIN + tuple(
    t for t in typing.get_args(Value) if isinstance(t, type) and issubclass(t, msgspec.Struct)
)
MAX_LIST_DEPTH = 32  # lists in lists: deeper is refused (one that holds itself, say)


def value_problem(value: object) -> str | None:
    """Why value is not a Value, as the rest of a sentence that names it ("[0][1] is a
    dict: ..."), or None: a list's items must be plain values or lists of them, at most
    MAX_LIST_DEPTH deep (walked without recursion)."""
    if isinstance(value, _VALUES):
        return None
    if not isinstance(value, (list, tuple)):
        return (
            f" is a {type(value).__name__}, not a Value (nil, bool, int, float, str, a list "
            "of them, or one of the declared messages)"
        )
    lists: list[tuple[str, list | tuple]] = [("", value)]
    while lists:
        path, items = lists.pop()
        if path.count("[") >= MAX_LIST_DEPTH:
            return f"{path} nests lists more than {MAX_LIST_DEPTH} deep"
        for i, item in enumerate(items):
            if type(item) in _PLAIN:
                continue
            if isinstance(item, (list, tuple)):
                lists.append((f"{path}[{i}]", item))
            elif not isinstance(item, _PLAIN):
                return (
                    f"{path}[{i}] is a {type(item).__name__}: a list holds nil, bool, int, "
                    "float, str and lists of them"
                )
    return None


ALL_RANKS = None

# Answered while another call runs (beside the worker's calls, which run one at a time in
# arrival order), so that an engine can tell a long step from a dead rank.
CONCURRENT_METHODS = frozenset({"check_health"})


class RpcRequest(msgspec.Struct, tag=True):
    """Call method on every worker. reply_rank None: every rank replies; an int: only that
    rank replies (the others run the call and stay silent); a list: only those ranks
    reply (a step's with KV transfer over pipeline stages: each stage's first rank, for
    its stage's transfer reports). deadline is a time.time() instant after which the
    caller no longer waits; 0 means none."""

    call_id: int
    method: str
    args: list[Value] = []
    kwargs: dict[str, Value] = {}
    deadline: float = 0.0
    reply_rank: int | list[int] | None = ALL_RANKS

    def __post_init__(self) -> None:
        for i, arg in enumerate(self.args):
            if (problem := value_problem(arg)) is not None:
                raise ValueError(f"{self.method}'s args[{i}]{problem}")
        for name, arg in self.kwargs.items():
            if (problem := value_problem(arg)) is not None:
                raise ValueError(f"{self.method}'s kwargs[{name!r}]{problem}")


class RemoteError(msgspec.Struct, tag=True):
    """An exception raised on a worker, as the engine sees it."""

    rank: int
    exc_type: str
    message: str
    traceback: str


class RpcReply(msgspec.Struct, tag=True):
    """The answer of one rank to one call: result, or error when the call raised."""

    call_id: int
    rank: int
    result: Value = None
    error: RemoteError | None = None

    def __post_init__(self) -> None:
        if (problem := value_problem(self.result)) is not None:
            raise ValueError(f"the result{problem}")


class Hello(msgspec.Struct, tag=True):
    """First message of a worker: who it is, and the token it was started with.
    data_address is where it receives pipeline tensors ("" is allowed for a first
    stage, which receives none; zmqworker's workers always announce one)."""

    protocol_version: int
    rank: int
    pid: int
    token: str
    hostname: str = ""
    data_address: str = ""


class Welcome(msgspec.Struct, tag=True):
    """The engine's answer to Hello: this worker's configuration and environment, the
    data addresses of every rank (index = rank) for the pipeline channel, and the run's
    secret id, which every pipeline message of the run carries."""

    config: WorkerConfig
    env: dict[str, str] = {}
    data_addresses: list[str] = []
    run_id: str = ""


class Ping(msgspec.Struct, tag=True):
    """A message a worker ignores: the engine sends it to learn which ranks its ROUTER
    can still reach (a send to one it cannot fails at once)."""


class PipelineTensors(msgspec.Struct, tag=True):
    """Stage-to-stage tensors for the step with this call id; run_id is the Welcome's."""

    call_id: int
    src_rank: int
    tensors: IntermediateTensors
    run_id: str = ""


NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class SharedTensorRef(msgspec.Struct, tag=True):
    """One tensor in a shared-memory slot: prod(shape) elements of dtype (a codec dtype
    name, e.g. "bfloat16") in C order, starting offset bytes from the segment's start."""

    name: str
    dtype: str
    shape: list[NonNegative]
    offset: NonNegative


class SharedSlot(msgspec.Struct, tag=True):
    """Where a message's tensors lie on the sender's host: slot `slot` of the anonymous
    memory (memfd) segment that process `pid` holds open as file descriptor `fd`.
    generation names the segment (a sender makes a new one when a message outgrows its
    slots); seq counts the slot's uses, so that a stale release frees nothing."""

    pid: Annotated[int, msgspec.Meta(ge=1)]
    fd: NonNegative
    generation: NonNegative
    nbytes: NonNegative
    slot: NonNegative
    seq: NonNegative
    tensors: list[SharedTensorRef]


class PipelineSharedTensors(msgspec.Struct, tag=True):
    """Stage-to-stage tensors for the step with this call id, left in shared memory
    (stages on one host): the message says where they are, not what they hold."""

    call_id: int
    src_rank: int
    shared: SharedSlot
    run_id: str = ""


class PipelineStepRefused(msgspec.Struct, tag=True):
    """The sending stage refused the step with this call id (reason: its error): the next
    stage fails the step at once instead of waiting out its tensors."""

    call_id: int
    src_rank: int
    reason: str
    run_id: str = ""


PipelineMessage = PipelineTensors | PipelineSharedTensors | PipelineStepRefused
WorkerMessage = RpcRequest | RpcReply | Hello | Welcome | Ping | PipelineMessage
