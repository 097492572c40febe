"""Replies to the engine: results and structured errors, each naming its call and rank."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from messages import Encoder, RemoteError, RpcReply, RpcRequest

PROTOCOL_ERROR_CALL_ID = -1  # the call id of a reply to a message that did not decode


class Replier:
    """Encodes and sends replies for one thread (an Encoder is not thread-safe)."""

    def __init__(self, rank: int, send: Callable[[list], None]) -> None:
        self.rank = rank
        self.enc = Encoder()
        self._send = send

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
            why = f"the result ({type(result).__name__}) cannot be encoded: {e}"
            self.error(req.call_id, TypeError(why))
            return
        self._send(frames)

    def error(self, call_id: int, exc: BaseException) -> None:
        tb = "".join(traceback.format_exception(exc)) if exc.__traceback__ else ""
        error = RemoteError(
            rank=self.rank, exc_type=type(exc).__name__, message=str(exc), traceback=tb
        )
        self._send(self.enc.encode(RpcReply(call_id=call_id, rank=self.rank, error=error)))


def replies(reply_rank: int | list[int] | None, rank: int) -> bool:
    """Whether rank answers a call of reply_rank (RpcRequest's) when it succeeds."""
    if reply_rank is None:
        return True
    return rank == reply_rank if isinstance(reply_rank, int) else rank in reply_rank


def peek_call_id(frames: list[zmq.Frame]) -> int:
    """The call id of a request that did not decode, when its body still says it, so
    that the engine fails that call at once instead of waiting for its deadline: the
    body is MessagePack, an array whose second element is a map with an integer
    "call_id" (docs/protocol.md, "Which call_id an error reply carries")."""
    try:
        body = msgspec.msgpack.decode(frames[0].bytes)
    except Exception:
        return PROTOCOL_ERROR_CALL_ID
    if not isinstance(body, list) or len(body) < 2 or not isinstance(body[1], dict):
        return PROTOCOL_ERROR_CALL_ID
    call_id = body[1].get("call_id")
    return (
        call_id
        if isinstance(call_id, int) and not isinstance(call_id, bool)
        else PROTOCOL_ERROR_CALL_ID
    )
