"""Command line of the worker process: `zmqworker worker --engine ADDRESS --rank N` (the
same as `python -m zmqworker worker ...`; executors run `python -m zmqworker.runtime ...`).

An engine spawns it with the address of its ROUTER socket, the rank, and in the
environment (a value on the command line would show in ps): the handshake token
(ZMQWORKER_TOKEN), on tcp the run's CURVE keys (ZMQWORKER_CURVE), and the largest frames
its sockets take in (ZMQWORKER_MAX_MESSAGE_BYTES). Everything else (the model, the
layout, the cache) arrives as a message. With --exit-with-parent the kernel signals the
worker when its parent exits (PR_SET_PDEATHSIG), SIGKILL included; given the parent's pid
(as our executors do), a worker whose parent died before it looked leaves too: when that
pid has exited and init adopted the worker. A pid that was never its parent, live or
exited, is an error (status 2), and the engine's socket file stays.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import sys

import zmq

from zmqworker.runtime.parent_death import (
    exit_with_parent,
    has_exited,
    hold_parent_death,
    orphaned,
)
from zmqworker.runtime.sockets import remove_socket_file, socket_in_use
from zmqworker.transport.curve import WorkerKeys
from zmqworker.transport.heartbeats import MAX_SILENT_S
from zmqworker.transport.spawn_env import (
    ENGINE_SILENT_ENV,
    HANDSHAKE_TIMEOUT_S,
    MAX_MESSAGE_ENV,
    TOKEN_ENV,
    WELCOME_TIMEOUT_ENV,
    message_bounds,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="zmqworker worker",
        description="Run one zmqworker worker process that connects to an engine's ROUTER "
        "socket, announces itself and serves its RPCs.",
    )
    p.add_argument("--engine", required=True, help="engine address, ipc://PATH or tcp://HOST:PORT")
    p.add_argument("--rank", required=True, type=int, help="this worker's rank (0-based)")
    p.add_argument(
        "--token", default=None, help=f"handshake token (default: ${TOKEN_ENV}, preferred)"
    )
    p.add_argument(
        "--exit-with-parent",
        nargs="?",
        const=0,
        type=int,
        metavar="PID",
        help="exit when the parent process (the engine) exits; PID: the parent's pid, so "
        "that a parent gone before the worker started is noticed too",
    )
    p.add_argument(
        "--log-level",
        default="WARNING",
        type=str.upper,
        choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
        help="logging level (default WARNING)",
    )
    return p


def run_worker(args: argparse.Namespace) -> int:
    token = args.token if args.token is not None else os.environ.get(TOKEN_ENV, "")
    if not token:
        print(
            f"zmqworker worker: error: no handshake token (--token or ${TOKEN_ENV})",
            file=sys.stderr,
        )
        return 2
    if args.exit_with_parent is not None and args.exit_with_parent < 0:
        print(
            f"zmqworker worker: error: --exit-with-parent takes a pid, got {args.exit_with_parent}",
            file=sys.stderr,
        )
        return 2
    if args.rank < 0:
        print(f"zmqworker worker: error: --rank must be >= 0, got {args.rank}", file=sys.stderr)
        return 2
    try:
        _check_address(args.engine)
        keys = WorkerKeys.from_env()
        max_request, max_pipeline, max_reply = message_bounds(os.environ.get(MAX_MESSAGE_ENV, ""))
        welcome_timeout_s = _welcome_timeout(os.environ.get(WELCOME_TIMEOUT_ENV, ""))
        engine_silent_s = _engine_silent(os.environ.get(ENGINE_SILENT_ENV, ""))
    except ValueError as e:
        print(f"zmqworker worker: error: {e}", file=sys.stderr)
        return 2
    parent_pid = None
    if args.exit_with_parent is not None:
        parent_pid = args.exit_with_parent or os.getppid()
        hold_parent_death()  # until the server's handler exists (WorkerServer.run)
        if not exit_with_parent(parent_pid):
            if not (has_exited(parent_pid) and orphaned()):
                gone = " (it has exited)" if has_exited(parent_pid) else ""
                print(
                    f"zmqworker worker: error: --exit-with-parent {parent_pid}: that process "
                    f"is not this worker's parent{gone}",
                    file=sys.stderr,
                )
                return 2
            if not socket_in_use(args.engine):  # the engine is gone, and cannot remove it
                remove_socket_file(args.engine)
            return 0
    from zmqworker.runtime.worker_process import WorkerServer  # torch: only when serving

    logging.basicConfig(
        level=args.log_level, format=f"[rank {args.rank}] %(levelname)s %(message)s"
    )

    async def serve() -> int:
        try:
            server = WorkerServer(
                asyncio.get_running_loop(),
                args.engine,
                args.rank,
                token,
                parent_pid,
                keys=keys,
                max_request_bytes=max_request,
                max_pipeline_bytes=max_pipeline,
                max_reply_bytes=max_reply,
                welcome_timeout_s=welcome_timeout_s,
                engine_silent_s=engine_silent_s,
            )
        except (zmq.ZMQError, OSError) as e:  # its sockets cannot bind or connect there
            print(f"zmqworker worker: error: --engine {args.engine}: {e}", file=sys.stderr)
            return 2
        return await server.run()

    try:
        import uvloop
    except ImportError:  # uvloop is not built for every platform; asyncio serves as well
        return asyncio.run(serve())
    return uvloop.run(serve())


def _check_address(address: str) -> None:
    """ipc://PATH or tcp://HOST:PORT, else a ValueError that says so."""
    if address.startswith("ipc://") and len(address) > len("ipc://"):
        return
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    if address.startswith("tcp://") and host and port.isdecimal() and 0 < int(port) < 65536:
        return
    raise ValueError(f"--engine must be ipc://PATH or tcp://HOST:PORT, got {address!r}")


def _welcome_timeout(value: str) -> float | None:
    """Seconds to wait for the Welcome: the default when unset; inf: no bound."""
    if not value:
        return HANDSHAKE_TIMEOUT_S
    seconds = _seconds(WELCOME_TIMEOUT_ENV, value, most=math.inf)
    return None if math.isinf(seconds) else seconds


def _engine_silent(value: str) -> float | None:
    """Seconds of the engine's silence the worker bears; None (unset): no pings of its own."""
    return _seconds(ENGINE_SILENT_ENV, value, most=MAX_SILENT_S) if value else None


def _seconds(name: str, value: str, most: float) -> float:
    """$name's value as seconds > 0, at most `most` (inf: inf too); ValueError naming it
    otherwise."""
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds <= most:
        bound = "" if math.isinf(most) else f", at most {most:,.0f}"
        raise ValueError(f"${name} must be seconds > 0{bound}, got {value!r}")
    return seconds


def main(argv: list[str] | None = None) -> int:
    return run_worker(build_parser().parse_args(argv))
