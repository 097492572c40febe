"""The bound on how many frames one received message may have (transport/frames.py, and
docs/protocol.md, "Size limits"): past it a message is taken off the socket whole and
refused with an error naming its count and the bound, the next message is read as
usual, and the largest message the socket legitimately takes passes. recv_frames
itself, the event loop's socket, a worker process's engine socket, the KV server and
puller, the engine's ROUTER, an engine core and its client, over real sockets."""

from __future__ import annotations

import asyncio
import itertools
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
import zmq

from messages import (
    PROTOCOL_VERSION,
    CachedRequestData,
    Decoder,
    Encoder,
    EngineCoreConfig,
    IntermediateTensors,
    ModelConfig,
    NewRequestData,
    ProtocolError,
    RpcReply,
    RpcRequest,
    SamplingParams,
    SchedulerOutput,
    UtilityCall,
    UtilityResult,
    Welcome,
    WorkerConfig,
)
from messages.kv_peer import KVBlocks, KVDone, KVPull
from messages.kv_transfer import KVConnectorMetadata, KVSave
from tests.engine_helpers import FakeExecutor
from tests.test_executor import echo_config
from tests.test_kv_connector import (
    DEVICE,
    SPEC,
    answered_by_hand,
    caches,
    connector,
    free_port,
    names,
    peer,
)
from tests.test_pipeline_trust import on_loop
from zmqworker.engine.core_main import build_core
from zmqworker.engine.core_server import EngineCoreServer
from zmqworker.executor.message_limits import check_request_frames
from zmqworker.executor.multiproc import MultiprocExecutor
from zmqworker.frontend.core_client import EngineCoreClient
from zmqworker.frontend.core_process import WatchedEngineCore
from zmqworker.frontend.errors import EngineCoreError
from zmqworker.kv_transfer import wire
from zmqworker.kv_transfer.blocks import layout_of
from zmqworker.transport.async_socket import LEAD_WAIT, AsyncSocket
from zmqworker.transport.frames import MAX_FRAMES, NOBLOCK, TooManyFrames, recv_frames

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")
PAST = f"a message of {MAX_FRAMES + 1} frames: this socket takes at most {MAX_FRAMES}"
_PAIRS = itertools.count()  # an inproc name is free again only once its socket is reaped


def junk(count: int) -> list[bytes]:
    return [b""] * count


def arrays(count: int) -> list[np.ndarray]:
    """count one-value arrays: each a data frame of its own with an encoder that inlines
    nothing (as an engine in another language may send them)."""
    return [np.array([i], np.int32) for i in range(count)]


def every_array_framed(msg) -> list:
    return Encoder(inline_max_bytes=0).encode(msg)


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket, zmq.Socket]]:
    ctx = zmq.Context.instance()
    sender, receiver = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    address = f"inproc://frame-limits-{next(_PAIRS)}"
    receiver.bind(address)
    sender.connect(address)
    yield sender, receiver
    sender.close(linger=0)
    receiver.close(linger=0)


# recv_frames --------------------------------------------------------------------------


@pytest.mark.parametrize("flags", [NOBLOCK, 0], ids=["noblock", "blocking"])
@pytest.mark.parametrize("count", [1, 4, 5, 9])
def test_recv_frames_refuses_a_message_past_its_bound_and_reads_the_next(
    pair, count: int, flags: int
) -> None:
    sender, receiver = pair
    message = [b"%d" % i for i in range(count)]
    sender.send_multipart(message)
    sender.send_multipart([b"next", b"message"])
    assert receiver.poll(5000)
    if count <= 4:
        assert [f.bytes for f in recv_frames(receiver, flags, max_frames=4)] == message
    else:
        with pytest.raises(TooManyFrames) as refused:
            recv_frames(receiver, flags, max_frames=4)
        assert str(refused.value) == f"a message of {count} frames: this socket takes at most 4"
        assert (refused.value.count, refused.value.bound) == (count, 4)
        assert refused.value.first.bytes == b"0"  # what may name the message's call
        # every receiver already handles a ProtocolError: a message that does not decode
        assert isinstance(refused.value, ProtocolError) and refused.value.version is None
    assert [f.bytes for f in recv_frames(receiver, flags, max_frames=4)] == [b"next", b"message"]
    with pytest.raises(zmq.Again):
        recv_frames(receiver)


def test_the_default_bound_takes_max_frames_and_no_more(pair) -> None:
    sender, receiver = pair
    sender.send_multipart(junk(MAX_FRAMES + 1))
    sender.send_multipart(junk(MAX_FRAMES))
    assert receiver.poll(5000)
    with pytest.raises(TooManyFrames, match=f"^{PAST}$"):
        recv_frames(receiver)
    assert len(recv_frames(receiver)) == MAX_FRAMES


def test_the_engine_refuses_to_send_a_worker_more_frames_than_it_takes() -> None:
    frames = junk(MAX_FRAMES + 1)
    refusal = (
        f"execute_model: the request has {MAX_FRAMES + 1} frames, more than the {MAX_FRAMES} "
        "a worker takes in one message"
    )
    with pytest.raises(ValueError, match=refusal):
        check_request_frames("execute_model", frames, 1 << 20)
    check_request_frames("execute_model", frames[:MAX_FRAMES], 1 << 20)


def test_the_doc_quotes_the_bound() -> None:
    doc = (Path(__file__).resolve().parent.parent / "docs" / "protocol.md").read_text()
    size_limits = " ".join(doc.split("- **Size limits.**", 1)[1].split("\n- ", 1)[0].split())
    assert f"every other socket **{MAX_FRAMES}** frames as its peer sends them" in size_limits
    assert "A KV server's `ROUTER` takes **2** frames" in size_limits


# the event loop's socket (a worker's engine socket, a pipeline stage's) --------------


def test_the_loop_s_socket_refuses_a_message_past_the_bound_on_either_thread(pair) -> None:
    """Received by the loop (_drain) or by a thread that leads while idle (take()): the
    message is counted as refused, never handed on, and the next one is."""
    sender, receiver = pair
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    handed: list[list[bytes]] = []
    refused: list[tuple[bytes, bool]] = []  # each refusal's first frame, on the loop's thread

    def on_refused(e: TooManyFrames) -> None:
        refused.append((e.first.bytes, threading.current_thread() is thread))

    sock = on_loop(loop, AsyncSocket, receiver, loop, lambda f: handed.append([x.bytes for x in f]),
                   on_refused)  # fmt: skip
    try:
        sender.send_multipart(junk(MAX_FRAMES + 1))
        sender.send_multipart([b"after", b"it"])
        deadline = time.monotonic() + 10
        while not handed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert handed == [[b"after", b"it"]] and sock.refused.total == 1
        for message, taken in ((junk(MAX_FRAMES + 1), None), ([b"led"], [b"led"])):
            assert sock.lead(lambda: None) == LEAD_WAIT  # the loop leaves the socket alone
            sender.send_multipart(message)
            assert receiver.poll(5000)
            frames = sock.take([])
            assert (frames if frames is None else [f.bytes for f in frames]) == taken
        assert sock.refused.total == 2 and handed == [[b"after", b"it"]]
        deadline = time.monotonic() + 10
        while len(refused) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert refused == [(b"", True), (b"", True)]
    finally:
        on_loop(loop, sock.close)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


# a worker process's engine socket --------------------------------------------------------


class RawEngine:
    """A ROUTER and one worker process (the echo worker class) past its Welcome; the
    worker's log in a file."""

    def __init__(self, folder: Path) -> None:
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        address = f"ipc://{folder}/engine.sock"
        self.router.bind(address)
        self.log = folder / "worker.log"
        with open(self.log, "wb") as stderr:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "zmqworker.runtime", "--engine", address, "--rank", "0"],
                env={**os.environ, "ZMQWORKER_TOKEN": "frame-limits"},
                stderr=stderr,
            )
        assert self.router.poll(60_000), "no Hello from the worker"
        self.identity, _ = self.router.recv_multipart()
        config = echo_config()
        self.send(Encoder().encode(Welcome(config=config)))

    def send(self, frames: list) -> None:
        self.router.send_multipart([self.identity, *frames])

    def reply(self, timeout_ms: int = 30_000) -> RpcReply | None:
        if not self.router.poll(timeout_ms):
            return None
        _, *frames = self.router.recv_multipart()
        reply = Decoder().decode(frames)
        assert isinstance(reply, RpcReply)
        return reply

    def logged(self, text: str) -> bool:
        deadline = time.monotonic() + 10
        while text not in self.log.read_text():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.router.close()
        self.ctx.term()


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Iterator[RawEngine]:
    engine = RawEngine(tmp_path_factory.mktemp("frame-limits"))
    yield engine
    engine.close()


def test_a_worker_refuses_a_request_of_too_many_frames_and_serves_the_next(engine) -> None:
    """The refused call fails at once with an error naming the count and the bound (its
    first frame names it), instead of waiting for its deadline; the next is served."""
    enc = Encoder()
    body = enc.encode(RpcRequest(1, "echo", [1]))
    engine.send([*body, *junk(MAX_FRAMES + 1 - len(body))])
    engine.send(enc.encode(RpcRequest(2, "echo", [2])))
    replies = sorted((engine.reply(), engine.reply()), key=lambda r: r.call_id)
    refused, served = replies
    assert refused.call_id == 1 and refused.error is not None
    assert (refused.error.exc_type, refused.error.message) == ("TooManyFrames", PAST)
    assert (served.call_id, served.result, served.error) == (2, 2, None)
    assert engine.reply(timeout_ms=300) is None  # one reply each, nothing for the rest
    assert engine.logged(PAST), engine.log.read_text()
    assert engine.proc.poll() is None


def test_a_request_the_worker_cannot_decode_fails_at_once(engine) -> None:
    """A map is no Value (our engine refuses to send one): a worker answers that call id
    with a protocol error instead of leaving it to hang, and serves the next."""
    request = {"type": "RpcRequest", "call_id": 5, "method": "echo", "args": [[{"a": 1}]]}
    engine.send([msgspec.msgpack.encode([PROTOCOL_VERSION, request])])
    reply = engine.reply()
    assert reply is not None and reply.call_id == 5 and reply.error is not None
    assert reply.error.exc_type == "ProtocolError" and "args[0][0] is a dict" in reply.error.message
    engine.send(Encoder().encode(RpcRequest(6, "echo", [6])))
    reply = engine.reply()
    assert reply is not None and (reply.call_id, reply.result) == (6, 6)


def test_a_worker_takes_a_step_of_max_frames(engine) -> None:
    """The bound itself: a step whose every array is a data frame of its own."""
    count = (MAX_FRAMES - 2) // 2  # new requests: a prompt and a block table each
    new = [
        NewRequestData(f"r{i}", i, prompt, SamplingParams(), blocks, 1)
        for i, prompt, blocks in zip(range(count), arrays(count), arrays(count), strict=True)
    ]
    step = SchedulerOutput(new, CachedRequestData.build([count], [0], [1]), count + 1)
    frames = every_array_framed(RpcRequest(3, "execute_model", [step]))
    assert len(frames) == MAX_FRAMES
    engine.send(frames)
    reply = engine.reply()
    assert reply is not None and reply.call_id == 3 and reply.error is None
    assert reply.result.sampled_token_ids.tolist() == list(range(1, count + 2))


# the KV server and puller ---------------------------------------------------------------


def test_the_kv_server_refuses_more_than_a_pull_and_answers_the_next(caplog) -> None:
    port = free_port()
    kv = caches(8, seed=1)
    side = connector("producer", kv, port)
    ctx = zmq.Context()
    try:
        side.after_step(KVConnectorMetadata(saves=[KVSave("r", np.array([2], np.int32), 4)]))
        sock = peer(ctx, zmq.DEALER, f"tcp://127.0.0.1:{port}")
        pull = wire.encode(KVPull("r", rank=0))
        sock.send_multipart([pull, b"junk"])  # 3 frames at the ROUTER
        sock.send(pull)  # the most it takes: 2
        assert sock.poll(5000), "no answer"
        body, data = sock.recv_multipart()
        assert sock.poll(300) == 0, "the refused pull was answered"
        sock.send(wire.encode(KVDone("r")))
    finally:
        ctx.destroy(linger=0)
        side.shutdown()
    answer = wire.decode(body)
    assert isinstance(answer, KVBlocks) and answer.error is None and answer.num_blocks == 1
    staged = np.frombuffer(data, np.float32).reshape(2, 2, 1, 2, -1)
    for layer in range(len(SPEC.layer_names)):
        assert np.array_equal(staged[layer][:, 0], kv[layer][:, 2].cpu().numpy())
    assert "rank 0: dropped a message of 3 frames: this socket takes at most 2" in caplog.text


def test_the_puller_refuses_an_answer_of_more_frames_and_lands_the_next(caplog) -> None:
    """Had the first answer been read, its extra frame would have failed the load."""
    staged = torch.randn(len(SPEC.layer_names), 2, 1, SPEC.num_kv_heads, 32)
    target = caches(6, seed=4)
    with answered_by_hand(target, "r", [3]) as hand:
        reply = wire.encode(KVBlocks("r", layout_of(SPEC), 1))
        hand.server.send_multipart([hand.who, reply, staged.numpy(), b"junk"])
        hand.server.send_multipart([hand.who, reply, staged.numpy()])
    assert names(hand.outputs, "finished_recving") == ["r"]
    assert names(hand.outputs, "failed_recving") == []
    for layer in range(len(SPEC.layer_names)):
        assert torch.equal(target[layer][:, 3], staged[layer][:, 0].to(DEVICE))
    assert "dropped a message of 3 frames: this socket takes at most 2" in caplog.text


# the engine's ROUTER, an engine core, a client of engine cores ---------------------------


def test_the_engine_drops_a_message_of_too_many_frames_and_takes_max_frames(caplog) -> None:
    ex = MultiprocExecutor(echo_config())
    stray = zmq.Context.instance().socket(zmq.DEALER)
    stray.setsockopt(zmq.LINGER, 0)
    try:
        before = ex.rpc.dropped_messages
        stray.connect(ex.address)
        stray.send_multipart(junk(MAX_FRAMES + 1))
        tensors = {f"t{i}": torch.from_numpy(a) for i, a in enumerate(arrays(MAX_FRAMES - 1))}
        largest = every_array_framed(RpcReply(1, 0, result=IntermediateTensors(tensors)))
        assert len(largest) == MAX_FRAMES
        stray.send_multipart(largest)
        deadline = time.monotonic() + 10
        while ex.rpc.dropped_messages < before + 2 and time.monotonic() < deadline:
            assert ex.collective_rpc("echo", (3,)) == [3]
        assert ex.collective_rpc("echo", (4,)) == [4]
    finally:
        stray.close()
        ex.shutdown()
    assert ex.rpc.dropped_messages == before + 2
    assert PAST in caplog.text  # the first refused as it came
    assert "dropped an unexpected RpcReply" in caplog.text  # the second decoded: a stranger's


@pytest.fixture
def core_address(tmp_path) -> Iterator[str]:
    yield f"ipc://{tmp_path}/core.sock"


def test_an_engine_core_refuses_a_message_of_too_many_frames_and_serves_on(
    core_address: str, caplog
) -> None:
    worker = WorkerConfig(model=ModelConfig(path="unused", max_model_len=64))
    config = EngineCoreConfig(worker=worker, address=core_address, token="t" * 32)
    server = EngineCoreServer(config, zmq.Context.instance())
    thread = threading.Thread(
        target=server.serve,
        args=(lambda: build_core(config, lambda _: FakeExecutor()),),
        daemon=True,
    )
    thread.start()
    handle = WatchedEngineCore(0, os.getpid())
    client = EngineCoreClient([core_address], [handle], config.token)
    try:
        client.wait_ready(30)
        stray = zmq.Context.instance().socket(zmq.DEALER)
        stray.setsockopt(zmq.LINGER, 0)
        stray.connect(core_address)
        stray.send_multipart(junk(MAX_FRAMES + 1))  # MAX_FRAMES + 2 with its identity
        deadline = time.monotonic() + 10
        while server.drops.total == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        stray.close()
        # The largest a client sends: decoded, then refused by the utility's own check.
        client._enc = Encoder(inline_max_bytes=0)
        with pytest.raises(TypeError, match="engine core 0: too many positional arguments"):
            client.call("stats", [arrays(MAX_FRAMES - 1)])
        [stats] = client.call("stats")
    finally:
        client.call("shutdown")
        thread.join(30)
        client.close()
        handle.close()
    assert stats.num_blocks == 64
    assert server.drops.total == 1
    refused = f"refused a message of {MAX_FRAMES + 2} frames: this socket takes at most "
    assert f"{refused}{MAX_FRAMES + 1}" in caplog.text


def test_a_client_fails_its_calls_on_an_output_of_too_many_frames_and_takes_the_next(
    core_address: str,
) -> None:
    """As for any message of its engine core that does not decode: what it waited for
    fails, naming why; the next message is read as usual, the largest included."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(core_address)
    handle = WatchedEngineCore(0, os.getpid())
    client = EngineCoreClient([core_address], [handle], "token")
    enc, dec = Encoder(), Decoder()

    def answer(frames_of: Callable[[UtilityCall], list]) -> None:
        """The call the client sent, answered with frames_of(it)."""
        assert router.poll(10_000), "no call"
        identity, body = router.recv_multipart()
        call = dec.decode([body])
        assert isinstance(call, UtilityCall)
        router.send_multipart([identity, *frames_of(call)])

    try:
        assert router.poll(10_000), "no Hello"
        router.recv_multipart()
        refused = client.submit("stats")
        answer(lambda call: [*enc.encode(UtilityResult(call.call_id)), *junk(MAX_FRAMES)])
        with pytest.raises(EngineCoreError, match=f"ProtocolError: a malformed message: {PAST}"):
            client.wait(refused)
        taken = client.submit("stats")
        answer(lambda call: every_array_framed(UtilityResult(call.call_id, arrays(MAX_FRAMES - 1))))
        [result] = client.wait(taken)
    finally:
        client.close()
        handle.close()
        router.close()
        ctx.term()
    assert [int(a[0]) for a in result] == list(range(MAX_FRAMES - 1))
