"""A client's orderly end of its engine cores: the shutdown utility call to each one that
is up, bounded; those that answer leave on their own, and so do those that said they stop
(a fatal failure: they stop their workers first, and a SIGTERM now would leave those
workers' sockets behind); the others are left to be stopped harder
(EngineCoreLauncher.stop)."""

from __future__ import annotations

import logging

from zmqworker.frontend.core_client import EngineCoreClient

log = logging.getLogger("zmqworker.frontend")

SHUTDOWN_CALL_S = 30.0  # the shutdown call's answer: the steps in flight come back first


def shut_down_engines(client: EngineCoreClient, timeout: float = SHUTDOWN_CALL_S) -> set[int]:
    """Ask every engine core of client that is up to shut down (its workers first),
    within timeout; the indexes of those leaving on their own: those that answered, and
    those that said they stop."""
    calls = {}
    for engine in client.engines:
        if engine.handle.owned and engine.ready is not None and engine.dead is None:
            engine.stopping = True
            calls[engine.index] = client.submit("shutdown", timeout=timeout, engines=[engine.index])
    answered = {engine.index for engine in client.engines if engine.leaving}
    for index, call in calls.items():
        try:
            client.wait(call)
            answered.add(index)
        except Exception as exc:
            log.warning("engine core %d did not answer its shutdown call: %s", index, exc)
    return answered
