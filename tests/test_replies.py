"""A worker's replies that an engine could not take in: each is answered with an error
that reaches the engine (the worker's side), and one that still does not decode fails
its call at once (the engine's side)."""

from __future__ import annotations

import msgspec
import pytest
import zmq

from messages import PROTOCOL_VERSION, Decoder, RpcReply, RpcRequest
from zmqworker.executor.calls import Liveness
from zmqworker.executor.errors import UndecodableReplyError
from zmqworker.executor.rpc_client import RpcClient
from zmqworker.runtime.replies import MESSAGE_CHARS, TRACEBACK_CHARS, Replier

REQ = RpcRequest(call_id=7, method="m")


def reply_of(sent: list) -> RpcReply:
    [frames] = sent
    reply = Decoder().decode(frames)
    assert isinstance(reply, RpcReply) and reply.call_id == 7 and reply.rank == 3
    return reply


def test_a_result_with_a_frame_past_the_engine_s_bound_is_answered_with_an_error() -> None:
    sent: list = []
    Replier(3, sent.append, max_frame_bytes=1000).finish(REQ, "x" * 2000, None)
    error = reply_of(sent).error
    assert error is not None and error.exc_type == "ValueError"
    assert "the result of m (str) has a frame of" in error.message
    assert "more than the 1000 bytes the engine takes in" in error.message
    sent.clear()
    Replier(3, sent.append, max_frame_bytes=1000).finish(REQ, "x" * 900, None)
    assert reply_of(sent).result == "x" * 900


def test_an_error_whose_text_utf_8_cannot_encode_is_answered() -> None:
    """os.fsdecode writes a file name that is not UTF-8 with lone surrogates: the reply
    carries them as escapes, not nothing at all."""
    sent: list = []
    name = b"model-\xff".decode("utf-8", "surrogateescape")
    try:
        raise FileNotFoundError(f"no such file: {name}")
    except FileNotFoundError as e:
        Replier(3, sent.append).finish(REQ, None, e)
    error = reply_of(sent).error
    assert error is not None and error.message == "no such file: model-\\udcff"
    assert error.traceback.endswith("FileNotFoundError: no such file: model-\\udcff\n")


def test_an_error_of_any_length_fits_the_engine_s_bound() -> None:
    sent: list = []

    class Unreadable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no text")

    Replier(3, sent.append).finish(REQ, None, ValueError("y" * (10 * MESSAGE_CHARS)))
    Replier(3, sent.append).finish(REQ, None, Unreadable())
    long, unreadable = (Decoder().decode(frames).error for frames in sent)
    assert long is not None and long.message == "y" * MESSAGE_CHARS
    assert len(long.traceback) <= TRACEBACK_CHARS
    assert unreadable is not None and unreadable.exc_type == "Unreadable"
    assert unreadable.message == "(its message could not be read: RuntimeError)"


@pytest.mark.timeout(30)
def test_a_reply_that_does_not_decode_fails_its_call_at_once() -> None:
    """A worker of another build or language that answers with a map (no Value): the call
    fails naming the rank and why, instead of waiting for its deadline or for ever."""
    ctx = zmq.Context.instance()
    router, worker = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    try:
        router.bind("inproc://undecodable-reply")
        worker.setsockopt(zmq.IDENTITY, b"rank-0")
        worker.connect("inproc://undecodable-reply")
        client = RpcClient(router, Liveness())
        client.add_peer(0, b"rank-0")
        future = client.collective_rpc("stats", non_block=True)
        req = Decoder().decode(worker.recv_multipart())
        assert isinstance(req, RpcRequest)
        body = {"type": "RpcReply", "call_id": req.call_id, "rank": 0, "result": {"tokens": 3}}
        worker.send(msgspec.msgpack.encode([PROTOCOL_VERSION, body]))
        with pytest.raises(UndecodableReplyError, match="stats: the reply of rank 0 did not"):
            future.result(timeout=20)
        assert client.dropped_messages == 1 and client.owing == []
    finally:
        router.close(0)
        worker.close(0)
