"""The zmqworker command: `generate` (complete prompts), `serve` (an OpenAI-compatible
server), `engine-core` (one engine core served over CURVE tcp for clients on other
hosts), `keys` (the key pairs such a deployment shares) and `worker` (one worker
process, as engines spawn it).

zmqworker generate "The capital of France is" --pp 2 --max-tokens 16 --temperature 0
zmqworker serve --port 8000
zmqworker engine-core --listen tcp://10.0.0.5:7100 --model /models/llama
zmqworker worker --engine ipc:///run/engine.sock --rank 0
"""

from __future__ import annotations

import argparse
import gc
import logging
import signal
import sys

from zmqworker import __version__
from zmqworker.runtime.main import build_parser as build_worker_parser
from zmqworker.runtime.main import run_worker


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The parser and its subcommands' parsers, by name."""
    from zmqworker.cli import engine_core, generate, serve

    parser = argparse.ArgumentParser(
        prog="zmqworker",
        description="Worker processes for LLM inference engines, driven over ZeroMQ, and a "
        "reference engine over them.",
    )
    parser.add_argument("--version", action="version", version=f"zmqworker {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    commands = {"generate": generate.add_parser(sub), "serve": serve.add_parser(sub)}
    commands.update(engine_core.add_parsers(sub))
    commands["worker"] = sub.add_parser(
        "worker",
        help="run one worker process (engines spawn it)",
        parents=[build_worker_parser()],
        add_help=False,
        description=build_worker_parser().description,
    )
    return parser, commands


class Terminated(KeyboardInterrupt):
    """SIGTERM, unwound like Ctrl-C: the workers shut down before the command exits."""


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit status. An engine command's objects are frozen on the
    way out, so that the interpreter's last collection does not walk them (most of a
    second after a large run)."""
    try:
        return _run(argv)
    finally:
        gc.freeze()


def _run(argv: list[str] | None) -> int:
    parser, commands = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # Reported under the subcommand's usage line, where the option was looked for.
        commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "worker":
        return run_worker(args)
    from zmqworker.cli import engine_core, generate, serve

    if args.command == "keys":
        return engine_core.print_keys(args)
    _show_progress()

    # uvicorn installs its own SIGTERM handler while it serves (a drain, not this).
    signal.signal(signal.SIGTERM, _terminate)
    try:
        run = {"generate": generate.run, "serve": serve.run, "engine-core": engine_core.run}
        return run[args.command](args)
    except Terminated:
        print("zmqworker: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print("zmqworker: interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError, RuntimeError, TimeoutError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"zmqworker: error: {first_line}", file=sys.stderr)
        return 1


def _terminate(signum: int, frame: object) -> None:
    raise Terminated


def _show_progress() -> None:
    """The engine's start-up phases, with their times, on stderr (stdout is the output)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("zmqworker: %(message)s"))
    logger = logging.getLogger("zmqworker")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
