"""CURVE for a run's tcp sockets: the keys an engine makes per run, how each socket
takes them, and the ZAP handler that admits only the run's own workers.

A run has two key pairs: the engine's (its ROUTER is the CURVE server) and the workers'
(every rank's DEALER and pipeline PUSH are clients with it; every pipeline PULL is a
server with it). A rank gets the engine's public key and the workers' pair with its
spawn (the environment, or a Ray call; never the command line or a file), and each
process that serves (the engine, every worker) runs a ZAP handler (pyzmq's zmq.auth)
that admits the workers' public key alone. ipc sockets live in the engine's 0700 folder
and skip CURVE.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass
from typing import ClassVar, Self

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

CURVE_ENV = "ZMQWORKER_CURVE"  # "engine public,worker public,worker secret" (z85)
# A tcp peer that has not finished its handshake by then is cut off: libzmq's default
# (30 s) let a peer without keys hold a descriptor that long by connecting and saying
# nothing. A peer with keys finishes in milliseconds; a ZAP thread kept from answering
# for longer fails that handshake: libzmq tries again, and a worker and a remote
# frontend wait for it (runtime/engine_watch.py, frontend/engine_connection.py).
HANDSHAKE_S = 5.0


@dataclass(frozen=True)
class WorkerKeys:
    """What a rank holds: the engine's public key and the workers' key pair (z85)."""

    engine_public: bytes
    public: bytes
    secret: bytes

    def to_env(self) -> str:
        return b",".join((self.engine_public, self.public, self.secret)).decode()

    @classmethod
    def from_env(cls) -> WorkerKeys | None:
        """This process's keys from its environment (None: the run skips CURVE)."""
        value = os.environ.get(CURVE_ENV, "")
        return cls.parse(value) if value else None

    @classmethod
    def parse(cls, value: str) -> WorkerKeys:
        """The keys of to_env's value; an error names a malformed one."""
        parts = value.encode().split(b",")
        if len(parts) != 3 or any(len(p) != 40 for p in parts):
            raise ValueError(
                f"${CURVE_ENV} must hold three z85 keys of 40 characters, comma-separated"
            )
        _check_pair(CURVE_ENV, parts[1], parts[2])
        try:
            z85.decode(parts[0])
        except Exception:  # KeyError, struct.error: characters z85 has no value for
            raise ValueError(f"${CURVE_ENV}: the engine's public key is not z85") from None
        return cls(*parts)


@dataclass(frozen=True)
class RunKeys:
    """The engine's side: both key pairs of a run."""

    engine_public: bytes
    engine_secret: bytes
    worker_public: bytes
    worker_secret: bytes

    @classmethod
    def new(cls) -> RunKeys:
        engine = zmq.curve_keypair()
        worker = zmq.curve_keypair()
        return cls(engine[0], engine[1], worker[0], worker[1])

    def for_workers(self) -> WorkerKeys:
        return WorkerKeys(self.engine_public, self.worker_public, self.worker_secret)


def _check_pair(env: str, public: bytes, secret: bytes) -> None:
    """Here, not at a setsockopt (a bare "Invalid argument") or a handshake that fails
    unexplained: the keys in $env must be a z85 pair, the public key the secret's."""
    try:
        derived = zmq.curve_public(secret)
    except zmq.ZMQError:
        raise ValueError(f"${env}: the secret key is not z85") from None
    if not hmac.compare_digest(derived, public):
        raise ValueError(f"${env}: the public key is not the secret key's")


def make_server(sock: zmq.Socket, public: bytes, secret: bytes) -> None:
    """Before bind: sock is a CURVE server with this key pair, which cuts off a peer whose
    handshake has not ended within HANDSHAKE_S."""
    sock.handshake_ivl = round(HANDSHAKE_S * 1000)
    sock.curve_server = True
    sock.curve_publickey = public
    sock.curve_secretkey = secret


def make_client(sock: zmq.Socket, keys: WorkerKeys, server_public: bytes) -> None:
    """Before connect: sock is a CURVE client of the server with server_public."""
    sock.curve_serverkey = server_public
    sock.curve_publickey = keys.public
    sock.curve_secretkey = keys.secret


class _AdmitOnly:
    def __init__(self, public: bytes) -> None:
        self._public = public

    def callback(self, domain: str, client_key: bytes) -> bool:
        return hmac.compare_digest(client_key, self._public)


def start_zap(ctx: zmq.Context, worker_public: bytes) -> ThreadAuthenticator:
    """The context's ZAP handler (a thread): CURVE peers with worker_public are admitted,
    every other is refused at its handshake. stop() it before the context ends."""
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=_AdmitOnly(worker_public))
    return auth


KV_CURVE_ENV = "ZMQWORKER_KV_CURVE"  # "public,secret" (z85): the KV transfer peers' pair
CORE_CURVE_ENV = "ZMQWORKER_CORE_CURVE"  # "public,secret" (z85): remote engine cores' pair


@dataclass(frozen=True)
class SharedKeys:
    """A deployment's key pair that a server and its clients all hold: the server is a
    CURVE server with it, each client connects with it, and the server's ZAP handler
    admits its public key alone. Made by whoever deploys both sides and handed to them
    through the environment (ENV), never the command line or a file."""

    public: bytes
    secret: bytes
    ENV: ClassVar[str]

    @classmethod
    def new(cls) -> Self:
        return cls(*zmq.curve_keypair())

    def to_env(self) -> str:
        return b",".join((self.public, self.secret)).decode()

    @classmethod
    def from_env(cls) -> Self | None:
        value = os.environ.get(cls.ENV, "")
        if not value:
            return None
        parts = value.encode().split(b",")
        if len(parts) != 2 or any(len(p) != 40 for p in parts):
            raise ValueError(f"${cls.ENV} must hold two z85 keys of 40 characters, comma-separated")
        _check_pair(cls.ENV, *parts)
        return cls(*parts)

    def make_client(self, sock: zmq.Socket) -> None:
        """Before connect: sock is a CURVE client of a server with this pair."""
        sock.curve_serverkey = self.public
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret


class KVKeys(SharedKeys):
    """The KV transfer sockets' pair: the prefill instance's servers hold it, the decode
    instance's pullers connect with it."""

    ENV = KV_CURVE_ENV


class CoreKeys(SharedKeys):
    """The pair of engine cores served on tcp (`zmqworker engine-core`) and of the
    clients that connect to them (an LLM, `zmqworker serve`)."""

    ENV = CORE_CURVE_ENV

    @property
    def token(self) -> str:
        """The Hello token that goes with the pair (a client that holds it knows it)."""
        return hashlib.sha256(b"zmqworker engine core token:" + self.secret).hexdigest()


def serve_core_securely(
    sock: zmq.Socket, ctx: zmq.Context, address: str
) -> ThreadAuthenticator | None:
    """Before bind: an engine core's ROUTER on tcp is a CURVE server with the pair in
    $ZMQWORKER_CORE_CURVE and admits its holders alone (the ZAP handler returned: stop it
    before the context ends); on ipc (a 0700 folder) it stays as it is (None)."""
    if not address.startswith("tcp://"):
        return None
    keys = CoreKeys.from_env()
    if keys is None:
        raise ValueError(
            f"an engine core on {address} needs ${CORE_CURVE_ENV} (the deployment's key pair: "
            "zmqworker keys makes one): tcp is never served without CURVE"
        )
    make_server(sock, keys.public, keys.secret)
    return start_zap(ctx, keys.public)


def connect_core_securely(sock: zmq.Socket, address: str) -> None:
    """Before connect: a client's DEALER to an engine core on tcp is a CURVE client with
    the pair in $ZMQWORKER_CORE_CURVE."""
    if not address.startswith("tcp://"):
        return
    keys = CoreKeys.from_env()
    if keys is None:
        raise ValueError(f"connecting to the engine core at {address} needs ${CORE_CURVE_ENV}")
    keys.make_client(sock)
