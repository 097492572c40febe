"""A client's connection to one engine core (a data-parallel replica): its DEALER and
the monitor that sees the connection drop, the handle that sees the engine core end,
what the engine core said (Ready, its load), the requests it runs for this client, and
what the client hands on from it (events)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

from messages import EngineCoreOutputs, EngineCoreReady, EngineCoreStats
from zmqworker.frontend.core_process import EngineCoreHandle
from zmqworker.transport import curve
from zmqworker.transport.curve import CORE_CURVE_ENV, connect_core_securely

# A first CURVE handshake that fails (refused, or cut short at once: what another key
# pair looks like from here) tells a client of an engine core served on its own that it
# is not this client's to reach. One cut short only after half the server's handshake
# interval was the engine core's ZAP thread slow to answer: libzmq tries again, and
# REACH_TIMEOUT_S bounds the wait. Engine cores a client started are on ipc: no handshake.
HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
LOST_GRACE_S = 0.3  # a dropped connection whose process has not died by then: stuck
# An engine core served on its own that no handshake reached by then is not there (one
# this client started is watched through its process instead).
REACH_TIMEOUT_S = 30.0
PING_EVERY_S = 1.0
ENGINE_SILENT_S = 5.0  # an engine core silent this long (stopped, wedged) is gone


@dataclass
class Failed:
    """Requests that failed (error is what their callers raise); fatal: the engine core
    is gone, or stops."""

    engine_index: int
    request_ids: list[str]
    error: Exception
    fatal: bool


Event = EngineCoreOutputs | Failed


class EngineConnection:
    def __init__(
        self,
        index: int,
        handle: EngineCoreHandle,
        ctx: zmq.Context,
        address: str,
        max_output_bytes: int,
    ) -> None:
        self.index = index
        self.handle = handle
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)  # a request is never held back here
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, max_output_bytes)
        # ZMTP heartbeats of its own: the connection drops once the engine core has left
        # a ping unanswered for ENGINE_SILENT_S (libzmq's I/O thread answers them, so only
        # a stopped or wedged process goes silent). The engine core's TTL is no help here:
        # libzmq arms it only while the last message in was a ping, not a step's outputs.
        sock.setsockopt(zmq.HEARTBEAT_IVL, round(PING_EVERY_S * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, round(ENGINE_SILENT_S * 1000))
        self.sock = sock
        monitor = None
        try:
            connect_core_securely(sock, address)
            monitor = sock.get_monitor_socket(
                zmq.EVENT_CONNECTED
                | zmq.EVENT_DISCONNECTED
                | zmq.EVENT_HANDSHAKE_SUCCEEDED
                | HANDSHAKE_FAILED
            )
            sock.connect(address)
        except BaseException:
            if monitor is not None:  # else the context's term() would wait for it
                sock.disable_monitor()
                monitor.close(linger=0)
            sock.close(linger=0)
            raise
        self.monitor = monitor
        self.ready: EngineCoreReady | None = None
        self.dead: Exception | None = None
        self.requests: set[str] = set()
        self.reported_load = 0  # running and waiting, as the engine core last said
        self.sent_since_report = 0
        self.disconnected_at: float | None = None
        self.opened_at = time.monotonic()
        self.connected_at = self.opened_at  # the latest tcp connection's, for its handshake
        self.reached = False  # a handshake with the engine core succeeded
        self.stopping = False  # asked to shut down: its end is expected
        self.leaving = False  # it said it stops (a fatal failure): it ends on its own

    @property
    def load(self) -> int:
        """What balancing goes by: the engine core's requests as it last said, and this
        client's sent to it since."""
        return self.reported_load + self.sent_since_report

    def report(self, stats: EngineCoreStats) -> None:
        """The engine core's stats (with outputs, or alone). One it made before this
        client's latest requests came in leaves them out until the next one, which their
        first outputs, or the change in its load (load_reports.py), bring soon after."""
        self.reported_load = stats.num_running + stats.num_waiting
        self.sent_since_report = 0

    def aborted(self, count: int) -> None:
        """count of this client's requests there were aborted: out of its load now, not
        once the engine core's next report comes (load_reports.py)."""
        since = min(count, self.sent_since_report)
        self.sent_since_report -= since
        self.reported_load = max(0, self.reported_load - (count - since))

    def watch(self, now: float) -> str | None:
        """Take in what the monitor saw (a handshake done, the connection dropped: then
        disconnected_at is now); why the engine core refused this client, if it did."""
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            if event == zmq.EVENT_CONNECTED:
                self.connected_at = now
            slow = event != zmq.EVENT_HANDSHAKE_FAILED_AUTH and (
                now - self.connected_at >= curve.HANDSHAKE_S / 2
            )
            if event & HANDSHAKE_FAILED and not (self.reached or self.handle.owned or slow):
                return (
                    f"{self.handle.label} refused this client: the CURVE handshake failed "
                    f"(${CORE_CURVE_ENV} must hold the engine core's key pair)"
                )
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.reached = True
            elif event == zmq.EVENT_DISCONNECTED and self.disconnected_at is None:
                self.disconnected_at = now
        return None

    def why_gone(self, now: float) -> str | None:
        """Why the engine core counts as gone from its connection alone (None: it does
        not): dropped, and its process not dead LOST_GRACE_S later; or served on its own
        and never reached."""
        if self.disconnected_at is not None and now - self.disconnected_at >= LOST_GRACE_S:
            return f"{self.handle.label} stopped answering: its connection dropped"
        if not (self.reached or self.handle.owned) and now - self.opened_at >= REACH_TIMEOUT_S:
            return f"{self.handle.label}: nothing answered within {REACH_TIMEOUT_S:g} s"
        return None

    def fds(self) -> list[int]:
        """What an event loop watches for it: its socket, its monitor, its end."""
        return [self.sock.getsockopt(zmq.FD), self.monitor.getsockopt(zmq.FD), self.handle.death_fd]

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)
        if not self.handle.owned:  # an engine core served on its own: the handle is ours
            self.handle.close()


def open_connections(
    ctx: zmq.Context,
    addresses: Sequence[str],
    handles: Sequence[EngineCoreHandle],
    max_output_bytes: int,
) -> list[EngineConnection]:
    """A connection to each engine core; on a failure none is left open, nor the context."""
    engines: list[EngineConnection] = []
    try:
        for index, (address, handle) in enumerate(zip(addresses, handles, strict=True)):
            engines.append(EngineConnection(index, handle, ctx, address, max_output_bytes))
    except BaseException:
        for engine in engines:
            engine.close()
        ctx.term()
        raise
    return engines
