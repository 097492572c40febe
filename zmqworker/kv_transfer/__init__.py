"""KV transfer, the worker side: the KV connector interface (connector.py), the ZeroMQ
connector (zmq_connector.py: server.py serves staged prefills, puller.py pulls them into
a decode instance's blocks) and the host tier (host_tier.py: blocks the prefix cache
evicts, kept in host memory). The scheduler side is zmqworker.engine's."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed import ProcessGroup

from messages import KVCacheSpec, KVTransferConfig
from zmqworker.distributed.shared_cache import SharedKVCache
from zmqworker.kv_transfer.connector import KVConnector, KVConnectors, take_orders
from zmqworker.kv_transfer.host_tier import HostKVConnector
from zmqworker.kv_transfer.tp_reports import TPCombined
from zmqworker.kv_transfer.zmq_connector import ZmqKVConnector
from zmqworker.transport.curve import KV_CURVE_ENV, KVKeys

__all__ = [
    "HostKVConnector",
    "KVConnector",
    "ZmqKVConnector",
    "make_kv_connector",
    "take_orders",
]


def make_kv_connector(
    config: KVTransferConfig | None,
    num_host_blocks: int,
    kv_caches: Callable[[], list[torch.Tensor]],
    spec: KVCacheSpec,
    tp_rank: int,
    tp_size: int,
    pp_size: int,
    tp_group: ProcessGroup | None,
    device: torch.device,
    num_kv_heads: int | None = None,
    shared_cache: Callable[[], SharedKVCache | None] = lambda: None,
) -> KVConnector | None:
    """The worker's connector, over its freshly made cache: the host tier's (of
    num_host_blocks slots; 0: none), then the transfer's (config; None: none), or None
    for neither. num_kv_heads, shared_cache: ZmqKVConnector's."""
    connectors: list[KVConnector] = []
    if num_host_blocks:
        connectors.append(HostKVConnector(num_host_blocks, kv_caches, spec))
    if config is not None:
        connectors.append(_transfer_connector(config, kv_caches, spec, tp_rank, tp_size,
                                              pp_size, tp_group, device, num_kv_heads,
                                              shared_cache))  # fmt: skip
    if len(connectors) > 1:
        return KVConnectors(connectors)
    return connectors[0] if connectors else None


def _transfer_connector(
    config: KVTransferConfig,
    kv_caches: Callable[[], list[torch.Tensor]],
    spec: KVCacheSpec,
    tp_rank: int,
    tp_size: int,
    pp_size: int,
    tp_group: ProcessGroup | None,
    device: torch.device,
    num_kv_heads: int | None,
    shared_cache: Callable[[], SharedKVCache | None],
) -> KVConnector:
    """The ZeroMQ connector; the deployment's KV keys come from the environment
    (transport/curve.py's KV_CURVE_ENV)."""
    if pp_size > 1:
        raise ValueError(
            "KV transfer with pipeline parallelism is not supported: every stage would "
            "need a peer of its own (run the instances with pipeline_parallel_size=1)"
        )
    keys = KVKeys.from_env()
    if keys is None:
        raise ValueError(
            "KV transfer without the deployment's keys: its sockets are CURVE-authenticated "
            f"like every tcp socket of a run; give the workers ${KV_CURVE_ENV} "
            "(zmqworker.transport.curve.KVKeys)"
        )
    connector = ZmqKVConnector(config, kv_caches, spec, tp_rank, tp_size, keys, num_kv_heads,
                               shared_cache)  # fmt: skip
    if tp_group is None:
        return connector
    return TPCombined(connector, tp_group, device)
