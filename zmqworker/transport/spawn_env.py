"""What an engine hands a worker it spawns through the environment, not the command
line (which every local user can read in ps)."""

TOKEN_ENV = "ZMQWORKER_TOKEN"  # the handshake token of the worker's Hello
# The largest frame a worker's sockets take in, and its replies may have (the engine's
# socket's): "request,pipeline[,reply]" in bytes (message_bounds).
MAX_MESSAGE_ENV = "ZMQWORKER_MAX_MESSAGE_BYTES"
# "1": ranks may share GPUs when there are more ranks on a host than GPUs visible (tests
# of multi-GPU layouts on one GPU); otherwise a rank without a GPU of its own is an error.
SHARE_GPUS_ENV = "ZMQWORKER_SHARE_GPUS"
# Seconds a worker waits for its Welcome after its Hello: its engine's start-up bound and
# a margin, so that the engine's wait for every Hello ends first and names the rank(s)
# it did not hear from; "inf": no bound. Unset: HANDSHAKE_TIMEOUT_S.
WELCOME_TIMEOUT_ENV = "ZMQWORKER_WELCOME_TIMEOUT_S"
HANDSHAKE_TIMEOUT_S = 60.0
# Seconds after which a worker drops an engine that answers none of its ZMTP pings, and
# leaves (the engine's stuck bound): the engine's own heartbeats tell it the bound only
# from the first, one interval after it connects. Unset: the worker pings not.
ENGINE_SILENT_ENV = "ZMQWORKER_ENGINE_SILENT_S"


def message_bounds(value: str) -> tuple[int, int, int]:
    """(request, pipeline, reply) frame bounds from "REQUEST,PIPELINE[,REPLY]" bytes; -1:
    none (all three when unset, the reply's when left out)."""
    if not value:
        return -1, -1, -1
    parts = value.split(",")
    if len(parts) not in (2, 3) or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(
            f"${MAX_MESSAGE_ENV} must be two or three byte counts, REQUEST,PIPELINE[,REPLY]"
        )
    reply = int(parts[2]) if len(parts) == 3 else -1
    return int(parts[0]), int(parts[1]), reply
