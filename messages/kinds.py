"""Every kind of message that travels in the envelope: the worker protocol's and the
engine core's. One codec reads both; a socket drops (and counts) the kinds it does not
serve."""

from __future__ import annotations

from messages.engine_core import EngineCoreMessage
from messages.rpc import WorkerMessage

Message = WorkerMessage | EngineCoreMessage
