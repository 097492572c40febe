"""The KV peers' messages on the wire: a msgpack [PROTOCOL_VERSION, message] body, and
for KVBlocks over tcp the staged bytes as the frame after it. Anything that arrives is
decoded into a declared type or refused."""

from __future__ import annotations

import msgspec

from messages.kv_peer import KVPeerMessage
from messages.version import PROTOCOL_VERSION


class _Envelope(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    version: int
    msg: KVPeerMessage


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(_Envelope)


class PeerProtocolError(ValueError):
    """A peer's message that is not one of ours, or of another protocol version."""


def encode(msg: KVPeerMessage) -> bytes:
    return _encoder.encode(_Envelope(PROTOCOL_VERSION, msg))


def decode(body: bytes | memoryview) -> KVPeerMessage:
    try:
        envelope = _decoder.decode(body)
    except msgspec.DecodeError as e:
        raise PeerProtocolError(f"not a KV peer message: {e}") from e
    if envelope.version != PROTOCOL_VERSION:
        raise PeerProtocolError(
            f"KV peer speaks protocol {envelope.version}, this side {PROTOCOL_VERSION}"
        )
    return envelope.msg
