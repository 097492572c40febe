"""Replies to the engine: results and structured errors, each naming its call and rank."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import zmq

from messages import Encoder, RemoteError, RpcReply, RpcRequest
from messages.codec import peek_call_id as codec_peek_call_id

PROTOCOL_ERROR_CALL_ID = -1  # the call id of a reply to a message that did not decode
# An error reply's text, cut to these many characters (a traceback keeps its end), so
# that it fits any engine's bound (message_limits.BODY_ROOM).
MESSAGE_CHARS = 16 << 10
TRACEBACK_CHARS = 256 << 10


class Replier:
    """Encodes and sends replies for one thread (an Encoder is not thread-safe).
    max_frame_bytes: the largest frame the engine takes in (-1: no bound); a result
    past it is answered with an error that says so, since libzmq would drop the
    connection, and with it the worker."""

    def __init__(self, rank: int, send: Callable[[list], None], max_frame_bytes: int = -1) -> None:
        self.rank = rank
        self.enc = Encoder()
        self._send = send
        self._max_frame_bytes = max_frame_bytes

    def finish(self, req: RpcRequest, result: Any, error: BaseException | None) -> None:
        """Every failure goes back to the engine, whatever reply_rank says."""
        if error is not None:
            self.error(req.call_id, error)
            return
        if not replies(req.reply_rank, self.rank):
            return
        try:
            frames = self.enc.encode(RpcReply(req.call_id, self.rank, result))
        except Exception as e:  # TypeError, ValueError, OverflowError (ints past 64 bits)...
            why = f"the result of {req.method} cannot be sent: {e}"
            self.error(req.call_id, TypeError(why))
            return
        bound = self._max_frame_bytes
        if bound >= 0 and (largest := max(memoryview(f).nbytes for f in frames)) > bound:
            why = (
                f"the result of {req.method} ({type(result).__name__}) has a frame of "
                f"{largest} bytes, more than the {bound} bytes the engine "
                "takes in (its bound follows from the run's config)"
            )
            self.error(req.call_id, ValueError(why))
            return
        self._send(frames)

    def error(self, call_id: int, exc: BaseException) -> None:
        try:
            message = str(exc)
        except Exception as e:  # a __str__ that raises
            message = f"(its message could not be read: {type(e).__name__})"
        tb = "".join(traceback.format_exception(exc)) if exc.__traceback__ else ""
        error = RemoteError(
            rank=self.rank,
            exc_type=type(exc).__name__,
            message=_utf8(message[:MESSAGE_CHARS]),
            traceback=_utf8(tb[-TRACEBACK_CHARS:]),
        )
        self._send(self.enc.encode(RpcReply(call_id=call_id, rank=self.rank, error=error)))


def _utf8(text: str) -> str:
    """text with what UTF-8 cannot encode (lone surrogates: os.fsdecode's escapes of a
    name that is not UTF-8) written as backslash escapes."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def replies(reply_rank: int | list[int] | None, rank: int) -> bool:
    """Whether rank answers a call of reply_rank (RpcRequest's) when it succeeds."""
    if reply_rank is None:
        return True
    return rank == reply_rank if isinstance(reply_rank, int) else rank in reply_rank


def peek_call_id(frames: list[zmq.Frame]) -> int:
    """The call id of a request that did not decode, when its body still says it (else
    PROTOCOL_ERROR_CALL_ID), so that the engine fails that call at once instead of
    waiting for its deadline."""
    call_id = codec_peek_call_id(frames[0].buffer)
    return PROTOCOL_ERROR_CALL_ID if call_id is None else call_id
