"""The engine cores of disaggregated serving on one host, planned from an engine's plan:
prefill instances (engine cores 0 .. P - 1, their workers KV producers) with the plan's
layout, then decode instances (KV consumers) with the plan's or another tensor parallel
size and pipeline stages (their ranks pull their KV heads of their layers from the
prefill ranks that hold them: kv_transfer/head_map.py), and the key pair their KV
sockets share. Prefill instance i's rank r (of tp x pp) serves its KV on
KV_HOST:kv_port + i * tp * pp + r.

On CUDA each instance takes GPUs of its own, one after the other, when the host has
enough for all; otherwise they share the GPUs from the first, each worker with
kv_cache_bytes of KV cache (a decode's scaled to the same blocks as a prefill's: by
the layers of its largest stage and the heads of a rank), since sizing by memory would
race between them. On the CPU all instances' workers divide the host's cores between
them (ParallelConfig.host_ranks)."""

from __future__ import annotations

import logging
import random
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from messages import EngineCoreConfig, KVTransferConfig, ParallelConfig
from zmqworker.cdiv import cdiv
from zmqworker.frontend.core_client import EngineCoreClient
from zmqworker.frontend.core_process import EngineCoreLauncher
from zmqworker.frontend.devices import check_gpu_layout, gpu_range, visible_gpu_count
from zmqworker.frontend.disaggregated_client import client_maker
from zmqworker.frontend.engine_plan import EnginePlan
from zmqworker.transport.curve import KV_CURVE_ENV, KVKeys

logger = logging.getLogger("zmqworker.frontend")
KV_HOST = "127.0.0.1"  # one host: the prefill's KV servers take local peers only
PORT_TRIES = 20
LOWEST_PORT = 20_000  # below it: ports services are commonly given
KV_TIMEOUT_S = 30.0  # every transfer wait's bound, unless the options give another
# LLM options of the router alone (its client's: a client of engine cores served on their
# own takes them too).
ROUTER_OPTIONS = ("max_local_prefill_tokens",)
# LLM options that only disaggregated serving takes.
COMPANIONS = (
    "decode_tensor_parallel_size",
    "decode_pipeline_parallel_size",
    "kv_port",
    "kv_transfer_timeout_s",
    "prefill_instances",
    "decode_instances",
    *ROUTER_OPTIONS,
)


def check_pair_options(options: dict[str, Any]) -> None:
    """Raise ValueError naming an option that only disaggregated serving takes, given
    without disaggregate: before anything is opened."""
    if not options["disaggregate"]:
        for name in COMPANIONS:
            if options.get(name) is not None:
                raise ValueError(f"{name}={options[name]!r} needs disaggregate=True")


def start_engine_cores(
    plan: EnginePlan, pair: DisaggregatedPlan | None
) -> tuple[EngineCoreLauncher, Callable[..., EngineCoreClient]]:
    """The plan's engine cores (its replicas, or its prefill and decode instances),
    starting, and what makes the client that drives them (client_maker)."""
    if pair is None:
        launcher = EngineCoreLauncher(plan.num_engines, plan.engine_config, plan.make_executor)
        return launcher, EngineCoreClient
    launcher = EngineCoreLauncher(pair.num_engines, pair.engine_config, env=pair.env)
    return launcher, client_maker(True, pair.max_local_prefill_tokens)


@dataclass(frozen=True)
class DisaggregatedPlan:
    plan: EnginePlan
    kv_port: int  # prefill instance i's rank r serves its KV on KV_HOST:kv_port + i*tp*pp + r
    timeout_s: float  # KVTransferConfig.timeout_s: every transfer wait's bound
    keys: KVKeys
    decode_tp: int  # the decode instances' tensor parallel size
    decode_pp: int  # and pipeline stages
    prefills: int = 1
    decodes: int = 1
    apart: bool = False  # CUDA: each instance on GPUs of its own (else all share them)
    max_local_prefill_tokens: int | None = None  # the router's (DisaggregatedClient)

    @property
    def num_engines(self) -> int:
        return self.prefills + self.decodes

    @classmethod
    def from_options(cls, plan: EnginePlan, options: dict[str, Any]) -> DisaggregatedPlan | None:
        """The instances the LLM's options ask for, or None without disaggregate."""
        if not options["disaggregate"]:
            return None
        if plan.make_executor is not None:
            raise ValueError(
                "disaggregate runs its engine cores as processes: an executor factory "
                "(engine cores in this process) is not taken with it"
            )
        return cls.of(
            plan,
            options["kv_port"],
            options["kv_transfer_timeout_s"] or KV_TIMEOUT_S,
            options["decode_tensor_parallel_size"],
            options["prefill_instances"] or 1,
            options["decode_instances"] or 1,
            options["max_local_prefill_tokens"],
            options["decode_pipeline_parallel_size"],
        )

    @classmethod
    def of(
        cls,
        plan: EnginePlan,
        kv_port: int | None = None,
        timeout_s: float = KV_TIMEOUT_S,
        decode_tp: int | None = None,
        prefills: int = 1,
        decodes: int = 1,
        max_local_prefill_tokens: int | None = None,
        decode_pp: int | None = None,
    ) -> DisaggregatedPlan:
        """decode_tp, decode_pp: the decode instances' tensor parallel size and pipeline
        stages (None: the plan's);
        prefills, decodes: how many instances of each; max_local_prefill_tokens: the
        router's (DisaggregatedClient). Raises ValueError naming what the
        layout cannot do disaggregated."""
        worker = plan.worker_config
        parallel = worker.parallel
        if plan.num_engines != 1:
            raise ValueError(
                f"--disaggregate runs prefill and decode instances (--prefill-instances, "
                f"--decode-instances); data_parallel_size={plan.num_engines} is not taken with it"
            )
        for name, count in (("prefill", prefills), ("decode", decodes)):
            if count < 1:
                raise ValueError(f"--{name}-instances must be >= 1, got {count}")
        check_kv_transfer(parallel, timeout_s, kv_port, prefills)
        tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        for name, size in (("tensor parallel size", decode_tp), ("pipeline stages", decode_pp)):
            if size is not None and size < 1:
                raise ValueError(f"the decode {name} must be >= 1, got {size}")
        decode_tp, decode_pp = decode_tp or tp, decode_pp or pp
        if (decode_tp, decode_pp) != (tp, pp):
            _check_decode_layout(plan, decode_tp, decode_pp)
        apart = False
        if worker.device.device == "cuda":
            gpus = visible_gpu_count()
            ranks = prefills * tp * pp, decodes * decode_tp * decode_pp
            if sum(ranks) <= gpus and plan.executor == "mp":
                apart = True
                logger.info(
                    "disaggregated: %d prefill instance(s) on GPU(s) %s, %d decode on %s",
                    prefills, gpu_range(0, ranks[0]), decodes, gpu_range(ranks[0], ranks[1]),
                )  # fmt: skip
            elif worker.cache.kv_cache_bytes is None:
                raise ValueError(
                    f"--disaggregate on CUDA with {gpus} GPU(s) visible for {ranks[0]} prefill "
                    f"and {ranks[1]} decode rank(s): the instances share the GPUs, so give "
                    "--kv-cache-bytes (each instance's KV cache per worker); sizing by "
                    "gpu_memory_utilization would race between them"
                )
            else:
                logger.info(
                    "disaggregated: %d GPU(s) visible for %d prefill and %d decode rank(s): "
                    "the instances share them", gpus, *ranks,
                )  # fmt: skip
        if kv_port is None:
            kv_port = free_ports(prefills * tp * pp)
        return cls(plan, kv_port, timeout_s, KVKeys.new(), decode_tp, decode_pp, prefills, decodes,
                   apart, max_local_prefill_tokens)  # fmt: skip

    @property
    def env(self) -> dict[str, str]:
        """What the engine cores (and their workers) get: the KV sockets' key pair."""
        return {KV_CURVE_ENV: self.keys.to_env()}

    def engine_config(self, index: int, address: str, token: str) -> EngineCoreConfig:
        """Engine core index's configuration: a prefill instance below self.prefills, a
        decode instance from there, each as the plan's one replica, placed on the host
        beside the others."""
        if not 0 <= index < self.num_engines:
            raise ValueError(f"engine core {index}: this deployment runs {self.num_engines}")
        config = self.plan.engine_config(0, address, token)
        prefill_tp = config.worker.parallel.tensor_parallel_size
        pp = config.worker.parallel.pipeline_parallel_size
        prefill = index < self.prefills
        # The ranks of the instances before this one: where its GPUs start (apart), and
        # a prefill instance's KV ports after kv_port (a decode instance binds none).
        prefill_ranks, decode_ranks = prefill_tp * pp, self.decode_tp * self.decode_pp
        first = index * prefill_ranks
        if not prefill:
            first = self.prefills * prefill_ranks + (index - self.prefills) * decode_ranks
        port = self.kv_port + first if prefill else 0
        transfer = KVTransferConfig("producer" if prefill else "consumer", KV_HOST, port,
                                    self.timeout_s)  # fmt: skip
        worker = msgspec.structs.replace(config.worker, kv_transfer=transfer)
        parallel, cache = worker.parallel, worker.cache
        if self.apart:
            parallel = msgspec.structs.replace(parallel, first_local_rank=first)
        if not prefill:
            parallel = msgspec.structs.replace(parallel, tensor_parallel_size=self.decode_tp,
                                               pipeline_parallel_size=self.decode_pp)  # fmt: skip
            if cache.kv_cache_bytes is not None:
                per_worker = self._decode_bytes(cache.kv_cache_bytes, prefill_tp, pp)
                cache = msgspec.structs.replace(cache, kv_cache_bytes=per_worker)
        if self.plan.executor == "mp":  # every instance's workers on this host
            ranks = self.prefills * prefill_ranks + self.decodes * decode_ranks
            parallel = msgspec.structs.replace(parallel, host_ranks=ranks)
        worker = msgspec.structs.replace(worker, parallel=parallel, cache=cache)
        return msgspec.structs.replace(config, worker=worker, engine_index=index)

    def _decode_bytes(self, prefill_bytes: int, tp: int, pp: int) -> int:
        """A decode worker's KV cache bytes for as many blocks as a prefill worker's
        prefill_bytes (of tp x pp): a block takes bytes for each layer of the largest
        stage and each KV head of a rank."""
        pages = self.plan.folder.pages_per_block
        return cdiv(prefill_bytes * pages(self.decode_tp, self.decode_pp), pages(tp, pp))


def check_kv_transfer(
    parallel: ParallelConfig, timeout_s: float, kv_port: int | None, prefills: int = 1
) -> None:
    """Raise ValueError naming what KV transfer cannot take in this layout: a timeout
    that is not positive, or a first port (the first prefill's; None: not given) that
    leaves no room for the ranks of that many prefill instances."""
    if not timeout_s > 0:
        raise ValueError(f"the KV transfer timeout must be positive, got {timeout_s}")
    ports = parallel.world_size * prefills
    if kv_port is not None and not 0 < kv_port <= 65536 - ports:
        raise ValueError(f"--kv-port must leave {ports} port(s) in [1, 65535], got {kv_port}")


def _check_decode_layout(plan: EnginePlan, decode_tp: int, decode_pp: int) -> None:
    """Refuse a decode layout the model cannot be cut into, or (on CUDA) more GPUs than
    there are: before anything starts. Any two layouts the model can be cut into map
    their KV heads and layers (each side holds them by the model's rules:
    kv_transfer/head_map.py)."""
    worker = plan.worker_config
    prefill_tp, pp = worker.parallel.tensor_parallel_size, worker.parallel.pipeline_parallel_size
    try:
        plan.folder.check_layout(decode_tp, decode_pp, worker.parallel.enable_expert_parallel)
    except ValueError as e:
        raise ValueError(
            f"--disaggregate with prefill tensor parallel size {prefill_tp} and decode "
            f"{decode_tp}, prefill pipeline stages {pp} and decode {decode_pp}: {e}"
        ) from None
    if worker.device.device == "cuda" and not callable(plan.executor):
        check_gpu_layout(1, decode_tp, decode_pp, visible_gpu_count())


def free_ports(count: int) -> int:
    """A first port p such that p .. p + count - 1 are free on KV_HOST now: below the range
    the kernel hands out to outgoing connections, where it says which (one of those could
    take a port of the block between this check and the bind)."""
    below = _outgoing_ports_start()
    for _ in range(PORT_TRIES):
        if below is not None and below - count > LOWEST_PORT:
            first = random.randrange(LOWEST_PORT, below - count + 1)
        else:
            with socket.socket() as probe:
                probe.bind((KV_HOST, 0))
                first = probe.getsockname()[1]
        if first + count <= 65536 and all(_free(first + i) for i in range(count)):
            return first
    raise OSError(f"found no {count} free consecutive port(s) on {KV_HOST}")


def _outgoing_ports_start() -> int | None:
    """The first port of Linux's ephemeral range (ip_local_port_range), or None."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((KV_HOST, port))
        except OSError:
            return False
    return True
