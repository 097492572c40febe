"""The client's side of its engine cores' sockets: one DEALER per engine core (a replica
each), the handshake, requests placed by prefix and load (prefix_affinity.py; otherwise by
a subclass's _route: disaggregated_client.py), aborts to the replica that runs the
request, utility calls matched by call id, and the engine cores' ends.

What comes in is read without blocking (drain) as events (a step's outputs, requests that
failed), for a caller that blocks (receive) or an asyncio loop that watches the sockets
(attach). An engine core is gone when its death fd fires (its process exited), or when its
connection dropped (its heartbeats stopped) and it has not died LOST_GRACE_S later; every
request it held then fails at once, naming it. A message that does not decode fails all
that waits on its engine core (which goes on). Not thread-safe.
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import zmq

from messages import (
    PROTOCOL_VERSION,
    AbortRequests,
    Decoder,
    Encoder,
    EngineCoreFailure,
    EngineCoreHello,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequest,
    Ping,
    ProtocolError,
    UtilityResult,
)
from zmqworker.frontend.core_process import EngineCoreHandle
from zmqworker.frontend.engine_connection import (
    LOST_GRACE_S,
    EngineConnection,
    Event,
    Failed,
    open_connections,
)
from zmqworker.frontend.errors import EngineCoreDiedError, EngineCoreError
from zmqworker.frontend.prefix_affinity import PrefixAffinity, place
from zmqworker.frontend.utility_calls import PendingCall, UtilityCalls
from zmqworker.transport.drops import DropCounter
from zmqworker.transport.frames import NOBLOCK, recv_frames, send_frames

log = logging.getLogger("zmqworker.frontend")

POLL_SLICE_S = 1.0  # the longest a blocking receive sleeps before it looks around again
UTILITY_TIMEOUT_S = 60.0
_POLLIN = int(zmq.POLLIN)


class EngineCoreClient:
    def __init__(
        self,
        addresses: Sequence[str],
        handles: Sequence[EngineCoreHandle],
        token: str,
        client_index: int = 0,
        max_output_bytes: int = -1,
    ) -> None:
        self._ctx = zmq.Context()
        self._enc, self._dec = Encoder(), Decoder()
        self.drops = DropCounter(log, "messages from engine cores")
        self._poller = zmq.Poller()
        self._deaths = select.poll()
        self.engines = open_connections(self._ctx, addresses, handles, max_output_bytes)
        for engine in self.engines:
            for what in (engine.sock, engine.monitor, engine.handle.death_fd):
                self._poller.register(what, zmq.POLLIN)
            self._deaths.register(engine.handle.death_fd, select.POLLIN)
        self._owner: dict[str, EngineConnection] = {}  # request id -> the engine core running it
        self._affinity: PrefixAffinity | None = None  # once every engine core is ready
        self._calls = UtilityCalls()
        self._backlog: list[Event] = []  # received during a blocking utility call
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_events: Callable[[list[Event]], None] | None = None
        self._dispatch_due = False
        self._received = 0  # messages read, for a receive that waits for any
        hello = EngineCoreHello(PROTOCOL_VERSION, token, os.getpid(), client_index)
        for engine in self.engines:
            self._send(engine, hello)

    # start-up ---------------------------------------------------------------------------

    def wait_ready(self, timeout: float) -> list[EngineCoreReady]:
        """Every engine core's Ready; the first start-up failure's error, or TimeoutError."""
        end = time.monotonic() + timeout
        while any(e.ready is None for e in self.engines):
            for event in self.receive(min(POLL_SLICE_S, max(0.0, end - time.monotonic()))):
                if isinstance(event, Failed):
                    raise event.error
            if time.monotonic() >= end:
                missing = [e.index for e in self.engines if e.ready is None]
                raise TimeoutError(f"engine core(s) {missing} not ready within {timeout:.0f} s")
        self._affinity = PrefixAffinity.of({e.index: e.ready for e in self.engines})
        return [e.ready for e in self.engines if e.ready is not None]

    # requests ---------------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> int:
        """Send request where _route chooses, knowing first which engine cores are gone."""
        if self._poller.poll(0):  # news first: an engine core gone gets no new request
            self._collect(self._backlog)
            self._schedule_dispatch()  # an attached loop's
        return self._route(request)

    def _route(self, request: EngineCoreRequest) -> int:
        """To its prompt's sibling's engine core, or the live one that its prompt's
        prefix or the load choose (prefix_affinity.py); the engine core's index."""
        sibling = request.shares_prompt_with
        engine = self._owner.get(sibling) if sibling is not None else None
        if engine is None or engine.dead is not None:
            engine = place(request.prompt_token_ids, self.engines, self._affinity)
        return self._send_request(engine, request)

    def _send_request(self, engine: EngineConnection, request: EngineCoreRequest) -> int:
        self._send(engine, request)
        engine.requests.add(request.request_id)
        engine.sent_since_report += 1
        self._owner[request.request_id] = engine
        return engine.index

    def abort(self, request_ids: Iterable[str], reason: str = "abort") -> None:
        """Abort requests in the engine cores that run them (those still running)."""
        by_engine: dict[EngineConnection, list[str]] = {}
        for request_id in request_ids:
            engine = self._forget(request_id)
            if engine is not None and engine.dead is None:
                by_engine.setdefault(engine, []).append(request_id)
        for engine, ids in by_engine.items():
            self._send(engine, AbortRequests(ids, reason))  # type: ignore[arg-type]
            engine.aborted(len(ids))

    def engine_of(self, request_id: str) -> int | None:
        return None if (engine := self._owner.get(request_id)) is None else engine.index

    # events -----------------------------------------------------------------------------

    def receive(self, timeout: float) -> list[Event]:
        """The events there are, waiting up to timeout for an event or a call's answer."""
        end = time.monotonic() + timeout
        received = self._received
        while True:
            events = self.drain()
            left = end - time.monotonic()
            if events or left <= 0 or self._received != received:
                return events
            self._sleep(left)

    def drain(self) -> list[Event]:
        """The events there are, without waiting."""
        events, self._backlog = self._backlog, []
        self._collect(events)
        return events

    # utility calls ----------------------------------------------------------------------

    def call(
        self,
        method: str,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float = UTILITY_TIMEOUT_S,
        engines: Sequence[int] | None = None,
    ) -> list[Any]:
        """method on every engine core (or those of engines), blocking: wait()."""
        return self.wait(self.submit(method, args, kwargs, timeout, engines))

    def submit(
        self,
        method: str,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float = UTILITY_TIMEOUT_S,
        engines: Sequence[int] | None = None,
    ) -> PendingCall:
        """Send method to every engine core (or those of engines); wait() for it."""
        targets = self.engines if engines is None else [self.engines[i] for i in engines]
        if dead := next((e.dead for e in targets if e.dead is not None), None):
            raise dead.with_traceback(None)
        call, msg = self._calls.start(method, args, kwargs, [e.index for e in targets], timeout)
        for engine in targets:
            self._send(engine, msg)
        return call

    def wait(self, call: PendingCall) -> list[Any]:
        """Its results in engine order (or its error), blocking; events wait for a drain."""
        while True:
            received = self._received
            self._collect(self._backlog)  # expires the call at its deadline
            if call.done:
                break
            if self._received == received:
                self._sleep(call.deadline - time.monotonic())
        if self._backlog and self._loop is not None:
            self._schedule_dispatch()
        return call.outcome()

    async def call_async(
        self,
        method: str,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float = UTILITY_TIMEOUT_S,
        engines: Sequence[int] | None = None,
    ) -> list[Any]:
        """call(), awaited on the loop this client is attached to."""
        if self._loop is None:
            raise RuntimeError("call_async needs a client attached to the running loop")
        call = self.submit(method, args, kwargs, timeout, engines)
        call.future = self._loop.create_future()
        self._loop.call_later(call.deadline - time.monotonic(), self._schedule_dispatch)  # expiry
        return await call.future

    # an asyncio loop's view -------------------------------------------------------------

    def attach(
        self, loop: asyncio.AbstractEventLoop, on_events: Callable[[list[Event]], None]
    ) -> None:
        """Let loop watch the sockets: on_events is called on it with what comes."""
        if self._loop is loop:
            self._on_events = on_events
            return
        self.detach()
        self._loop, self._on_events = loop, on_events
        self._dispatch_due = False
        for engine in self.engines:
            if engine.dead is None:
                for fd in engine.fds():
                    loop.add_reader(fd, self._dispatch)
        self._schedule_dispatch()  # what came before the readers were there

    def detach(self) -> None:
        loop, self._loop = self._loop, None
        if loop is None or loop.is_closed():
            return
        for engine in self.engines:
            if engine.dead is None:
                for fd in engine.fds():
                    loop.remove_reader(fd)

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        return self._loop

    def close(self) -> None:
        self.detach()
        for engine in self.engines:
            engine.close()
        self._ctx.term()

    # internals --------------------------------------------------------------------------

    def _send(self, engine: EngineConnection, msg: Any) -> None:
        send_frames(engine.sock, self._enc.encode(msg), NOBLOCK)  # no HWM: never Again
        if self._loop is not None and engine.sock.getsockopt(zmq.EVENTS) & _POLLIN:
            # The send took in the news of a message, and with it the FD's edge.
            self._schedule_dispatch()

    def _schedule_dispatch(self) -> None:
        loop = self._loop
        if loop is not None and loop.is_closed():  # its asyncio.run() ended
            self.detach()
        elif loop is not None and not self._dispatch_due:
            self._dispatch_due = True
            loop.call_soon(self._dispatch)

    def _dispatch(self) -> None:
        self._dispatch_due = False
        events = self.drain() if self._loop is not None else []  # None: closed since
        if events and self._on_events is not None:
            self._on_events(events)

    def _collect(self, events: list[Event]) -> None:
        now = time.monotonic()
        for engine in self.engines:
            if engine.dead is None:
                self._read(engine, events)
                if (refused := engine.watch(now)) is not None:
                    self._lose(engine, EngineCoreDiedError(engine.index, refused), events)
                elif engine.disconnected_at == now and self._loop and not self._loop.is_closed():
                    self._loop.call_later(LOST_GRACE_S, self._schedule_dispatch)
        for fd, _ in self._deaths.poll(0):
            engine = next(e for e in self.engines if e.handle.death_fd == fd)
            if engine.dead is None:
                self._read(engine, events)  # what it sent before it went
            if engine.dead is None:
                ended = EngineCoreDiedError(engine.index, engine.handle.how_it_ended())
                self._lose(engine, ended, events)
        for engine in self.engines:
            gone = engine.why_gone(now) if engine.dead is None else None
            if gone is not None:
                self._lose(engine, EngineCoreDiedError(engine.index, gone), events)
        self._calls.expire(now)

    def _read(self, engine: EngineConnection, events: list[Event]) -> None:
        while True:
            try:
                msg = self._dec.decode(recv_frames(engine.sock))
            except zmq.Again:
                return
            except ProtocolError as exc:  # TooManyFrames too: refused, taken off whole
                self._received += 1
                self.drops.count(f"engine core {engine.index}: {exc}")
                self._on_malformed(engine, exc, events)
                continue
            self._received += 1
            if isinstance(msg, EngineCoreOutputs) and not msg.request_ids:
                engine.report(msg.stats)  # its load alone (load_reports.py): no event
            elif isinstance(msg, EngineCoreOutputs):
                self._on_outputs(engine, msg, events)
            elif isinstance(msg, EngineCoreFailure):
                self._on_failure(engine, msg, events)
            elif isinstance(msg, UtilityResult):
                self._calls.on_result(engine.index, msg)
            elif isinstance(msg, EngineCoreReady):
                engine.ready = msg
            elif not isinstance(msg, Ping):  # a Ping: the engine core checks we are here
                self.drops.count(f"engine core {engine.index}: an unexpected {type(msg).__name__}")
            if engine.dead is not None:
                return

    def _on_outputs(
        self, engine: EngineConnection, msg: EngineCoreOutputs, events: list[Event]
    ) -> None:
        engine.report(msg.stats)
        for finished in msg.finished:
            self._forget(msg.request_ids[finished.index])
        events.append(msg)

    def _on_failure(
        self, engine: EngineConnection, msg: EngineCoreFailure, events: list[Event]
    ) -> None:
        error = EngineCoreError(engine.index, msg.exc_type, msg.message)
        if msg.fatal:
            engine.leaving = True
            self._lose(engine, error, events)
            return
        ids = [i for i in msg.request_ids if self._forget(i) is not None]
        if ids:  # none: aborted meanwhile
            events.append(Failed(engine.index, ids, error, fatal=False))

    def _on_malformed(
        self, engine: EngineConnection, exc: ProtocolError, events: list[Event]
    ) -> None:
        """A message from the engine core did not decode, so its ids cannot be trusted:
        every request (aborted there) and call pending on it fails, naming it and what
        was wrong. The engine core goes on serving, unless it speaks another version."""
        if exc.version is not None:  # it runs another release
            lost = EngineCoreError(engine.index, "ProtocolError", f"{engine.handle.label}: {exc}")
            return self._lose(engine, lost, events)
        error = EngineCoreError(engine.index, "ProtocolError", f"a malformed message: {exc}")
        ids = sorted(engine.requests)
        if ids:
            self.abort(ids)
            events.append(Failed(engine.index, ids, error, fatal=False))
        self._calls.fail_engine(engine.index, error)

    def _lose(self, engine: EngineConnection, error: Exception, events: list[Event]) -> None:
        """The engine core is gone: every request and call it held fails with error."""
        log.log(logging.DEBUG if engine.stopping else logging.ERROR, "%s", error)
        engine.dead = error
        if self._loop is not None and not self._loop.is_closed():
            for fd in engine.fds():
                self._loop.remove_reader(fd)
        for what in (engine.sock, engine.monitor, engine.handle.death_fd):
            self._poller.unregister(what)
        self._deaths.unregister(engine.handle.death_fd)
        ids = sorted(engine.requests)
        for request_id in ids:
            self._forget(request_id)
        events.append(Failed(engine.index, ids, error, fatal=True))
        self._calls.fail_engine(engine.index, error)

    def _forget(self, request_id: str) -> EngineConnection | None:
        engine = self._owner.pop(request_id, None)
        if engine is not None:
            engine.requests.discard(request_id)
        return engine

    def _sleep(self, at_most: float) -> None:
        """Wait for the sockets, the deaths or the next thing due, at most at_most s."""
        self._poller.poll(max(1, round(min(at_most, self._next_wake()) * 1000)))

    def _next_wake(self) -> float:
        """Seconds until a call's deadline, or a dropped connection's grace, is due."""
        now = time.monotonic()
        due = [now + POLL_SLICE_S, self._calls.next_deadline() or now + POLL_SLICE_S]
        dropped = [e.disconnected_at for e in self.engines if e.dead is None]
        due += [at + LOST_GRACE_S for at in dropped if at is not None]
        return max(0.0, min(due) - now)
