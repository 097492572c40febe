"""A client of engine cores it did not start: each served on its own over CURVE tcp
(`zmqworker engine-core`, on other hosts or this one), as data-parallel replicas or as a
disaggregated pair (prefill, then decode). The client holds the deployment's pair
($ZMQWORKER_CORE_CURVE); it learns the engine cores' sizes from their Ready, and checks
that they serve the model it tokenises for."""

from __future__ import annotations

import re
from typing import Any

from messages import EngineCoreReady
from zmqworker.frontend.core_client import EngineCoreClient
from zmqworker.frontend.core_process import RemoteEngineCore
from zmqworker.frontend.disaggregated_client import DisaggregatedClient
from zmqworker.frontend.disaggregated_plan import COMPANIONS
from zmqworker.frontend.engine_plan import EnginePlan
from zmqworker.transport.curve import CoreKeys

_TCP = re.compile(r"tcp://([^:/\s]+|\[[0-9a-fA-F:]+\]):(\d{1,5})")
# Options that describe engine cores this client starts: those served on their own were
# given theirs where they run.
STARTED_HERE = ("data_parallel_size", *COMPANIONS)


def check_address(address: str) -> None:
    """Raise ValueError unless address is tcp://HOST:PORT with a port in [1, 65535]."""
    match = _TCP.fullmatch(address)
    if match is None or not 0 < int(match.group(2)) < 65536:
        raise ValueError(f"an engine core address must be tcp://HOST:PORT, got {address!r}")


def check_remote_options(options: dict[str, Any], defaults: dict[str, Any]) -> None:
    """Raise ValueError naming what engine_core_addresses cannot take, before any socket."""
    addresses = options["engine_core_addresses"]
    for address in addresses:
        check_address(address)
    if len(set(addresses)) != len(addresses):
        raise ValueError(f"engine_core_addresses names one engine core twice: {addresses}")
    if options["disaggregate"] and len(addresses) != 2:
        raise ValueError(
            "disaggregate with engine_core_addresses takes two: the prefill instance's, "
            f"then the decode instance's; got {len(addresses)}"
        )
    for name in STARTED_HERE:
        if options.get(name) != defaults[name]:
            raise ValueError(
                f"{name}={options[name]!r} is for engine cores this client starts: those at "
                "engine_core_addresses were given theirs where they run"
            )
    if callable(options["executor"]):
        raise ValueError("an executor factory starts engine cores here: not with addresses")
    if CoreKeys.from_env() is None:
        raise ValueError(f"engine_core_addresses needs ${CoreKeys.ENV} (zmqworker keys)")


def connect(
    addresses: list[str], disaggregate: bool, output_bytes: int, client_index: int = 0
) -> EngineCoreClient:
    """A client of the engine cores at addresses, its Hello sent (wait_ready next); it
    closes their handles with its connections."""
    handles = [RemoteEngineCore(i, a) for i, a in enumerate(addresses)]
    client_class = DisaggregatedClient if disaggregate else EngineCoreClient
    try:
        return client_class(addresses, handles, core_token(), client_index, output_bytes)
    except BaseException:
        for handle in handles:
            handle.close()
        raise


def core_token() -> str:
    """The Hello token of engine cores served with this process's pair."""
    keys = CoreKeys.from_env()
    if keys is None:
        raise ValueError(f"engine cores served on their own need ${CoreKeys.ENV} (zmqworker keys)")
    return keys.token


def check_readies(plan: EnginePlan, readies: list[EngineCoreReady], addresses: list[str]) -> None:
    """Raise ValueError unless every engine core serves this client's vocabulary, and all
    of them one context length (the client's limit)."""
    for ready, address in zip(readies, addresses, strict=True):
        if ready.vocab_size != plan.folder.vocab_size:
            raise ValueError(
                f"the engine core at {address} serves a vocabulary of {ready.vocab_size} "
                f"tokens, this client's model {plan.folder.path} has {plan.folder.vocab_size}"
            )
    lengths = {a: r.max_model_len for a, r in zip(addresses, readies, strict=True)}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"the engine cores take different max_model_len: {lengths}")
