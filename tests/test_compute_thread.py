"""The worker's two receivers: the event loop and, while it is idle, the compute thread
(leader/follower). Real sockets and threads, no model."""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvloop
import zmq

from messages import Decoder, RpcReply, RpcRequest
from zmqworker.runtime.compute_thread import ComputeThread
from zmqworker.runtime.replies import Replier
from zmqworker.transport.async_socket import AsyncSocket

BURSTS, BURST = 400, 3


@contextlib.contextmanager
def serving(tmp_path: Path, hwm: int = 1000) -> Iterator[tuple[zmq.Socket, bytes, list[int]]]:
    """An engine's ROUTER and a worker's DEALER, served as in the worker process: an
    AsyncSocket on a uvloop thread and a compute thread that leads while idle. A message
    b"N" or b"N:MS" is a job: it notes N as it runs (sleeping MS ms) and replies b"dN"
    from the compute thread; b"hK" is the loop's business, answered b"rhK" from the loop
    (as a health check is). hwm: both ends' high-water marks. Yields the router, the
    worker's identity and the job numbers in the order they ran."""
    ctx = zmq.Context()
    address = f"ipc://{tmp_path}/serving.sock"
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.RCVHWM, hwm)
    router.bind(address)
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.SNDHWM, hwm)
    dealer.setsockopt(zmq.RCVHWM, hwm)
    dealer.connect(address)
    loop = uvloop.new_event_loop()  # as in the worker process
    ran: list[int] = []
    parts: dict = {}

    def job(frames: list[zmq.Frame]):
        data = frames[0].bytes
        if data.startswith(b"h"):
            loop.call_soon_threadsafe(parts["sock"].send, [b"r" + data])
            return None
        n, _, ms = data.partition(b":")

        def fn() -> None:
            ran.append(int(n))
            if int(ms or 0):
                time.sleep(int(ms) / 1000)
            else:
                sum(range(300))  # a little work that holds the GIL

        return fn, lambda result, error: parts["sock"].send_threadsafe([b"d" + n])

    def on_loop_message(frames: list[zmq.Frame]) -> None:
        if frames[0].bytes.startswith(b"h"):
            parts["sock"].send([b"r" + frames[0].bytes])
        else:
            parts["compute"].submit(*job(frames))

    def start() -> None:
        parts["sock"] = AsyncSocket(dealer, loop, on_loop_message)
        parts["compute"] = ComputeThread("compute", parts["sock"], job)
        parts["sock"].send([b"hello"])

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    loop.call_soon_threadsafe(start)
    try:
        router.setsockopt(zmq.RCVTIMEO, 30_000)
        identity, _ = router.recv_multipart()
        yield router, identity, ran
    finally:
        loop.call_soon_threadsafe(lambda: (parts["sock"].close(), parts["compute"].stop()))
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        assert parts["compute"].join(10)
        router.close(linger=0)
        ctx.term()


def test_calls_run_in_arrival_order_under_bursts(tmp_path) -> None:
    """Bursts of calls land on both receivers, and run in the order they were sent."""
    with serving(tmp_path) as (router, identity, ran):
        sent = 0
        for _ in range(BURSTS):
            for _ in range(BURST):
                router.send_multipart([identity, str(sent).encode()])
                sent += 1
            for _ in range(BURST):
                router.recv_multipart()
    assert ran == list(range(BURSTS * BURST))


def test_no_reply_stays_in_the_backlog(tmp_path) -> None:
    """High-water marks of 1, replies from both threads, an engine that now and then
    reads nothing for a while: replies wait in the worker's backlog, and room coming back
    must always send them, even when a look at the socket takes in that news (and its
    FD's edge) before the backlog is flushed. A reply left behind shows as zmq.Again."""
    rng = random.Random(1)
    with serving(tmp_path, hwm=1) as (router, identity, ran):
        router.setsockopt(zmq.RCVTIMEO, 10_000)
        sent = health = 0
        for _ in range(120):
            expected = set()
            long_jobs = rng.random() >= 0.8  # the loop receives while they run
            for _ in range(rng.randint(1, 6)):
                ms = 30 if long_jobs else rng.choice([0, 0, 0, 1, 3])
                router.send_multipart([identity, f"{sent}:{ms}".encode()])
                expected.add(b"d%d" % sent)
                sent += 1
                if rng.random() < 0.3:
                    router.send_multipart([identity, b"h%d" % health])
                    expected.add(b"rh%d" % health)
                    health += 1
            if rng.random() < 0.2:
                time.sleep(0.005)
            while expected:
                expected.remove(router.recv_multipart()[1])
    assert ran == list(range(sent))


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
    assert reply.error is not None and "the result of m cannot be sent" in reply.error.message
