"""`zmqworker engine-core`: one engine core served on its own over CURVE tcp, for clients
on other hosts (`LLM(engine_core_addresses=...)`, `zmqworker serve --engine-core-address`),
and `zmqworker keys`, which makes the key pairs such a deployment shares.

The engine core runs in this process (its workers are its children, as always) and
serves until SIGTERM or Ctrl-C, or a client's shutdown call: clients come and go, and a
client that ends does not stop it. Its ROUTER is a CURVE server with the pair in
$ZMQWORKER_CORE_CURVE and admits its holders alone. With --disaggregate-role it is a prefill or
a decode instance of disaggregated serving: a prefill instance's ranks serve their KV on
tcp://KV_HOST:KV_PORT+rank (an address the decode hosts reach), decode instances pull
from there; all hold the pair in $ZMQWORKER_KV_CURVE. --first-gpu places engine
cores side by side on one host's GPUs, each seeing all of them: a decode instance then
reads a prefill instance's cache on a peer GPU in place.

    eval "$(zmqworker keys)"   # on one host; the same two variables on every other
    zmqworker engine-core --listen tcp://10.0.0.5:7100 --model /models/llama --tp 2
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from typing import Any

import msgspec

from zmqworker.cli.options import add_options, given, llm_options
from zmqworker.frontend.disaggregated_plan import KV_TIMEOUT_S, ROUTER_OPTIONS, check_kv_transfer

# LLM options a lone engine core has no use for: a pair's are its own flags here, and
# the replicas of data parallelism are engine cores of their own.
NOT_HERE = (
    "data_parallel_size",
    "disaggregate",
    "decode_tensor_parallel_size",
    "decode_pipeline_parallel_size",
    "kv_port",
    "kv_transfer_timeout_s",
    "prefill_instances",
    "decode_instances",
    *ROUTER_OPTIONS,
    "engine_core_addresses",
)
LLM_OPTIONS = llm_options(skip=NOT_HERE)
ROLES = {"prefill": "producer", "decode": "consumer"}

log = logging.getLogger("zmqworker")


def add_parsers(sub: Any) -> dict[str, argparse.ArgumentParser]:
    parser = sub.add_parser(
        "engine-core",
        help="serve one engine core over CURVE tcp, for clients on other hosts",
        description=__doc__.split("\n\n")[1].replace("\n", " "),
    )
    parser.add_argument(
        "--listen",
        required=True,
        metavar="tcp://HOST:PORT",
        help="the address the engine core's socket binds (clients connect to it)",
    )
    parser.add_argument(
        "--disaggregate-role",
        choices=sorted(ROLES),
        help="a disaggregated instance: prefill computes prompts and serves their KV, "
        "decode pulls it and decodes",
    )
    parser.add_argument(
        "--kv-host",
        metavar="HOST",
        help="prefill: the address its KV servers bind, reachable from the decode host",
    )
    parser.add_argument(
        "--kv-port",
        type=int,
        metavar="PORT",
        help="prefill: rank r (pp_rank*tp+tp_rank) serves its KV on KV_HOST:PORT+r",
    )
    parser.add_argument(
        "--kv-transfer-timeout",
        type=float,
        metavar="S",
        help="with --disaggregate-role: seconds a prompt's KV waits to be pulled, and a pull "
        f"for its answer (default: {KV_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--first-gpu",
        type=int,
        metavar="N",
        help="CUDA: the visible GPU its first rank takes, the others the GPUs after it (default 0)",
    )
    add_options(parser.add_argument_group("engine"), LLM_OPTIONS)
    keys = sub.add_parser(
        "keys",
        help="print new key pairs for engine cores served over tcp and their KV",
        description="Print `export` lines of two new CURVE key pairs: $ZMQWORKER_CORE_CURVE "
        "(engine cores served with engine-core and their clients) and $ZMQWORKER_KV_CURVE "
        "(a disaggregated pair's KV sockets). Every host of the deployment needs both; keep "
        "them out of command lines and shared files.",
    )
    return {"engine-core": parser, "keys": keys}


def print_keys(args: argparse.Namespace) -> int:
    from zmqworker.transport.curve import CoreKeys, KVKeys

    for keys in (CoreKeys.new(), KVKeys.new()):
        print(f"export {keys.ENV}='{keys.to_env()}'")  # z85 has no single quote
    return 0


def run(args: argparse.Namespace) -> int:
    import zmq

    from zmqworker.engine.core_main import build_core
    from zmqworker.engine.core_server import EngineCoreServer

    config = engine_core_config(args)
    signal.signal(signal.SIGTERM, _leave)
    signal.signal(signal.SIGINT, _leave)
    ctx = zmq.Context()
    try:
        try:
            server = EngineCoreServer(config, ctx)
        except zmq.ZMQError as exc:
            raise OSError(f"--listen {config.address}: {exc}") from None
        try:
            log.info("engine core on %s", config.address)
            return server.serve(lambda: build_core(config))
        finally:
            server.close()
    finally:
        ctx.term()


def engine_core_config(args: argparse.Namespace) -> Any:
    """The EngineCoreConfig the arguments ask for; ValueError names what is wrong, before
    anything starts."""
    from messages import KVTransferConfig
    from zmqworker.frontend.engine_plan import EnginePlan
    from zmqworker.frontend.llm import OPTION_DEFAULTS, OPTION_TYPES
    from zmqworker.frontend.llm_args import check_args
    from zmqworker.frontend.remote_cores import check_address
    from zmqworker.transport.curve import CoreKeys, KVKeys

    check_address(args.listen, "--listen", bind=True)
    keys = CoreKeys.from_env()
    if keys is None:
        raise ValueError(f"--listen {args.listen} needs ${CoreKeys.ENV} (zmqworker keys)")
    role = args.disaggregate_role
    if role != "prefill" and (args.kv_host is not None or args.kv_port is not None):
        raise ValueError("--kv-host and --kv-port are a prefill's: --disaggregate-role prefill")
    if role is None and args.kv_transfer_timeout is not None:
        raise ValueError("--kv-transfer-timeout needs --disaggregate-role")
    if role == "prefill":
        if args.kv_host is None or args.kv_port is None:
            raise ValueError("--disaggregate-role prefill needs --kv-host and --kv-port")
        # The decode ranks connect there: the address its KV servers bind is advertised.
        check_address(f"tcp://{args.kv_host}:{args.kv_port}", "--kv-host and --kv-port")
    if role is not None and KVKeys.from_env() is None:
        raise ValueError(f"--disaggregate-role needs ${KVKeys.ENV} (zmqworker keys)")
    chosen = given(args, LLM_OPTIONS)
    check_args(OPTION_TYPES, chosen)
    plan = EnginePlan.from_options(OPTION_DEFAULTS | chosen)
    config = plan.engine_config(0, args.listen, keys.token)
    if args.first_gpu is not None:
        config = _placed(config, args.first_gpu)
    if role is None:
        return config
    timeout = KV_TIMEOUT_S if args.kv_transfer_timeout is None else args.kv_transfer_timeout
    check_kv_transfer(plan.worker_config.parallel, timeout, args.kv_port)
    transfer = KVTransferConfig(ROLES[role], timeout_s=timeout)
    if role == "prefill":  # where its KV servers bind; a decode instance serves none
        transfer = msgspec.structs.replace(transfer, host=args.kv_host, port=args.kv_port)
    worker = msgspec.structs.replace(config.worker, kv_transfer=transfer)
    return msgspec.structs.replace(config, worker=worker)


def _placed(config: Any, first: int) -> Any:
    """config with its ranks on the visible GPUs from first on; ValueError where they
    do not fit."""
    from zmqworker.frontend.devices import visible_gpu_count

    worker = config.worker
    if worker.device.device != "cuda":
        raise ValueError(f"--first-gpu places ranks on GPUs: the device is {worker.device.device}")
    ranks = worker.parallel.tensor_parallel_size * worker.parallel.pipeline_parallel_size
    gpus = visible_gpu_count()
    if first < 0 or first + ranks > gpus:
        raise ValueError(
            f"--first-gpu {first} with {ranks} rank(s) needs GPUs {first} .. "
            f"{first + ranks - 1}, but {gpus} GPU(s) are visible"
        )
    parallel = msgspec.structs.replace(worker.parallel, first_local_rank=first)
    worker = msgspec.structs.replace(worker, parallel=parallel)
    return msgspec.structs.replace(config, worker=worker)


def _leave(signum: int, frame: object) -> None:
    """Leave at once: the workers follow by their parent-death signal."""
    from zmqworker.runtime.fast_exit import fast_exit

    print(f"zmqworker engine-core: {signal.Signals(signum).name}: leaving", file=sys.stderr)
    fast_exit([], 128 + signum if signum != signal.SIGINT else 130)
