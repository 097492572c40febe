"""An EngineCore driven by a thread of its own, for a router in front of several: calls
come in as functions run between its steps, and what each step changed goes out as
snapshots (the requests themselves stay the loop's). A step that fails has aborted every
request of the core (EngineCore's recovery); on_failure says so, naming the error."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from messages import LogprobsLists, RemoteKV
from zmqworker.engine.core import EngineCore
from zmqworker.engine.request import Request

log = logging.getLogger(__name__)
IDLE_WAIT_S = 0.05  # an idle loop's wait for a call (a call wakes it at once)


@dataclass(frozen=True)
class Snapshot:
    """A request as a step left it, for another thread."""

    req_id: str
    output_token_ids: tuple[int, ...]
    finish_reason: str | None
    error: str | None
    kv_transfer_out: RemoteKV | None
    # The logprobs rows of its new tokens, and its prompt logprobs with its first token.
    logprobs: tuple[LogprobsLists | None, LogprobsLists | None]

    @classmethod
    def of(cls, request: Request) -> Snapshot:
        """request after a step, its new logprobs taken (the loop's thread)."""
        reason = request.finish_reason.value if request.finish_reason is not None else None
        return cls(
            request.req_id,
            tuple(request.output_token_ids),
            reason,
            request.error,
            request.kv_transfer_out,
            request.take_routed_logprobs(),
        )


class CoreLoop:
    def __init__(
        self,
        core: EngineCore,
        name: str,
        on_step: Callable[[list[Snapshot]], None],
        on_failure: Callable[[BaseException], None],
    ) -> None:
        """on_step and on_failure are called on the loop's thread; a call given to call()
        must not raise (it reports its own errors)."""
        self.core = core
        self._on_step = on_step
        self._on_failure = on_failure
        self._calls: queue.SimpleQueue[Callable[[EngineCore], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"core-loop-{name}", daemon=True)
        self._thread.start()

    def call(self, fn: Callable[[EngineCore], None]) -> None:
        """Run fn(core) on the loop's thread, between steps."""
        self._calls.put(fn)

    def stop(self) -> None:
        self._calls.put(None)
        self._thread.join(timeout=30.0)

    def _run(self) -> None:
        core = self.core
        while True:
            wait = not core.has_work()
            try:
                while True:
                    fn = self._calls.get(timeout=IDLE_WAIT_S) if wait else self._calls.get_nowait()
                    if fn is None:
                        return
                    fn(core)
                    wait = False
            except queue.Empty:
                pass
            if not core.has_work():
                continue
            try:
                changed = core.step()
            except Exception as e:
                log.warning("a step failed: %s", e)
                self._on_failure(e)
                continue
            if changed:
                self._on_step([Snapshot.of(r) for r in changed])
