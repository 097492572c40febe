"""A client of engine cores it did not start: each served on its own over CURVE tcp
(`zmqworker engine-core`, on other hosts or this one), as data-parallel replicas or as
the prefill and decode instances of disaggregated serving (each Ready says which). The
client holds the deployment's pair ($ZMQWORKER_CORE_CURVE) and the model folder it
tokenises with; everything else about the engine cores (layout, memory, limits) was
given where they run, and the client learns what it needs from their Ready: it checks
that they serve its model's vocabulary and agree on max_model_len."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from messages import EngineCoreReady
from zmqworker.engine.model_folder import ModelFolder
from zmqworker.frontend.core_client import EngineCoreClient
from zmqworker.frontend.core_process import RemoteEngineCore
from zmqworker.frontend.disaggregated_client import client_maker
from zmqworker.frontend.disaggregated_plan import COMPANIONS, ROUTER_OPTIONS
from zmqworker.transport.curve import CoreKeys

_TCP = re.compile(r"tcp://([^:/\s\[\]]+):(\d{1,5})")  # a host name or IPv4 address
WILDCARDS = ("0.0.0.0", "*")  # every interface: to bind, not to connect to
# The options a client of such engine cores takes; any other is the engine cores'.
CLIENT_OPTIONS = ("model", "max_logprobs", "disaggregate", "engine_core_addresses",
                  *ROUTER_OPTIONS)  # fmt: skip


def check_address(address: str, what: str = "an engine core address", bind: bool = False) -> None:
    """Raise ValueError unless address is tcp://HOST:PORT: a host name or IPv4 address
    (a wildcard only where it is bound: peers connect to the others) and a port in
    [1, 65535]."""
    match = _TCP.fullmatch(address)
    wildcard = match is not None and match.group(1) in WILDCARDS
    if match is None or (wildcard and not bind) or not 0 < int(match.group(2)) < 65536:
        kind = "a host name or IPv4 address" + ("" if bind else ", not a wildcard")
        raise ValueError(
            f"{what} must be tcp://HOST:PORT ({kind}; a port in [1, 65535]), got {address!r}"
        )


@dataclass(frozen=True)
class RemotePlan:
    folder: ModelFolder  # the client's tokenizer and generation defaults
    addresses: list[str]
    disaggregate: bool  # the addresses are prefill and decode instances (their Readies say)
    max_logprobs: int
    token: str  # the Hello token of the deployment's pair
    max_local_prefill_tokens: int | None = None  # the router's (DisaggregatedClient)

    @classmethod
    def from_options(cls, options: dict[str, Any], defaults: dict[str, Any]) -> RemotePlan:
        """options: every argument of LLM (checked already). Raises ValueError naming
        what engine_core_addresses cannot take, before any socket opens."""
        addresses = options["engine_core_addresses"]
        for address in addresses:
            check_address(address)
        if len(set(addresses)) != len(addresses):
            raise ValueError(f"engine_core_addresses names one engine core twice: {addresses}")
        if options["disaggregate"] and len(addresses) < 2:
            raise ValueError(
                "disaggregate with engine_core_addresses takes prefill and decode instances, "
                f"at least two; got {len(addresses)}"
            )
        for name, value in options.items():
            if name in ROUTER_OPTIONS and value != defaults[name] and not options["disaggregate"]:
                raise ValueError(f"{name}={value!r} needs disaggregate=True")
            if name in COMPANIONS and name not in ROUTER_OPTIONS and value != defaults[name]:
                raise ValueError(
                    f"{name}={value!r} plans instances this client does not start: with "
                    "engine_core_addresses, the instances are the addresses given, each with "
                    "the role and layout it was started with (zmqworker engine-core "
                    "--disaggregate-role)"
                )
            if name not in CLIENT_OPTIONS and value != defaults[name]:
                raise ValueError(
                    f"{name}={value!r} is the engine cores' to take: give it where they run "
                    "(zmqworker engine-core); a client of engine_core_addresses takes "
                    f"{', '.join(CLIENT_OPTIONS)}"
                )
        keys = CoreKeys.from_env()
        if keys is None:
            raise ValueError(f"engine_core_addresses needs ${CoreKeys.ENV} (zmqworker keys)")
        folder = ModelFolder.open(options["model"])
        return cls(folder, addresses, options["disaggregate"], options["max_logprobs"],
                   keys.token, options["max_local_prefill_tokens"])  # fmt: skip

    def connect(self, client_index: int = 0) -> EngineCoreClient:
        """A client of the engine cores, its Hello sent (wait_ready next)."""
        return remote_client(self.addresses, self.token, self.disaggregate, client_index,
                             self.max_local_prefill_tokens)  # fmt: skip

    def check_readies(self, readies: list[EngineCoreReady]) -> None:
        """Raise ValueError unless the addresses name as many engine cores (two names of
        one host would make one count twice), every one serves this client's vocabulary,
        and all of them one context length (the client's limit)."""
        vocab = self.folder.vocab_size
        named: dict[tuple[str, int], str] = {}
        for ready, address in zip(readies, self.addresses, strict=True):
            first = named.setdefault((ready.host_id, ready.pid), address)
            if first != address and ready.host_id:  # "": its host unknown
                raise ValueError(
                    f"engine_core_addresses {first} and {address} name one engine core "
                    f"(pid {ready.pid})"
                )
            if ready.vocab_size != vocab:
                raise ValueError(
                    f"the engine core at {address} serves a vocabulary of {ready.vocab_size} "
                    f"tokens, this client's model {self.folder.path} has {vocab}"
                )
        lengths = {a: r.max_model_len for a, r in zip(self.addresses, readies, strict=True)}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"the engine cores take different max_model_len: {lengths}")


def remote_client(
    addresses: list[str],
    token: str,
    disaggregate: bool,
    client_index: int,
    max_local_prefill_tokens: int | None = None,
) -> EngineCoreClient:
    """A client of engine cores served on their own (it closes their handles with its
    connections). Their outputs are not bounded here: each is a peer the deployment's
    pair authenticated, sized by limits given where it runs."""
    handles = [RemoteEngineCore(i, a) for i, a in enumerate(addresses)]
    make = client_maker(disaggregate, max_local_prefill_tokens)
    try:
        return make(addresses, handles, token, client_index, -1)
    except BaseException:
        for handle in handles:
            handle.close()
        raise
