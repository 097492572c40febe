"""Ray's side of a RayExecutor's start-up, as plain functions (tested without a cluster
where they can be): connecting, checking the cluster's resources, ordering the ranks by
where their actors landed, each rank's environment, and releasing what was placed."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayActorError, RayError
from ray.util.placement_group import remove_placement_group

from zmqworker.executor.errors import WorkerStartupError

log = logging.getLogger("zmqworker.executor")

LOCAL_OBJECT_STORE_BYTES = 100 << 20  # only small call results go through it


@dataclass(frozen=True)
class Placement:
    """Where one actor runs, as it reported."""

    node_id: str
    ip: str
    gpu_ids: tuple[str, ...]
    pid: int


def order_ranks(places: Sequence[Placement], driver_node: str) -> list[int]:
    """Actor indices in rank order: the driver's node first, then node by node, GPUs in
    order within a node. Consecutive ranks (a TP group) so share a node whenever the
    node holds enough of them."""

    def key(i: int) -> tuple:
        p = places[i]
        return (p.node_id != driver_node, p.node_id, [_gpu_key(g) for g in p.gpu_ids], i)

    return sorted(range(len(places)), key=key)


def rank_environments(
    places: Sequence[Placement], use_gpu: bool, extra: dict[str, str]
) -> tuple[list[dict[str, str]], list[int]]:
    """Each rank's environment and local rank. On GPUs, every rank of a node sees the
    node's GPUs of this layout (so that they can reach each other), and its local rank
    is the index of its own GPU among them. extra (propagated and given variables)
    comes last and wins."""
    on_node: dict[str, list[int]] = {}
    for rank, p in enumerate(places):
        on_node.setdefault(p.node_id, []).append(rank)
    envs, local_ranks = [], []
    for rank, p in enumerate(places):
        peers = on_node[p.node_id]
        env: dict[str, str] = {}
        if use_gpu:
            if not p.gpu_ids:
                raise WorkerStartupError(f"rank {rank} on node {p.ip} got no GPU from Ray")
            gpus = sorted({g for r in peers for g in places[r].gpu_ids}, key=_gpu_key)
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
            local_ranks.append(gpus.index(p.gpu_ids[0]))
        else:
            local_ranks.append(peers.index(rank))
        envs.append({**env, **extra})
    return envs, local_ranks


def _gpu_key(gpu_id: str) -> tuple[int, int, str]:
    return (0, int(gpu_id), "") if gpu_id.isdigit() else (1, 0, gpu_id)


def placement_of(info: dict[str, Any]) -> Placement:
    return Placement(
        node_id=info["node_id"],
        ip=info["ip"],
        gpu_ids=tuple(info["gpu_ids"]),
        pid=info["pid"],
    )


def warn_split_tp_groups(places: Sequence[Placement], tp: int) -> None:
    for start in range(0, len(places), tp):
        nodes = {p.ip for p in places[start : start + tp]}
        if len(nodes) > 1:
            log.warning(
                "TP group of ranks %d-%d spans nodes %s: its collectives cross the network",
                start, start + tp - 1, ", ".join(sorted(nodes)),
            )  # fmt: skip


def connect_ray(address: str | None, world: int, cpus_per_worker: float) -> bool:
    """Connect to Ray; True when this call started (or connected) it, so that shutdown
    disconnects again."""
    if ray.is_initialized():
        if address is not None:
            log.warning("Ray is initialised already: address %r is ignored", address)
        return False
    common: dict[str, Any] = {"include_dashboard": False, "logging_level": logging.WARNING}
    if address is None and not os.environ.get("RAY_ADDRESS"):
        # A local cluster, sized for the layout even on a small machine.
        needed = math.ceil(world * cpus_per_worker)
        ray.init(
            address="local",  # a new one, even where `ray start` ran before
            num_cpus=max(os.cpu_count() or 1, needed),
            object_store_memory=LOCAL_OBJECT_STORE_BYTES,
            **common,
        )
    else:
        ray.init(address=address, **common)
    return True


def wants_gpu(device: str) -> bool:
    if device == "cuda":
        return True
    if device == "cpu":
        return False
    if device == "auto":
        return ray.cluster_resources().get("GPU", 0) >= 1
    raise ValueError(f"device must be auto, cpu or cuda, got {device!r}")


def check_resources(bundle: dict[str, float], world: int, layout: str) -> None:
    """Fail at once, before anything starts, when the cluster cannot hold the layout."""
    have = ray.cluster_resources()
    asked = {k: v * world for k, v in bundle.items()}
    short = [k for k, v in asked.items() if have.get(k, 0) < v]
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    fits_a_node = any(all(res.get(k, 0) >= v for k, v in bundle.items()) for res in nodes)
    if short or not fits_a_node:
        why = f"too little {', '.join(short)}" if short else "no node can hold one bundle"
        raise WorkerStartupError(
            f"the Ray cluster cannot hold the layout {layout}: it asks for {world} bundle(s) "
            f"of {fmt_resources(bundle)} ({fmt_resources(asked)} in all), and the cluster has "
            f"{fmt_resources(have)} on {len(nodes)} node(s) ({why})"
        )


def fmt_resources(resources: dict[str, float]) -> str:
    """CPU and GPU (and other custom resources), without Ray's bookkeeping entries."""
    shown = {
        k: v for k, v in resources.items()
        if not k.startswith("node:") and k not in ("memory", "object_store_memory")
    }  # fmt: skip
    shown.setdefault("CPU", 0.0)
    shown.setdefault("GPU", 0.0)
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(shown.items())) + "}"


def how_it_ended(ref: Any) -> tuple[bool, str]:
    """How a wait_server call ended: (the server stopped by itself, in words)."""
    try:
        return True, f"its server stopped (exit code {ray.get(ref, timeout=0)})"
    except RayError as e:
        what = "its actor died" if isinstance(e, RayActorError) else "its server failed"
        return False, f"{what} ({type(e).__name__}: {str(e).splitlines()[0]})"


def release(actors: list[Any], groups: list[Any]) -> None:
    """Kill the actors and remove the placement group; also the last resort for an
    executor nobody shut down."""
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception as e:  # gone already, or Ray is down: nothing is left to kill
            log.debug("ray.kill: %s", e)
    for group in groups:
        try:
            remove_placement_group(group)
        except Exception as e:
            log.debug("remove_placement_group: %s", e)
