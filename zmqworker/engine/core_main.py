"""The engine core process: `python -m zmqworker.engine`, spawned by a client (an LLM, or
the main process of `zmqworker serve`).

Its stdin holds one message, its EngineCoreConfig (in the protocol's envelope), never its
command line (which every local user can read in ps; it holds only its spawner's pid).
It asks for SIGHUP when its parent exits (PR_SET_PDEATHSIG: the parent spawns it from a
thread that lives as long as the engine core is wanted), or leaves at once when its parent
is no longer that pid, and answers SIGHUP and SIGTERM by leaving at once: its socket file
removed, then os._exit. Its workers follow by their own parent-death signal. It runs in a
session of its own: a Ctrl-C at the terminal reaches its client, which stops it in order.

Exit status: 0 after a shutdown call; 1 when it could not start or its workers failed for
good (its last stderr lines say why); 2 when its stdin holds no EngineCoreConfig.
"""

from __future__ import annotations

import logging
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import zmq

from messages import Decoder, EngineCoreConfig, ProtocolError
from zmqworker.engine.core import EngineCore
from zmqworker.engine.core_server import EngineCoreServer
from zmqworker.engine.executors import executor_factory
from zmqworker.engine.grammar_compiler import GrammarCompiler
from zmqworker.engine.structured_outputs import StructuredOutputs
from zmqworker.runtime.fast_exit import fast_exit
from zmqworker.runtime.parent_death import (
    PARENT_DEATH_SIGNAL,
    follow_spawner,
    release_parent_death,
)

log = logging.getLogger("zmqworker.engine")


def build_core(
    config: EngineCoreConfig, make_executor: Callable[[Any], Any] | None = None
) -> EngineCore:
    """The engine core's EngineCore: its executor (the workers spawned, weights loaded),
    then memory profile, KV cache and warm-up. make_executor: a factory of the caller's
    (an engine core run in a thread, for tests), else config.executor's."""
    started = time.perf_counter()
    executor = (make_executor or executor_factory(config.executor))(config.worker)
    try:
        log.info("workers up, weights loaded: %.1f s", time.perf_counter() - started)
        executor.step_timeout_s = config.step_timeout_s
        max_model_len = config.worker.model.max_model_len
        if max_model_len is None:
            raise ValueError("the engine core's ModelConfig must give max_model_len")
        return EngineCore(
            executor,
            max_model_len,
            config.worker.scheduler,
            enable_prefix_caching=config.enable_prefix_caching,
            async_scheduling=config.async_scheduling,
            kv_transfer=config.worker.kv_transfer,
            kv_offloading_size=config.worker.cache.kv_offloading_size,
            structured=StructuredOutputs(
                GrammarCompiler(config.worker.model.path, config.vocab_size)
            ),
        )
    except BaseException:
        executor.shutdown()
        raise


def read_config(data: bytes) -> EngineCoreConfig:
    msg = Decoder().decode([data])
    if not isinstance(msg, EngineCoreConfig):
        raise ProtocolError(f"expected an EngineCoreConfig, got a {type(msg).__name__}")
    return msg


def main() -> int:
    try:
        config = read_config(sys.stdin.buffer.read())
    except ProtocolError as exc:
        print(f"zmqworker engine core: error: stdin: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(message)s",
    )
    if not follow_spawner(sys.argv):
        return 0  # the client is gone already

    def leave(signum: int, frame: object) -> None:
        fast_exit([config.address])

    signal.signal(PARENT_DEATH_SIGNAL, leave)
    release_parent_death()
    signal.signal(signal.SIGTERM, leave)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # its client stops it
    ctx = zmq.Context()
    server = EngineCoreServer(config, ctx)
    try:
        return server.serve(lambda: build_core(config))
    except Exception as exc:
        log.error("%s: %s", type(exc).__name__, exc, exc_info=log.isEnabledFor(logging.DEBUG))
        return 1
    finally:
        server.close()
        ctx.term()
