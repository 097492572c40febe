"""The errors a client sees from its engine cores."""

from __future__ import annotations


class EngineCoreError(RuntimeError):
    """An engine core failed a request, or all of them: exc_type and message are what it
    reported (a worker's death, a step's error, a request it refused)."""

    def __init__(self, engine_index: int, exc_type: str, message: str) -> None:
        self.engine_index = engine_index
        self.exc_type = exc_type
        self.remote_message = message
        super().__init__(f"engine core {engine_index}: {exc_type}: {message}")


class EngineCoreDiedError(RuntimeError):
    """An engine core process is gone (or its thread, or its connection): what is known
    of how, and the last lines of its stderr."""

    def __init__(self, engine_index: int, how: str) -> None:
        self.engine_index = engine_index
        super().__init__(f"engine core {engine_index} {how}")


class EngineCoreStartupError(RuntimeError):
    """An engine core did not start: its error, or how it died and its last words."""


# Refusals a caller can act on (a bad argument, a call out of order), raised again here as
# the builtin error they were, as the executor raises a worker's (executor/errors.py).
LOCAL_KINDS: dict[str, type[Exception]] = {
    "ValueError": ValueError,
    "RuntimeError": RuntimeError,
    "TypeError": TypeError,
    "FileNotFoundError": FileNotFoundError,
}


def utility_error(engine_index: int, exc_type: str, message: str) -> Exception:
    """The error a caller gets for a utility call that failed on an engine core."""
    kind = LOCAL_KINDS.get(exc_type)
    if kind is None:
        return EngineCoreError(engine_index, exc_type, message)
    return kind(f"engine core {engine_index}: {message}")
