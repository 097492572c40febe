"""A worker's watch on its engine (runtime/engine_watch.py) over real CURVE sockets: a
handshake cut short by a slow ZAP answer is tried again by libzmq, not taken for the
engine's end; a refusal of the worker's keys ends it at once, as a drop after a
handshake does."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import pytest
import zmq
from zmq.auth.thread import ThreadAuthenticator

from zmqworker.runtime.engine_watch import EngineWatch

ENGINE = zmq.curve_keypair()
WORKER = zmq.curve_keypair()


class SlowOnce:
    """A ZAP credentials check that admits WORKER's key, after a pause on its first call
    longer than the engine's handshake interval."""

    def __init__(self, pause_s: float) -> None:
        self.pause_s = pause_s
        self.calls = 0

    def callback(self, domain: str, client_key: bytes) -> bool:
        self.calls += 1
        if self.calls == 1:
            time.sleep(self.pause_s)
        return client_key == WORKER[0]


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def engine(ctx: zmq.Context, provider: SlowOnce) -> tuple[zmq.Socket, str, ThreadAuthenticator]:
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=provider)
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    router.handshake_ivl = 300
    router.curve_server, router.curve_publickey, router.curve_secretkey = True, *ENGINE
    port = router.bind_to_random_port("tcp://127.0.0.1")
    return router, f"tcp://127.0.0.1:{port}", auth


def worker(ctx: zmq.Context, address: str, keys: tuple[bytes, bytes]) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.curve_serverkey = ENGINE[0]
    sock.curve_publickey, sock.curve_secretkey = keys
    sock.connect(address)
    return sock


def run_until(loop: asyncio.AbstractEventLoop, done: Callable[[], bool], seconds: float) -> None:
    async def wait() -> None:
        end = time.monotonic() + seconds
        while not done() and time.monotonic() < end:
            await asyncio.sleep(0.02)

    loop.run_until_complete(wait())


def test_a_handshake_cut_short_by_a_slow_zap_answer_is_no_engine_lost(ctx) -> None:
    provider = SlowOnce(pause_s=1.0)
    router, address, auth = engine(ctx, provider)
    sock = worker(ctx, address, WORKER)
    loop = asyncio.new_event_loop()
    lost: list[str] = []
    watch = EngineWatch(sock, loop, lost.append, None)
    try:
        sock.send(b"hello")
        run_until(loop, lambda: bool(lost) or router.poll(0), 10.0)
        assert lost == [] and router.poll(0), "the handshake was not tried again"
        assert router.recv_multipart()[1] == b"hello" and provider.calls >= 2
        router.close()  # the engine goes, after a handshake: that is the end
        run_until(loop, lambda: bool(lost), 10.0)
        assert lost == ["the connection to the engine dropped"]
    finally:
        watch.close()
        loop.close()
        auth.stop()


def test_an_engine_that_refuses_the_workers_keys_ends_the_watch_at_once(ctx) -> None:
    router, address, auth = engine(ctx, SlowOnce(pause_s=0.0))
    sock = worker(ctx, address, zmq.curve_keypair())
    loop = asyncio.new_event_loop()
    lost: list[str] = []
    watch = EngineWatch(sock, loop, lost.append, None)
    try:
        run_until(loop, lambda: bool(lost), 10.0)
        assert lost == ["the engine refused this worker's CURVE keys"]
        assert not router.poll(0)
    finally:
        watch.close()
        loop.close()
        auth.stop()
