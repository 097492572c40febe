"""The shared-memory path of the pipeline channel: the ring itself across real processes
(bit-exact tensors, wrap-around, growth, a sender killed while its views are read), the
bounds it keeps (a receiver that never releases, bad descriptors), and PipelineSender ->
PipelineReceiver over ipc:// in both modes."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch
import zmq

from messages import (
    Decoder,
    Encoder,
    IntermediateTensors,
    PipelineSharedTensors,
    ProtocolError,
    SharedSlot,
    SharedTensorRef,
)
from messages.compare import assert_same
from zmqworker.distributed.pipeline_stage import PipelineStage
from zmqworker.distributed.pp_channel import SHM_SLOTS, use_shared_memory
from zmqworker.distributed.pp_receiver import PipelineReceiver
from zmqworker.distributed.pp_sender import PipelineSender
from zmqworker.distributed.shm_ring import (
    MEMFD_NAME,
    MIN_SLOT_BYTES,
    ShmDescriptorError,
    ShmReceiver,
    ShmSender,
)

ROOT = Path(__file__).resolve().parent.parent
NUM_MESSAGES = 10
GROWS_AT = 6  # messages from here on outgrow the first generation's slots


def message(k: int) -> dict[str, torch.Tensor]:
    """Message k, the same in every process: random bits (NaN payloads included) in
    bfloat16, float32 and int64, of shapes that differ from message to message."""
    gen = torch.Generator().manual_seed(k)
    tokens = 3 + k if k < GROWS_AT else 600 + 100 * k
    bits = torch.randint(-(2**15), 2**15, (tokens, 576), dtype=torch.int16, generator=gen)
    return {
        "hidden_states": bits.view(torch.bfloat16),
        "residual": torch.randn(tokens, 96, generator=gen),
        "positions": torch.randint(-(2**62), 2**62, (tokens,), generator=gen),
        "scalar": torch.tensor(float(k)),
        "empty": torch.empty(0, 576, dtype=torch.bfloat16),
    }


def sender_child(mode: str) -> None:
    """Run in a child process: put messages, one descriptor per stdout line, then wait
    for stdin to close ("sequence") or for its death ("kill")."""
    ring = ShmSender("the test's receiver", num_slots=4, timeout_s=60.0)
    for k in range(NUM_MESSAGES if mode == "sequence" else 1):
        sys.stdout.write(msgspec.json.encode(ring.put(message(k))).decode() + "\n")
        sys.stdout.flush()
    sys.stdin.read()


def start_sender(mode: str) -> subprocess.Popen:
    code = f"from tests.test_shm_ring import sender_child; sender_child({mode!r})"
    return subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )


def read_slot(proc: subprocess.Popen) -> SharedSlot:
    line = proc.stdout.readline()
    assert line, f"the sender exited with {proc.wait()}"
    return msgspec.json.decode(line, type=SharedSlot)


def test_tensors_cross_processes_bit_exact_through_wrap_around_and_growth() -> None:
    proc = start_sender("sequence")
    receiver = ShmReceiver()
    try:
        leases, slots = [], []
        for k in range(NUM_MESSAGES):
            shared = read_slot(proc)
            slots.append(shared)
            lease = receiver.open(shared)
            assert_same(lease.tensors, message(k), f"message {k}")
            leases.append(lease)
            if k >= 2:  # two messages held at a time: the sender waits on the other two
                leases[k - 2].release()
                leases[k - 2].release()  # twice: harmless
        first, grown = slots[0].generation, slots[GROWS_AT].generation
        assert {s.generation for s in slots[:GROWS_AT]} == {first}
        assert {s.generation for s in slots[GROWS_AT:]} == {grown} and grown != first
        assert [s.slot for s in slots[:GROWS_AT]] == [0, 1, 2, 3, 0, 1]  # round the ring
        assert [s.seq for s in slots[:GROWS_AT]] == [1, 1, 1, 1, 2, 2]
        assert all(ref.offset % 64 == 0 for s in slots for ref in s.tensors)
        # Views of the outgrown generation still hold their message.
        assert_same(leases[GROWS_AT - 1].tensors, message(GROWS_AT - 1), "after growth")
        for lease in leases:
            lease.release()
    finally:
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0


def dev_shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def mapped_segments() -> int:
    with open("/proc/self/maps") as maps:
        return sum(f"memfd:{MEMFD_NAME}" in line for line in maps)


def test_views_outlive_a_killed_sender_and_nothing_is_left_behind() -> None:
    before_shm, before_maps = dev_shm(), mapped_segments()
    proc = start_sender("kill")
    receiver = ShmReceiver()
    try:
        lease = receiver.open(read_slot(proc))
    finally:
        proc.kill()
        assert proc.wait(timeout=30) == -signal.SIGKILL
    assert_same(lease.tensors, message(0), "after the sender's death")
    lease.release()  # into memory only this process maps now: harmless
    assert mapped_segments() == before_maps + 1
    del lease
    receiver.close()
    assert mapped_segments() == before_maps  # the last mapping went: the kernel frees it
    assert dev_shm() == before_shm


def test_a_sender_whose_receiver_never_releases_times_out_naming_it() -> None:
    ring = ShmSender("rank 3 at ipc:///tmp/x", num_slots=2, timeout_s=0.05)
    try:
        held = [ring.put(message(0)), ring.put(message(1))]
        with pytest.raises(TimeoutError, match=r"rank 3 at ipc:///tmp/x has not released any "
                           r"of its 2 shared-memory slots within 0\.05 s"):  # fmt: skip
            ring.put(message(2))
        ShmReceiver().open(held[1]).release()
        assert ring.put(message(2)).slot == 1
    finally:
        ring.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_tensors_are_copied_straight_into_the_slot() -> None:
    ring = ShmSender("the test", num_slots=2)
    try:
        for k in (0, GROWS_AT):  # a segment pinned for CUDA, then a grown one, pinned too
            on_gpu = {name: t.cuda() for name, t in message(k).items()}
            lease = ShmReceiver().open(ring.put(on_gpu))
            assert_same(lease.tensors, message(k))
            lease.release()
    finally:
        ring.close()


@pytest.fixture
def ring() -> Iterator[ShmSender]:
    sender = ShmSender("the test", num_slots=2)
    yield sender
    sender.close()


def tensor_ref(shared: SharedSlot, **changes: object) -> SharedSlot:
    refs = [msgspec.structs.replace(shared.tensors[0], **changes), *shared.tensors[1:]]
    return msgspec.structs.replace(shared, tensors=refs)


BAD_DESCRIPTORS = {
    "offset past the segment": (
        lambda s: tensor_ref(s, offset=s.nbytes + 64),
        "'hidden_states': .* bytes at offset .* do not lie aligned inside the slot",
    ),
    "offset in the next slot": (
        lambda s: tensor_ref(s, offset=s.tensors[0].offset + MIN_SLOT_BYTES - 64),
        "do not lie aligned inside the slot",
    ),
    "misaligned offset": (
        lambda s: tensor_ref(s, offset=s.tensors[0].offset + 1),
        "do not lie aligned",
    ),
    "unknown dtype": (lambda s: tensor_ref(s, dtype="float8"), "unknown dtype 'float8'"),
    "too many dimensions": (lambda s: tensor_ref(s, shape=[1] * 33), "33 dimensions"),
    "dimension torch cannot hold": (
        lambda s: tensor_ref(s, shape=[0, 2**64 - 1]),
        r"shape \[0, 18446744073709551615\]",
    ),
    "slot out of range": (lambda s: msgspec.structs.replace(s, slot=7), "slot 7: the segment"),
    "stale use of the slot": (
        lambda s: msgspec.structs.replace(s, seq=s.seq + 1),
        "slot 0 does not hold use 2",
    ),
    "another generation": (
        lambda s: msgspec.structs.replace(s, generation=s.generation + 1),
        "holds no ring segment of generation",
    ),
    "not whole words": (
        lambda s: msgspec.structs.replace(s, nbytes=s.nbytes - 4),
        r"whole words expected",
    ),
    "larger than the file": (
        lambda s: msgspec.structs.replace(s, nbytes=s.nbytes + 4096),
        "the file holds",
    ),
    "not a ring segment": (
        lambda s: msgspec.structs.replace(s, fd=0),  # stdin
        "not a ring segment",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_DESCRIPTORS))
def test_a_bad_descriptor_is_rejected_with_a_clear_error(ring: ShmSender, case: str) -> None:
    spoil, error = BAD_DESCRIPTORS[case]
    good = ring.put(message(0))
    with pytest.raises(ShmDescriptorError, match=error):
        ShmReceiver().open(spoil(good))
    assert_same(ShmReceiver().open(good).tensors, message(0))  # the slot is untouched


def test_negative_sizes_do_not_decode() -> None:
    ref = SharedTensorRef("hidden_states", "float32", [2, 4], 4096)
    msg = PipelineSharedTensors(1, 0, SharedSlot(1, 3, 1, 8192, 0, 1, [ref]))
    assert_same(Decoder().decode(Encoder().encode(msg)), msg)
    msg.shared.tensors[0].shape[0] = -2
    path = r"\$\[1\]\.shared\.tensors\[0\]\.shape\[0\]"
    with pytest.raises(ProtocolError, match=f"Expected `int` >= 0 - at `{path}`"):
        Decoder().decode(Encoder().encode(msg))


# PipelineSender -> PipelineReceiver -------------------------------------------------------


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop on a thread of its own, as a worker's."""
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


RUN = "run-secret-0123456789abcdef"


def receiver_for(loop, tmp_path, **kwargs) -> PipelineReceiver:
    """Rank 1's receiver, admitting rank 0 of RUN, as after its Welcome."""
    receiver = PipelineReceiver(
        zmq.Context.instance(), f"ipc://{tmp_path}/data-1", rank=1, **kwargs
    )
    on_loop(loop, receiver.start, loop)
    receiver.admit(RUN, 0)
    return receiver


def sender_to(address: str, shared_memory: bool | None, timeout_s: float = 30) -> PipelineSender:
    return PipelineSender(zmq.Context.instance(), address, 0, RUN, shared_memory, timeout_s)


@pytest.fixture
def channel(loop, tmp_path) -> Iterator[tuple[PipelineReceiver, str]]:
    receiver = receiver_for(loop, tmp_path)
    yield receiver, receiver.address
    on_loop(loop, receiver.close)


def step_tensors(k: int) -> IntermediateTensors:
    m = message(k)
    return IntermediateTensors({"hidden_states": m["hidden_states"], "residual": m["residual"]})


def test_same_host_stages_share_memory_unless_told_not_to(monkeypatch) -> None:
    assert use_shared_memory("ipc:///tmp/zmqworker-1/data-1.sock")
    assert not use_shared_memory("tcp://10.0.0.2:5555")
    monkeypatch.setenv("ZMQWORKER_PP_SHM", "0")
    assert not use_shared_memory("ipc:///tmp/zmqworker-1/data-1.sock")


@pytest.mark.parametrize("shared_memory", [True, False])
def test_steps_get_their_own_tensors_in_either_mode(channel, shared_memory: bool) -> None:
    receiver, address = channel
    sender = sender_to(address, shared_memory)
    try:
        assert sender.shared_memory == shared_memory
        # More steps than slots, each sent before its step posts for it.
        for call_id in range(10, 10 + 2 * SHM_SLOTS):
            sender.send(call_id, step_tensors(call_id))
            if call_id >= 10 + SHM_SLOTS - 1:  # consume the oldest as a stage would
                done = call_id - SHM_SLOTS + 1
                assert_same(receiver.expect(done, 0).wait(), step_tensors(done))
                receiver.forget(done)
        for call_id in range(10 + SHM_SLOTS + 1, 10 + 2 * SHM_SLOTS):
            assert_same(receiver.expect(call_id, 0).wait(), step_tensors(call_id))
            receiver.forget(call_id)
    finally:
        sender.close()


def test_tensors_that_come_after_their_step_are_handed_back(channel) -> None:
    receiver, address = channel
    sender = sender_to(address, True)
    try:
        for call_id in range(1, 3 * SHM_SLOTS):  # e.g. empty steps, which never wait
            receiver.expect(call_id, 0)
            receiver.forget(call_id)
            sender.send(call_id, step_tensors(0))  # would time out if slots were kept
        receiver.note_call(99)  # the worker has been sent call 99
        sender.send(99, step_tensors(1))
        assert_same(receiver.expect(99, 0).wait(), step_tensors(1))
    finally:
        sender.close()


def test_closing_the_receiver_hands_every_slot_back(loop, tmp_path) -> None:
    receiver = receiver_for(loop, tmp_path)
    sender = sender_to(receiver.address, True)
    try:
        for call_id in range(1, SHM_SLOTS + 1):
            sender.send(call_id, step_tensors(0))
            receiver.expect(call_id, 0).wait()  # held: never forgotten
        on_loop(loop, receiver.close)
        sender.send(SHM_SLOTS + 1, step_tensors(0))  # a slot is free again
    finally:
        sender.close()


def test_closing_the_receiver_ends_a_step_still_waiting(loop, tmp_path) -> None:
    receiver = receiver_for(loop, tmp_path)
    pending = receiver.expect(5, 0, timeout_s=120)
    on_loop(loop, receiver.close)
    with pytest.raises(RuntimeError, match="rank 1: the pipeline channel is closed"):
        pending.wait()


def test_a_full_ring_fails_the_send_naming_step_and_peer(channel) -> None:
    _, address = channel
    sender = sender_to(address, True, timeout_s=0.05)
    try:
        for call_id in range(1, SHM_SLOTS + 1):
            sender.send(call_id, step_tensors(0))
        with pytest.raises(
            TimeoutError, match=re.escape(f"rank 0: step 9: the receiver at {address}")
        ):
            sender.send(9, step_tensors(0))
    finally:
        sender.close()


def raw_push(address: str, msg: PipelineSharedTensors) -> None:
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 1000)
    push.connect(address)
    push.send_multipart(Encoder().encode(msg))
    push.close()


def test_a_bad_descriptor_fails_its_step_and_is_counted(channel, ring) -> None:
    receiver, address = channel
    shared = tensor_ref(ring.put(message(0)), dtype="float8")
    raw_push(address, PipelineSharedTensors(call_id=5, src_rank=0, shared=shared, run_id=RUN))
    with pytest.raises(ValueError, match="step 5: rank 0 sent a bad shared-memory descriptor: "
                       "tensor 'hidden_states': unknown dtype 'float8'"):  # fmt: skip
        receiver.expect(5, 0, timeout_s=30).wait()
    assert receiver.dropped_messages == 1


def test_memory_that_cannot_be_mapped_fails_the_step_with_the_way_out(channel, ring) -> None:
    receiver, address = channel
    gone = subprocess.Popen([sys.executable, "-c", ""])
    gone.wait()  # a pid that no longer exists: its segment cannot be opened
    shared = msgspec.structs.replace(ring.put(message(0)), pid=gone.pid)
    raw_push(address, PipelineSharedTensors(call_id=6, src_rank=0, shared=shared, run_id=RUN))
    with pytest.raises(RuntimeError) as info:
        receiver.expect(6, 0, timeout_s=30).wait()
    text = str(info.value)
    assert f"rank 1 cannot map the shared memory of rank 0 (pid {gone.pid}" in text
    assert "No such file or directory" in text and "ZMQWORKER_PP_SHM=0" in text


def test_a_host_without_shared_memory_files_falls_back_to_frames(channel, monkeypatch) -> None:
    receiver, address = channel

    def refused(*_: object) -> int:
        raise PermissionError(1, "memfd_create refused by the sandbox")

    monkeypatch.setattr(os, "memfd_create", refused)
    sender = sender_to(address, True)
    try:
        sender.send(1, step_tensors(1))
        assert not sender.shared_memory
        assert_same(receiver.expect(1, 0).wait(), step_tensors(1))
    finally:
        sender.close()


def test_a_stage_waits_for_its_tensors_until_the_step_s_deadline(loop, tmp_path) -> None:
    """As long as the engine waits for the step (its call's deadline), however slow the
    stages before: none, no bound; one past, the step fails naming it."""
    receiver = receiver_for(loop, tmp_path)
    stage = PipelineStage(receiver, None, previous_rank=0)
    try:
        started = time.monotonic()
        pending = stage.receive(5, time.time() + 0.5)  # its wait ends a tenth before
        with pytest.raises(TimeoutError, match="step 5: no intermediate tensors from rank 0 by"):
            pending.wait()
        assert 0.4 < time.monotonic() - started < 5
        unbounded = stage.receive(6)
        assert unbounded.until is None
        threading.Timer(0.3, unbounded.deliver, (step_tensors(6),)).start()
        assert_same(unbounded.wait(), step_tensors(6))
    finally:
        on_loop(loop, receiver.close)
