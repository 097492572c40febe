"""The puller's sockets, owned by its thread: a CURVE DEALER (the deployment's KV keys)
for each connection to each prefill address, the first for every message but the parts
of a split pull (tcp_parts.py), all in one context whose TCP_STREAMS I/O threads run the
connections' CURVE side by side, each registered in the puller's poller."""

from __future__ import annotations

from collections.abc import Iterator

import zmq

from messages.kv_peer import KVPeerMessage
from zmqworker.kv_transfer import wire
from zmqworker.kv_transfer.tcp_parts import TCP_STREAMS
from zmqworker.transport.curve import KVKeys
from zmqworker.transport.frames import send_frames


class PeerSockets:
    def __init__(self, keys: KVKeys | None, poller: zmq.Poller) -> None:
        self._keys = keys
        self._ctx = zmq.Context(io_threads=TCP_STREAMS)
        self._socks: dict[tuple[str, int], zmq.Socket] = {}  # by (address, connection)
        self._poller = poller

    def send(self, address: str, msg: KVPeerMessage, connection: int = 0) -> None:
        """msg to address over that connection (made on first use)."""
        sock = self._socks.get((address, connection))
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.linger = 0
            if self._keys is not None:
                self._keys.make_client(sock)
            sock.connect(address)
            self._poller.register(sock, zmq.POLLIN)
            self._socks[(address, connection)] = sock
        send_frames(sock, [wire.encode(msg)])

    def readable(self, events: dict) -> Iterator[tuple[str, zmq.Socket]]:
        """(address, socket) of each socket the poll's events say has messages."""
        for (address, _), sock in list(self._socks.items()):  # the caller may send
            if events.get(sock):
                yield address, sock

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close(linger=0)
        self._ctx.term()
