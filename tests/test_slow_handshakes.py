"""Handshakes that a server cuts short because its ZAP thread was slow to answer, over
real CURVE sockets: libzmq tries again, and neither a worker's watch on its engine
(runtime/engine_watch.py) nor a client's connection to an engine core served on its own
(frontend/engine_connection.py) takes that for the end or for a refusal; keys the server
refuses, or another key pair, still end both at once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import pytest
import zmq
from zmq.auth.thread import ThreadAuthenticator

from zmqworker.frontend.engine_connection import EngineConnection
from zmqworker.runtime.engine_watch import EngineWatch
from zmqworker.transport import curve
from zmqworker.transport.curve import CoreKeys

ENGINE = zmq.curve_keypair()
WORKER = zmq.curve_keypair()


class SlowOnce:
    """A ZAP credentials check that admits one public key (WORKER's unless told), after a
    pause on its first call longer than the server's handshake interval."""

    def __init__(self, pause_s: float, admits: bytes = WORKER[0]) -> None:
        self.pause_s = pause_s
        self.admits = admits
        self.calls = 0

    def callback(self, domain: str, client_key: bytes) -> bool:
        self.calls += 1
        if self.calls == 1:
            time.sleep(self.pause_s)
        return client_key == self.admits


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def engine(
    ctx: zmq.Context, provider: SlowOnce, keys: tuple[bytes, bytes] = ENGINE
) -> tuple[zmq.Socket, str, ThreadAuthenticator]:
    """A CURVE ROUTER of keys that cuts a handshake off after 0.3 s."""
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=provider)
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    router.handshake_ivl = 300
    router.curve_server, router.curve_publickey, router.curve_secretkey = True, *keys
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


class Served:
    """What a connection reads of an engine core served on its own."""

    label = "engine core 0"
    owned = False
    death_fd = None

    def close(self) -> None:
        pass


@pytest.mark.parametrize("same_pair", [True, False])
def test_a_client_takes_only_a_quick_failure_for_a_refusal(ctx, monkeypatch, same_pair) -> None:
    """The engine core's handshake interval, 0.3 s here: a first handshake cut off at the
    interval (the ZAP answer paused 1 s) is tried again until it succeeds; another key
    pair fails at once, and is refused by name."""
    monkeypatch.setattr(curve, "HANDSHAKE_S", 0.3)
    pair = CoreKeys.new()
    monkeypatch.setenv(CoreKeys.ENV, pair.to_env())
    provider = SlowOnce(pause_s=1.0, admits=pair.public)
    served = pair if same_pair else CoreKeys.new()
    router, address, auth = engine(ctx, provider, (served.public, served.secret))
    conn = EngineConnection(0, Served(), ctx, address, 1 << 20)
    try:
        refused, end = None, time.monotonic() + 10
        while refused is None and not conn.reached and time.monotonic() < end:
            refused = conn.watch(time.monotonic())
            time.sleep(0.02)
        if same_pair:
            assert refused is None and conn.reached and provider.calls >= 2
        else:
            assert refused is not None and "engine core 0 refused this client" in refused
            assert provider.calls == 0
    finally:
        conn.close()
        auth.stop()
