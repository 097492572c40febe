"""`zmqworker serve`: the OpenAI-compatible server (zmqworker/serve/)."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any

from zmqworker.cli.options import add_options, given, llm_options, parse_size
from zmqworker.serve.sizing import default_api_server_count
from zmqworker.serve.tool_parsers import TOOL_PARSERS

if TYPE_CHECKING:  # the server's modules load starlette: not for `--help`
    from zmqworker.serve.cors import CorsOptions

LLM_OPTIONS = llm_options()
API_KEY_ENV = "ZMQWORKER_API_KEY"


def add_parser(sub: Any) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "serve",
        help="serve the model over an OpenAI-compatible HTTP API",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /tokenize, "
        "/detokenize, /health and /metrics over the reference engine: API server processes "
        "on one port, each a client of the engine core processes (one per data-parallel "
        "replica), or of engine cores served on their own (--engine-core-address). SIGINT or "
        "SIGTERM lets the requests in flight finish, then stops the workers it started; any "
        "of the processes dying stops the whole server.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    parser.add_argument(
        "--served-model-name", help="the model's name in the API (default: its folder's name)"
    )
    parser.add_argument(
        "--api-key", help=f"require this bearer token (default: ${API_KEY_ENV}, if set)"
    )
    parser.add_argument(
        "--api-server-count",
        type=int,
        default=None,
        metavar="N",
        help="API server processes accepting on the port (default: a quarter of the cores, "
        f"1 to 4: {default_api_server_count()} here)",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds requests in flight get to finish on SIGINT/SIGTERM (default: 30)",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=_size,
        metavar="BYTES",
        help="refuse larger request bodies with 413 (default: 4MiB; 4194304, 4MiB or 1G)",
    )
    parser.add_argument(
        "--uvicorn-log-level",
        default="warning",
        choices=("critical", "error", "warning", "info", "debug"),
        help="uvicorn's logging (info: one line per request; default: warning)",
    )
    parser.add_argument(
        "--enable-admin-endpoints",
        action="store_true",
        help="serve /sleep, /wake_up, /reset_prefix_cache, /update_weights_from_disk and "
        "/is_sleeping (behind the API key when one is set)",
    )
    tools = parser.add_argument_group(
        "tool calling",
        'tools with tool_choice "required" or a named function work without these (structured '
        'outputs force the calls); "auto" needs both',
    )
    tools.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let tool_choice "auto" (the default when tools are given) read the calls the '
        "model chooses to make out of its reply",
    )
    tools.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSERS),
        help="the format of the model's calls: hermes (<tool_call>{json}</tool_call>: Qwen2, "
        'Qwen2.5, Qwen3) or llama3_json ({"name": ..., "parameters": ...}: Llama 3.1+)',
    )
    cors = parser.add_argument_group(
        "CORS", "pages on other origins calling from browsers (default: no CORS headers)"
    )
    cors.add_argument(
        "--allowed-origins",
        nargs="+",
        metavar="ORIGIN",
        help="origins whose pages may call the server: * or scheme://host[:port] each",
    )
    cors.add_argument(
        "--allowed-methods",
        nargs="+",
        metavar="METHOD",
        help="methods they may use (default: *)",
    )
    cors.add_argument(
        "--allowed-headers",
        nargs="+",
        metavar="HEADER",
        help="request headers they may send (default: *)",
    )
    cors.add_argument(
        "--allow-credentials", action="store_true", help="let them send cookies and credentials"
    )
    add_options(parser.add_argument_group("engine"), LLM_OPTIONS)
    return parser


def run(args: argparse.Namespace) -> int:
    from zmqworker.serve.server import serve

    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in [1, 65535], got {args.port}")
    cors = _cors(args)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    serve(
        given(args, LLM_OPTIONS),
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        api_key=_api_key(args),
        shutdown_timeout_s=args.shutdown_timeout,
        log_level=args.uvicorn_log_level,
        api_server_count=args.api_server_count,
        enable_admin_endpoints=args.enable_admin_endpoints,
        cors=cors,
        tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
        **({} if args.max_request_bytes is None else {"max_request_bytes": args.max_request_bytes}),
    )
    return 0


def _cors(args: argparse.Namespace) -> CorsOptions | None:
    """The CORS options, or None (no CORS headers) without --allowed-origins."""
    from zmqworker.serve.cors import CorsOptions

    companions = {
        "--allowed-methods": args.allowed_methods,
        "--allowed-headers": args.allowed_headers,
        "--allow-credentials": args.allow_credentials or None,
    }
    if args.allowed_origins is None:
        for option, value in companions.items():
            if value is not None:
                raise ValueError(f"{option} needs --allowed-origins: without it, no CORS")
        return None
    cors = CorsOptions(
        args.allowed_origins,
        **{k: v for k, v in (("allowed_methods", args.allowed_methods),
                             ("allowed_headers", args.allowed_headers)) if v is not None},
        allow_credentials=args.allow_credentials,
    )  # fmt: skip
    cors.check()
    return cors


def _size(text: str) -> int:
    try:
        size = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if size < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return size


def _api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else $ZMQWORKER_API_KEY, else None (no key); an empty or blank one is
    refused: `--api-key "$KEY"` with KEY unset would serve without authentication."""
    given = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    if given is not None and not given.strip():
        where = "--api-key" if args.api_key is not None else f"${API_KEY_ENV}"
        raise ValueError(f"{where} is empty: give a key, or leave the option out for none")
    return given
