"""The pipeline channel under attack: a stray peer, forged run ids and ranks, far-off and
stale call ids, a flood of early messages, a flood of junk, oversize frames, and on tcp a
peer without the run's CURVE key. The legitimate step's tensors must come through
unchanged, memory must stay bounded, the shared-memory ring must stay free, and the
event loop must keep serving its other work."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import zmq

from messages import (
    Encoder,
    IntermediateTensors,
    PipelineSharedTensors,
    PipelineStepRefused,
    PipelineTensors,
)
from messages.compare import assert_same
from zmqworker.distributed.pp_channel import SHM_SLOTS
from zmqworker.distributed.pp_receiver import MAX_AHEAD, MAX_EARLY, PipelineReceiver
from zmqworker.distributed.pp_sender import PipelineSender
from zmqworker.transport.curve import RunKeys, start_zap

RUN = "the-run-secret-0123456789"


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def on_loop(loop: asyncio.AbstractEventLoop, fn, *args):
    async def call():
        return fn(*args)

    return asyncio.run_coroutine_threadsafe(call(), loop).result(10)


def tensors(k: int, rows: int = 4) -> IntermediateTensors:
    gen = torch.Generator().manual_seed(k)
    hidden = torch.randn(rows, 8, generator=gen)
    return IntermediateTensors({"hidden_states": hidden, "residual": hidden + k})


@pytest.fixture
def receiver(loop, tmp_path) -> Iterator[PipelineReceiver]:
    r = PipelineReceiver(zmq.Context.instance(), f"ipc://{tmp_path}/data-1", 1, 1 << 20)
    on_loop(loop, r.start, loop)
    r.admit(RUN, 0)
    r.note_call(10)
    yield r
    on_loop(loop, r.close)


def push(address: str, *messages) -> None:
    """A stray PUSH peer: connects, sends, leaves."""
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(address)
    enc = Encoder()
    for msg in messages:
        sock.send_multipart(enc.encode(msg))
    sock.close()


def settle(receiver: PipelineReceiver, drops: int, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while receiver.dropped_messages < drops and time.monotonic() < end:
        time.sleep(0.01)
    assert receiver.dropped_messages == drops


def stored(receiver: PipelineReceiver) -> int:
    return len(receiver._slots)


def test_messages_without_the_run_or_from_another_rank_change_nothing(receiver) -> None:
    forged = [
        PipelineTensors(call_id=5, src_rank=0, tensors=tensors(99)),  # no run id
        PipelineTensors(call_id=5, src_rank=0, tensors=tensors(98), run_id="guessed"),
        PipelineTensors(call_id=5, src_rank=3, tensors=tensors(97), run_id=RUN),  # not rank 0
    ]
    push(receiver.address, *forged)
    settle(receiver, 3)
    assert stored(receiver) == 0
    sender = PipelineSender(zmq.Context.instance(), receiver.address, 0, RUN, False, 30)
    try:
        sender.send(5, tensors(5))
        assert_same(receiver.expect(5, 0).wait(), tensors(5))
    finally:
        sender.close()


def test_a_step_the_previous_stage_refused_fails_here_at_once(receiver) -> None:
    """Stage 0 refused the step and sent no tensors: this stage would wait until the
    step's deadline (the whole pipeline with it). The refusal comes instead; a forged one
    (no run id, another rank) changes nothing."""
    push(
        receiver.address,
        PipelineStepRefused(call_id=6, src_rank=0, reason="ValueError: forged"),
        PipelineStepRefused(call_id=6, src_rank=3, reason="ValueError: forged", run_id=RUN),
    )
    settle(receiver, 2)
    sender = PipelineSender(zmq.Context.instance(), receiver.address, 0, RUN, False, 30)
    try:
        sender.refuse(6, ValueError("request 'r7' (handle 7): past its tokens"))
        pending = receiver.expect(6, 0)
        pending.until = time.monotonic() + 10.0  # a bound, should the refusal not come
        with pytest.raises(RuntimeError, match="step 6: the previous stage \\(rank 0\\) refused"):
            pending.wait()
        sender.send(7, tensors(7))  # the next step goes on
        assert_same(receiver.expect(7, 0).wait(), tensors(7))
    finally:
        sender.close()


def test_far_off_stale_and_repeated_call_ids_are_dropped_never_stored(receiver) -> None:
    receiver.expect(2, 0)
    receiver.forget(2)  # steps up to 2 are over
    push(
        receiver.address,
        PipelineTensors(call_id=1, src_rank=0, tensors=tensors(1), run_id=RUN),  # stale
        PipelineTensors(call_id=2, src_rank=0, tensors=tensors(2), run_id=RUN),  # over
        PipelineTensors(call_id=10 + MAX_AHEAD + 1, src_rank=0, tensors=tensors(3), run_id=RUN),
        PipelineTensors(call_id=2**40, src_rank=0, tensors=tensors(4), run_id=RUN),
        PipelineTensors(call_id=6, src_rank=0, tensors=tensors(6), run_id=RUN),  # in the window
        PipelineTensors(call_id=6, src_rank=0, tensors=tensors(66), run_id=RUN),  # twice
    )
    settle(receiver, 5)
    assert stored(receiver) == 1
    assert_same(receiver.expect(6, 0).wait(), tensors(6))


def test_early_messages_are_bounded(receiver) -> None:
    receiver.note_call(40)
    early = [
        PipelineTensors(call_id=11 + k, src_rank=0, tensors=tensors(k, rows=64), run_id=RUN)
        for k in range(MAX_EARLY + 20)
    ]
    push(receiver.address, *early)
    settle(receiver, 20)
    assert stored(receiver) == MAX_EARLY
    for k in range(MAX_EARLY):  # the first ones wait for their steps, unchanged
        assert_same(receiver.expect(11 + k, 0).wait(), tensors(k, rows=64))
        receiver.forget(11 + k)
    assert stored(receiver) == 0


def test_forged_descriptors_neither_wedge_the_ring_nor_fill_memory(receiver) -> None:
    sender = PipelineSender(zmq.Context.instance(), receiver.address, 0, RUN, True, 5)
    try:
        sender.send(3, tensors(3))  # a real slot, full until step 3 is over
        real = receiver.expect(3, 0).wait()
        # A real descriptor, as an attacker on this host would copy one: a full slot.
        slot = sender._ring.put(tensors(4).tensors)
        forged = [
            PipelineSharedTensors(call_id=c, src_rank=0, shared=slot) for c in range(4, 30)
        ]  # no run id: a stray peer's replay of the real sender's slots
        push(receiver.address, *forged)
        settle(receiver, len(forged))
        assert stored(receiver) == 1
        assert_same(real, tensors(3))
        receiver.forget(3)
        for call_id in range(4, 4 + 3 * SHM_SLOTS):  # the ring keeps turning
            sender.send(call_id, tensors(call_id))
            assert_same(receiver.expect(call_id, 0).wait(), tensors(call_id))
            receiver.forget(call_id)
    finally:
        sender.close()


def test_a_refused_message_of_the_run_gives_its_slot_back(receiver) -> None:
    sender = PipelineSender(zmq.Context.instance(), receiver.address, 0, RUN, True, 5)
    try:
        receiver.expect(9, 0)
        receiver.forget(9)  # steps up to 9 are over: what comes for them is late
        for call_id in range(2, 2 + 3 * SHM_SLOTS):
            sender.send(min(call_id, 9), tensors(call_id))  # would time out if slots stayed
        receiver.note_call(12)
        sender.send(12, tensors(12))
        assert_same(receiver.expect(12, 0).wait(), tensors(12))
    finally:
        sender.close()


def test_an_oversize_frame_disconnects_its_sender_only(receiver) -> None:
    junk = np.zeros(4 << 20, np.uint8)  # 4 MiB: over the receiver's 1 MiB frames
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(receiver.address)
    sock.send_multipart([b"junk", junk])
    sock.close()
    assert_a_step_gets_through(receiver, 7)
    assert stored(receiver) == 1


def assert_a_step_gets_through(receiver, call_id: int) -> None:
    sender = PipelineSender(zmq.Context.instance(), receiver.address, 0, RUN, False, 30)
    try:
        sender.send(call_id, tensors(call_id))
        assert_same(receiver.expect(call_id, 0).wait(), tensors(call_id))
    finally:
        sender.close()


FLOOD = """
import sys, zmq
sock = zmq.Context().socket(zmq.PUSH)
sock.connect(sys.argv[1])
while True:
    sock.send(b"junk")
"""


def test_a_flood_of_junk_leaves_the_loop_its_other_work(loop, receiver) -> None:
    flooder = subprocess.Popen([sys.executable, "-c", FLOOD, receiver.address])
    try:
        end = time.monotonic() + 10
        while receiver.dropped_messages < 1000 and time.monotonic() < end:
            time.sleep(0.01)
        worst, end = 0.0, time.monotonic() + 3
        while time.monotonic() < end:  # the loop's other callbacks still run, promptly
            started = time.monotonic()
            on_loop(loop, time.sleep, 0)
            worst = max(worst, time.monotonic() - started)
        assert flooder.poll() is None and receiver.dropped_messages > 10_000
        assert worst < 1.0, f"the loop was held for {worst:.1f} s"
    finally:
        flooder.kill()
        flooder.wait()
    assert_a_step_gets_through(receiver, 6)


def test_on_tcp_only_a_peer_with_the_run_key_gets_through(loop) -> None:
    keys = RunKeys.new()
    worker = keys.for_workers()
    ctx = zmq.Context()
    zap = start_zap(ctx, worker.public)
    r = PipelineReceiver(ctx, "tcp://127.0.0.1:*", 1, 1 << 20, worker)
    on_loop(loop, r.start, loop)
    r.admit(RUN, 0)
    r.note_call(10)
    try:
        other = RunKeys.new().for_workers()  # another run's keys
        strangers = [
            PipelineSender(ctx, r.address, 0, RUN, False, 1),  # no CURVE at all
            PipelineSender(ctx, r.address, 0, RUN, False, 1, keys=other),
        ]
        for k, stranger in enumerate(strangers):
            try:
                stranger.send(4, tensors(40 + k))
            except TimeoutError:
                pass  # refused at the handshake: the send never leaves
            finally:
                stranger.close()
        time.sleep(0.5)
        assert stored(r) == 0 and r.dropped_messages == 0  # refused before any frame
        sender = PipelineSender(ctx, r.address, 0, RUN, False, 30, keys=worker)
        try:
            sender.send(4, tensors(4))
            assert_same(r.expect(4, 0).wait(), tensors(4))
        finally:
            sender.close()
    finally:
        on_loop(loop, r.close)
        zap.stop()
        ctx.term()
