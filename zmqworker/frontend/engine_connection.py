"""A client's connection to one engine core (a data-parallel replica): its DEALER and
the monitor that sees the connection drop, the handle that sees the engine core end,
what the engine core said (Ready, its load), the requests it runs for this client, and
what the client hands on from it (events)."""

from __future__ import annotations

from dataclasses import dataclass

import zmq

from messages import EngineCoreOutputs, EngineCoreReady, EngineCoreStats
from zmqworker.frontend.core_process import EngineCoreHandle

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
        self.monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(address)
        self.ready: EngineCoreReady | None = None
        self.dead: Exception | None = None
        self.requests: set[str] = set()
        self.reported_load = 0  # running and waiting, as the engine core last said
        self.sent_since_report = 0
        self.disconnected_at: float | None = None
        self.stopping = False  # asked to shut down: its end is expected

    @property
    def load(self) -> int:
        """What balancing goes by: the engine core's requests as it last said, and this
        client's sent to it since."""
        return self.reported_load + self.sent_since_report

    def report(self, stats: EngineCoreStats) -> None:
        self.reported_load = stats.num_running + stats.num_waiting
        self.sent_since_report = 0

    def fds(self) -> list[int]:
        """What an event loop watches for it: its socket, its monitor, its end."""
        return [self.sock.getsockopt(zmq.FD), self.monitor.getsockopt(zmq.FD), self.handle.death_fd]

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)
