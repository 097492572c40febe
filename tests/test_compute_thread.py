"""The worker's two receivers: the event loop and, while it is idle, the compute thread
(leader/follower). Real sockets and threads, no model."""

from __future__ import annotations

import threading

import pytest
import uvloop
import zmq

from messages import Decoder, RpcReply, RpcRequest
from zmqworker.runtime.async_socket import AsyncSocket
from zmqworker.runtime.compute_thread import ComputeThread
from zmqworker.runtime.worker_process import Replier

BURSTS, BURST = 400, 3


def test_calls_run_in_arrival_order_under_bursts(tmp_path) -> None:
    """Bursts of calls land on both receivers; each job notes its number as it runs."""
    ctx = zmq.Context()
    address = f"ipc://{tmp_path}/order.sock"
    router = ctx.socket(zmq.ROUTER)
    router.bind(address)
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(address)
    loop = uvloop.new_event_loop()  # as in the worker process
    ran: list[int] = []
    parts: dict = {}

    def job(frames: list[zmq.Frame]):
        n = int(frames[0].bytes)

        def fn() -> None:
            ran.append(n)
            sum(range(300))  # a little work that holds the GIL

        return fn, lambda result, error: parts["sock"].send_threadsafe([b"done"])

    def start() -> None:
        parts["sock"] = AsyncSocket(dealer, loop, lambda f: parts["compute"].submit(*job(f)))
        parts["compute"] = ComputeThread("compute", parts["sock"], job)
        parts["sock"].send([b"hello"])

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    loop.call_soon_threadsafe(start)
    try:
        router.setsockopt(zmq.RCVTIMEO, 30_000)
        identity, _ = router.recv_multipart()
        sent = 0
        for _ in range(BURSTS):
            for _ in range(BURST):
                router.send_multipart([identity, str(sent).encode()])
                sent += 1
            for _ in range(BURST):
                router.recv_multipart()
    finally:
        loop.call_soon_threadsafe(lambda: (parts["sock"].close(), parts["compute"].stop()))
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        assert parts["compute"].join(10)
        router.close(linger=0)
        ctx.term()
    assert ran == list(range(BURSTS * BURST))


def test_the_thread_outlives_a_completion_that_raises() -> None:
    compute = ComputeThread("compute")
    second = threading.Event()

    def broken_done(result: object, error: BaseException | None) -> None:
        raise RuntimeError("a reply that could not be sent")

    compute.submit(lambda: 1, broken_done)
    compute.submit(second.set, lambda result, error: None)
    assert second.wait(10), "the call after a failed completion never ran"
    compute.stop()
    assert compute.join(10)


@pytest.mark.parametrize("result", [2**70, object()])
def test_a_result_the_codec_rejects_is_answered_with_an_error(result: object) -> None:
    sent: list = []
    replier = Replier(3, sent.append)
    req = RpcRequest(call_id=7, method="m", args=[], kwargs={}, deadline=0.0, reply_rank=None)
    replier.finish(req, result, None)
    reply = Decoder().decode(sent[0])
    assert isinstance(reply, RpcReply) and reply.call_id == 7 and reply.rank == 3
    assert reply.error is not None and "cannot be encoded" in reply.error.message
