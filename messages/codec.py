"""The codec: one message is a msgpack body plus zero or more raw frames.

Body: the msgpack array [PROTOCOL_VERSION, message]; the message is a map whose "type"
key names its kind. A numpy array or torch tensor inside a message is a msgpack ext
value (docs/protocol.md has the byte layout):

    ext code 1 numpy inline, 2 numpy in a frame, 3 torch inline, 4 torch in a frame
    payload: dtype u8 | ndim u8 | shape: ndim x u64 LE | raw bytes, or frame index u32 LE

Buffers above the inline limit travel as frames of their own (frame 0 is the body),
never copied on either side. Every decode failure raises ProtocolError, nothing else.

torch is imported only once a tensor is on the wire: an engine that sends and receives
numpy columns alone never pays for it (about 2 s of start-up).
"""

from __future__ import annotations

import functools
import math
import struct
import sys
import warnings
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from messages.errors import ProtocolError
from messages.kinds import Message
from messages.version import PROTOCOL_VERSION

# Buffers larger than this travel as their own frame, zero-copy; smaller ones are
# copied into the body, where they cost less than a frame of their own.
INLINE_MAX_BYTES = 16 * 1024

EXT_NUMPY_INLINE, EXT_NUMPY_FRAME, EXT_TORCH_INLINE, EXT_TORCH_FRAME = 1, 2, 3, 4
MAX_NDIM = 32

# Wire dtype codes. Append only: the numbers are part of the protocol.
DTYPE_NAMES = (
    "bool", "uint8", "int8", "int16", "int32", "int64",
    "float16", "bfloat16", "float32", "float64",
)  # fmt: skip
NUMPY_DTYPES = [None if name == "bfloat16" else np.dtype(name) for name in DTYPE_NAMES]
_NUMPY_CODE = {dt: i for i, dt in enumerate(NUMPY_DTYPES) if dt is not None}
_BFLOAT16 = DTYPE_NAMES.index("bfloat16")
_EXT_KINDS = (EXT_NUMPY_INLINE, EXT_NUMPY_FRAME, EXT_TORCH_INLINE, EXT_TORCH_FRAME)


@functools.cache
def _torch_dtypes() -> list[Any]:
    """The torch dtype of each wire code (imports torch: called for a tensor only)."""
    import torch

    return [getattr(torch, name) for name in DTYPE_NAMES]


@functools.cache
def _torch_codes() -> dict[Any, int]:
    return {dt: i for i, dt in enumerate(_torch_dtypes())}


_FRAME = struct.Struct("<I")
_SHAPES = [struct.Struct(f"<{n}Q") for n in range(MAX_NDIM + 1)]  # after the 2-byte head
_HEADS = [struct.Struct(f"<BB{n}Q") for n in range(MAX_NDIM + 1)]  # dtype, ndim, shape
# What every body of this version starts with: a 2-element array, then the version as a
# positive fixint (msgspec writes the shortest form).
_BODY_PREFIX = bytes([0x92, PROTOCOL_VERSION])

# Decoded frames are read-only memory owned by the received message; torch warns about
# every tensor made over such memory. Receivers treat decoded tensors as read-only.
warnings.filterwarnings("ignore", message="The given buffer is not writable")


# Exactly two elements: a longer envelope is an error, not extra data to pass over.
class _Envelope(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    version: int
    msg: Message


class _RawEnvelope(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    version: int
    msg: msgspec.Raw


class Encoder:
    """Encodes messages into [body, *frames]. Not thread-safe: one per sending thread."""

    def __init__(self, inline_max_bytes: int = INLINE_MAX_BYTES) -> None:
        self._inline_max = inline_max_bytes
        self._frames: list[memoryview] = []
        self._enc = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)

    def encode(self, msg: Message) -> list[bytes | memoryview]:
        """The frames of msg. The returned memoryviews keep their arrays alive."""
        frames: list[bytes | memoryview] = [b""]
        self._frames = frames
        try:
            frames[0] = self._enc.encode(_Envelope(PROTOCOL_VERSION, msg))
        finally:
            self._frames = []
        return frames

    def _enc_hook(self, obj: Any) -> msgspec.msgpack.Ext:
        if isinstance(obj, np.ndarray):
            kind, code, arr = EXT_NUMPY_INLINE, _NUMPY_CODE.get(obj.dtype), obj
            if code is None:
                raise ValueError(f"array dtype {obj.dtype} has no wire encoding")
        elif (torch := sys.modules.get("torch")) is not None and isinstance(obj, torch.Tensor):
            if not obj.is_cpu:
                raise ValueError(f"tensor on {obj.device}: copy it to the CPU before encoding")
            kind, code = EXT_TORCH_INLINE, _torch_codes().get(obj.dtype)
            if code is None:
                raise ValueError(f"tensor dtype {obj.dtype} has no wire encoding")
            if obj.requires_grad:
                obj = obj.detach()
            # numpy has no bfloat16: its bits travel through an int16 view
            arr = (obj.view(torch.int16) if code == _BFLOAT16 else obj).numpy()
        else:
            raise TypeError(f"cannot encode {type(obj).__name__}")
        shape = arr.shape
        if len(shape) > MAX_NDIM:
            raise ValueError(f"{len(shape)} dimensions: the wire carries at most {MAX_NDIM}")
        head = _HEADS[len(shape)].pack(code, len(shape), *shape)
        if arr.nbytes <= self._inline_max:
            return msgspec.msgpack.Ext(kind, head + arr.tobytes())
        self._frames.append(memoryview(np.ascontiguousarray(arr)).cast("B"))
        return msgspec.msgpack.Ext(kind + 1, head + _FRAME.pack(len(self._frames) - 1))


def peek_call_id(body: bytes | memoryview) -> int | None:
    """The call id a message's body says, read without its schema: for a request or a
    reply that did not decode, so that its call fails at once rather than at its
    deadline. The body is MessagePack, an array whose second element is a map with an
    integer "call_id" (docs/protocol.md, "Which call_id an error reply carries"); None
    where it is not."""
    try:
        whole = msgspec.msgpack.decode(body)
    except Exception:
        return None
    if not isinstance(whole, list) or len(whole) < 2 or not isinstance(whole[1], dict):
        return None
    call_id = whole[1].get("call_id")
    return call_id if isinstance(call_id, int) and not isinstance(call_id, bool) else None


class Decoder:
    """Decodes [body, *frames] into a message. Not thread-safe: one per receiving thread.

    Arrays and tensors decoded from separate frames share the frames' memory; inline
    ones share the body's.
    """

    def __init__(self) -> None:
        self._frames: Sequence[memoryview] = ()
        self._used: set[int] = set()
        self._env = msgspec.msgpack.Decoder(_RawEnvelope)
        # No dec_hook: msgspec itself checks that an ext value decoded into an array field
        # is an ndarray (or a Tensor), and names the field when it is not.
        self._msg = msgspec.msgpack.Decoder(Message, ext_hook=self._ext_hook)
        self._whole = msgspec.msgpack.Decoder(_Envelope, ext_hook=self._ext_hook)

    def decode(self, frames: Sequence[Any]) -> Message:
        """frames: the body and the raw frames, as bytes, memoryviews or zmq Frames."""
        if not frames:
            raise ProtocolError("empty message: no body frame")
        if len(frames) == 1:
            # Fast path for a body alone (most calls and replies): one pass, nothing to
            # account for. Anything unusual takes the careful path below, which reports
            # it properly.
            try:
                env = self._whole.decode(frames[0])
            except Exception:
                env = None
            if env is not None and env.version == PROTOCOL_VERSION:
                return env.msg
        try:
            views = [memoryview(f) for f in frames]
        except TypeError as e:
            raise ProtocolError(f"a frame is not a buffer: {e}") from None
        self._frames, self._used = views, set()
        try:
            msg = self._decode_body(views[0])
        except ProtocolError:
            raise
        except msgspec.MsgspecError as e:
            raise ProtocolError(f"invalid message: {e}") from None
        except Exception as e:  # nothing but ProtocolError may leave the decoder
            raise ProtocolError(f"invalid message: {type(e).__name__}: {e}") from None
        finally:
            self._frames = ()
        if len(self._used) != len(views) - 1:
            raise ProtocolError(
                f"{len(views) - 1 - len(self._used)} trailing frame(s) that no field refers to"
            )
        return msg

    def _decode_body(self, body: memoryview) -> Message:
        if body.format != "B":  # compare bytes below, not the items of some other format
            body = body.cast("B")
        # Fast path: this version's prefix, so envelope and message decode in one pass.
        if body[:2] == _BODY_PREFIX:
            return self._whole.decode(body).msg
        # Anything else: read the version alone first, so that another version's message
        # is reported as such rather than as whatever field its schema breaks.
        try:
            env = self._env.decode(body)
        except msgspec.MsgspecError as e:
            raise ProtocolError(f"malformed body: {e}") from None
        if env.version != PROTOCOL_VERSION:
            raise ProtocolError(
                f"protocol version {env.version} is not this side's {PROTOCOL_VERSION}",
                version=env.version,
            )
        return self._msg.decode(env.msg)

    def _ext_hook(self, kind: int, data: memoryview) -> Any:
        if kind not in _EXT_KINDS:
            raise ProtocolError(f"unknown ext type {kind}")
        dtypes = NUMPY_DTYPES if kind < EXT_TORCH_INLINE else _torch_dtypes()
        if len(data) < 2:
            raise ProtocolError("array header truncated")
        code, ndim = data[0], data[1]
        if ndim > MAX_NDIM:
            raise ProtocolError(f"array of {ndim} dimensions: at most {MAX_NDIM}")
        start = 2 + 8 * ndim
        if len(data) < start:
            raise ProtocolError("array header truncated")
        if code >= len(DTYPE_NAMES):
            raise ProtocolError(f"unknown dtype code {code}")
        dtype = dtypes[code]
        if dtype is None:
            raise ProtocolError(f"{DTYPE_NAMES[code]} cannot be a numpy array: send a tensor")
        shape = _SHAPES[ndim].unpack_from(data, 2)
        if kind % 2:
            buf, offset = data, start
        else:
            buf, offset = self._frame(data, start), 0
        size = math.prod(shape)
        if len(buf) - offset != size * dtype.itemsize:
            raise ProtocolError(
                f"{DTYPE_NAMES[code]}{list(shape)} needs {size * dtype.itemsize} bytes, "
                f"the buffer holds {len(buf) - offset}"
            )
        if kind < EXT_TORCH_INLINE:
            return np.ndarray(shape, dtype, buf, offset)
        import torch

        if size == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype, count=size, offset=offset).reshape(shape)

    def _frame(self, data: memoryview, start: int) -> memoryview:
        if len(data) != start + 4:
            raise ProtocolError("frame reference must be a 4-byte index")
        (index,) = _FRAME.unpack_from(data, start)
        if not 1 <= index < len(self._frames):
            raise ProtocolError(
                f"frame index {index} out of range: the message has "
                f"{len(self._frames) - 1} data frame(s)"
            )
        if index in self._used:
            raise ProtocolError(f"frame {index} is referred to twice")
        self._used.add(index)
        frame = self._frames[index]
        return frame if frame.format == "B" and frame.ndim == 1 else frame.cast("B")
