"""The protocol version. Any change to a message schema or to the frame layout bumps it."""

PROTOCOL_VERSION = 23
