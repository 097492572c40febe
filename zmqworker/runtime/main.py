"""Command line of the worker process: `zmqworker worker --engine ADDRESS --rank N` (the
same as `python -m zmqworker worker ...`; executors run `python -m zmqworker.runtime ...`).

An engine spawns it with the address of its ROUTER socket, the rank, and a handshake
token in the environment (ZMQWORKER_TOKEN; a token on the command line would show in
ps). Everything else (the model, the layout, the cache) arrives as a message.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from zmqworker.transport.spawn_env import TOKEN_ENV


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
        action="store_true",
        help="exit when the parent process (the engine) exits",
    )
    p.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    return p


def run_worker(args: argparse.Namespace) -> int:
    token = args.token if args.token is not None else os.environ.get(TOKEN_ENV, "")
    if not token:
        print(
            f"zmqworker worker: error: no handshake token (--token or ${TOKEN_ENV})",
            file=sys.stderr,
        )
        return 2
    if args.rank < 0:
        print(f"zmqworker worker: error: --rank must be >= 0, got {args.rank}", file=sys.stderr)
        return 2
    from zmqworker.runtime.worker_process import WorkerServer  # torch: only when serving

    logging.basicConfig(
        level=args.log_level.upper(), format=f"[rank {args.rank}] %(levelname)s %(message)s"
    )
    parent_pid = os.getppid() if args.exit_with_parent else None

    async def serve() -> int:
        loop = asyncio.get_running_loop()
        return await WorkerServer(loop, args.engine, args.rank, token, parent_pid).run()

    try:
        import uvloop
    except ImportError:  # uvloop is not built for every platform; asyncio serves as well
        return asyncio.run(serve())
    return uvloop.run(serve())


def main(argv: list[str] | None = None) -> int:
    return run_worker(build_parser().parse_args(argv))
