"""KV transfer, the worker side: the KV connector interface (connector.py), the ZeroMQ
connector (zmq_connector.py: server.py serves staged prefills, puller.py pulls them into
a decode instance's blocks) and the host tier (host_tier.py: blocks the prefix cache
evicts, kept in host memory). The scheduler side is zmqworker.engine's."""

from __future__ import annotations

from collections.abc import Callable

import torch

from messages import KVCacheSpec, KVTransferConfig
from zmqworker.distributed.parallel_state import ParallelState
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
    state: ParallelState,
    num_kv_heads: int | None = None,
    shared_cache: Callable[[], SharedKVCache | None] = lambda: None,
    num_layers: int | None = None,
) -> KVConnector | None:
    """The worker's connector, over its freshly made cache: the host tier's (of
    num_host_blocks slots; 0: none), then the transfer's (config; None: none), or None
    for neither. state: the worker's ranks and groups. num_kv_heads, shared_cache,
    num_layers: ZmqKVConnector's."""
    connectors: list[KVConnector] = []
    if num_host_blocks:
        connectors.append(HostKVConnector(num_host_blocks, kv_caches, spec))
    if config is not None:
        connectors.append(
            _transfer_connector(
                config, kv_caches, spec, state, num_kv_heads, shared_cache, num_layers
            )
        )
    if len(connectors) > 1:
        return KVConnectors(connectors)
    return connectors[0] if connectors else None


def _transfer_connector(
    config: KVTransferConfig,
    kv_caches: Callable[[], list[torch.Tensor]],
    spec: KVCacheSpec,
    state: ParallelState,
    num_kv_heads: int | None,
    shared_cache: Callable[[], SharedKVCache | None],
    num_layers: int | None,
) -> KVConnector:
    """The ZeroMQ connector; the deployment's KV keys come from the environment
    (transport/curve.py's KV_CURVE_ENV)."""
    keys = KVKeys.from_env()
    if keys is None:
        raise ValueError(
            "KV transfer without the deployment's keys: its sockets are CURVE-authenticated "
            f"like every tcp socket of a run; give the workers ${KV_CURVE_ENV} "
            "(zmqworker.transport.curve.KVKeys)"
        )
    connector = ZmqKVConnector(
        config, kv_caches, spec, state.tp_rank, state.tp_size, keys, num_kv_heads,
        shared_cache, state.pp_rank, state.pp_size, num_layers,
    )  # fmt: skip
    if state.tp_group is None:
        return connector
    return TPCombined(connector, state.tp_group, state.device)
