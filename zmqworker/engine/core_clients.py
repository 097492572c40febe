"""The engine core's clients: who said hello (with the token it was started with), which
requests each one owns, and which ones are gone.

A client's connection drops when its process dies or closes its socket, and when it goes
silent for the ROUTER's heartbeat timeout; the ROUTER's monitor says that some peer
disconnected, not which. So for PROBE_WINDOW_S after that the engine core Pings every
client: one the ROUTER can no longer reach (ROUTER_MANDATORY) is gone, and its requests
are aborted.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from messages import PROTOCOL_VERSION, Encoder, EngineCoreFailure, EngineCoreHello, Ping
from zmqworker.transport.frames import send_frames

PROBE_WINDOW_S = 1.0
PROBE_EVERY_S = 0.05
MIN_HELD = 64  # held prefills kept before the first prune


@dataclass
class Client:
    identity: bytes
    pid: int
    index: int
    request_ids: set[str] = field(default_factory=set)
    told_load: int = 0  # the engine core's load as this client last heard it (load_reports.py)
    next_report_at: float = 0.0  # its next stats-only report is not sent before
    heard_at: float = field(default_factory=time.monotonic)  # its last message came then

    def __str__(self) -> str:
        return f"client {self.index} (pid {self.pid})"


class Clients:
    """Clients by ROUTER identity, and the owner of every request in the engine core."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()
        self.by_identity: dict[bytes, Client] = {}
        self.owners: dict[str, Client] = {}  # request id -> its client
        # Finished prefills whose KV waits for a decode instance, by request id: their
        # client may still abort them, which withdraws the KV.
        self.held: dict[str, Client] = {}
        self._held_after_prune = MIN_HELD
        self._ping = Encoder().encode(Ping())
        self._probe_until = 0.0
        self._next_probe = 0.0

    def admit(self, identity: bytes, hello: EngineCoreHello) -> Client | None:
        """The new client a Hello makes, or None if it may not be one (the wrong token or
        protocol version, or a second Hello)."""
        ok = (
            hmac.compare_digest(hello.token.encode(), self._token)
            and hello.protocol_version == PROTOCOL_VERSION
            and identity not in self.by_identity
        )
        if not ok:
            return None
        client = Client(identity, hello.pid, hello.client_index)
        self.by_identity[identity] = client
        return client

    @staticmethod
    def version_refusal(engine_index: int, version: int) -> EngineCoreFailure:
        """What a peer of another release is told (in this version, which it cannot
        decode: its decoder names both versions) in place of an answer. Every peer at
        the socket passed its own check: CURVE on tcp, the 0700 folder on ipc."""
        text = (
            f"engine core {engine_index} speaks protocol version {PROTOCOL_VERSION}, not {version}"
        )
        return EngineCoreFailure(engine_index, [], "ProtocolError", text, fatal=True)

    def heard_from(self, identity: bytes) -> Client | None:
        """The client of identity, if it said hello, marked as heard from now."""
        client = self.by_identity.get(identity)
        if client is not None:
            client.heard_at = time.monotonic()
        return client

    def add_request(self, client: Client, request_id: str) -> None:
        client.request_ids.add(request_id)
        self.owners[request_id] = client

    def finished(self, request_id: str, kv_held: bool) -> None:
        """A request that finished; with kv_held, a prefill whose KV waits for a decode
        instance: its client may still abort it (abort)."""
        client = self.forget_request(request_id)
        if kv_held and client is not None:
            self.held[request_id] = client

    def abort(self, client: Client, request_ids: list[str]) -> list[str]:
        """Of request_ids, those client may abort, each forgotten now: its running
        requests, and its finished prefills whose KV may still wait for a decode instance.
        Other ids are none of its own, and go unheeded."""
        running = [r for r in request_ids if self.owners.get(r) is client]
        held = [r for r in request_ids if self.held.get(r) is client]
        for request_id in running:
            self.forget_request(request_id)
        for request_id in held:
            del self.held[request_id]
        return running + held

    def forget_request(self, request_id: str) -> Client | None:
        """Drop a request that finished or was aborted; its client, if it had one."""
        client = self.owners.pop(request_id, None)
        if client is not None:
            client.request_ids.discard(request_id)
        return client

    def prune_held(self, still_held: Callable[[str], bool]) -> None:
        """Drop the finished prefills whose KV is no longer held (still_held), whenever
        their number has doubled since the last prune: O(1) a step on average."""
        if len(self.held) > 2 * self._held_after_prune:
            self.held = {r: c for r, c in self.held.items() if still_held(r)}
            self._held_after_prune = max(len(self.held), MIN_HELD)

    def remove(self, client: Client) -> list[str]:
        """Forget a client that is gone; the ids of the requests it still had."""
        self.by_identity.pop(client.identity, None)
        self.held = {r: c for r, c in self.held.items() if c is not client}
        for request_id in client.request_ids:
            self.owners.pop(request_id, None)
        orphans, client.request_ids = sorted(client.request_ids), set()
        return orphans

    def on_disconnect(self, now: float) -> None:
        """Some peer's connection dropped: probe every client for a while."""
        self._probe_until = now + PROBE_WINDOW_S
        self._next_probe = now

    def next_probe_in(self, now: float) -> float | None:
        """Seconds until the next probe is due; None when none is."""
        if now >= self._probe_until:
            return None
        return max(0.0, self._next_probe - now)

    def probe(self, sock: zmq.Socket, now: float) -> list[Client]:
        """Ping every client if a probe is due; those the ROUTER cannot reach."""
        if now >= self._probe_until or now < self._next_probe:
            return []
        self._next_probe = now + PROBE_EVERY_S
        gone = []
        for client in list(self.by_identity.values()):
            try:
                send_frames(sock, (client.identity, *self._ping), zmq.NOBLOCK)
            except zmq.Again:  # its queue is full: connected, at least
                continue
            except zmq.ZMQError:  # EHOSTUNREACH (ROUTER_MANDATORY): no connection
                gone.append(client)
        return gone
