"""RayExecutor: the same workers as MultiprocExecutor, placed by Ray, for layouts past
one machine.

Ray is the control plane: it reserves one bundle per rank (a placement group), starts
one actor per rank, tells the executor where each landed, carries the start-up calls
(environment, worker construction, server start) and reports deaths. The data plane
stays ours: each actor runs a WorkerServer that connects to the executor's ROUTER over
tcp:// and then carries every step, reply and pipeline tensor with the msgspec codec,
exactly as a worker process does.

Start-up: placement group (checked against the cluster first) -> actors -> where each
runs -> ranks ordered so that a TP group shares a node -> each rank's environment
(CUDA_VISIBLE_DEVICES, propagated variables) -> init_worker -> servers -> handshake
(Hello/Welcome, the PP address exchange) -> init_device, load_model.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import uuid
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

try:
    import ray
    from ray.exceptions import RayActorError, RayError
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError as e:  # the extra is optional
    raise ImportError(f"RayExecutor needs Ray: pip install 'zmqworker[ray]' ({e})") from e

from messages import WorkerConfig
from zmqworker.executor.errors import WorkerDiedError, WorkerStartupError
from zmqworker.executor.handshake import Handshake, bind_router, polite_shutdown
from zmqworker.executor.ray_actor import RayWorkerActor
from zmqworker.executor.rpc_client import Liveness, RpcClient
from zmqworker.executor.rpc_executor import RpcExecutor

log = logging.getLogger("zmqworker.executor")

PLACEMENT_TIMEOUT_S = 60.0  # resources the cluster has but others hold: wait this long
SHUTDOWN_GRACE_S = 5.0
WATCH_SLICE_S = 0.2  # how often the death watcher looks whether it should stop
ACTOR_CONCURRENCY = 4  # wait_server stays open; the other calls need threads too
LOCAL_OBJECT_STORE_BYTES = 100 << 20  # only small call results go through it

_RemoteActor = ray.remote(RayWorkerActor)


@dataclass(frozen=True)
class Placement:
    """Where one actor runs, as it reported."""

    node_id: str
    ip: str
    gpu_ids: tuple[str, ...]
    pid: int


class RayExecutor(RpcExecutor):
    def __init__(
        self,
        config: WorkerConfig,
        address: str | None = None,
        start_timeout: float = 600.0,
        env: dict[str, str] | None = None,
        propagate_env: Sequence[str] = (),
        num_cpus_per_worker: float = 1.0,
    ) -> None:
        """address: a running cluster ("auto", "ray://...", host:port); None: the Ray this
        process is connected to, else $RAY_ADDRESS, else a new local one. env: variables
        set in every worker before it is built; propagate_env: names of the driver's
        variables copied to every worker."""
        if num_cpus_per_worker <= 0:
            raise ValueError(f"num_cpus_per_worker must be > 0, got {num_cpus_per_worker}")
        if start_timeout <= 0:
            raise ValueError(f"start_timeout must be > 0, got {start_timeout}")
        if isinstance(propagate_env, str):
            raise ValueError(f"propagate_env is a list of names, got the string {propagate_env!r}")
        env = dict(env or {})
        bad = {k: v for k, v in env.items() if not (isinstance(k, str) and isinstance(v, str))}
        if bad:
            raise ValueError(f"env must map str to str, got {bad!r}")
        self.config = config
        self.actors: list[Any] = []  # ray actor handles, by rank
        self.placements: list[Placement] = []  # by rank
        self.address = ""
        self.rpc: RpcClient | None = None
        self._closed = False
        self._groups: list[Any] = []  # the placement group, once there is one
        self._watch: _ActorWatch | None = None
        self._serving: list[Any] = []  # the wait_server calls, by rank
        self._sock: zmq.Socket | None = None
        self._started_ray = _connect(address, config.parallel.world_size, num_cpus_per_worker)
        self._ctx = zmq.Context()
        self._finalizer = weakref.finalize(self, _release, self.actors, self._groups)
        try:
            self._start(start_timeout, env, list(propagate_env), num_cpus_per_worker)
        except BaseException as e:
            died = isinstance(e, WorkerDiedError) and self._watch is not None
            cause = self._watch.cause(e.rank) if died else ""
            self.shutdown()
            if isinstance(e, (WorkerStartupError, KeyboardInterrupt)):
                raise
            text = f"worker start-up failed: {e}" + (f": {cause}" if cause else "")
            raise WorkerStartupError(text) from e

    # the Executor interface ------------------------------------------------------------

    def shutdown(self) -> None:
        """Polite shutdown call, stop the servers, kill the actors, remove the placement
        group, close the socket, and stop Ray if this executor started it."""
        if self._closed:
            return
        self._closed = True
        if self._watch is not None:
            self._watch.expect_exits()
        polite = polite_shutdown(self.rpc, len(self.actors), SHUTDOWN_GRACE_S)
        if self._serving:
            for actor in self.actors:
                actor.stop_server.remote("the executor shuts down")
            grace = SHUTDOWN_GRACE_S if polite else 1.0
            ray.wait(self._serving, num_returns=len(self._serving), timeout=grace)
        if self.rpc is not None:  # a call still waited on fails now; before the pipes close
            self.rpc.close()
        if self._watch is not None:
            self._watch.close()
        _release(self.actors, self._groups)
        if self._serving:  # they end when their actors are gone: wait for that, bounded
            ray.wait(self._serving, num_returns=len(self._serving), timeout=SHUTDOWN_GRACE_S)
        if self._sock is not None:
            self._sock.close(linger=0)
        self._ctx.term()
        self._finalizer.detach()
        if self._started_ray:
            ray.shutdown()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.placements]

    # start-up -------------------------------------------------------------------------

    def _start(
        self, timeout: float, env: dict[str, str], propagate: list[str], cpus: float
    ) -> None:
        parallel = self.config.parallel
        world = parallel.world_size
        use_gpu = _wants_gpu(self.config.device.device)
        bundle = {"CPU": cpus, "GPU": 1.0} if use_gpu else {"CPU": cpus}
        _check_resources(
            bundle,
            world,
            f"tp={parallel.tensor_parallel_size} x pp={parallel.pipeline_parallel_size}",
        )
        group = placement_group([dict(bundle) for _ in range(world)], strategy="PACK")
        self._groups.append(group)
        wait_s = min(timeout, PLACEMENT_TIMEOUT_S)
        if not group.wait(wait_s):
            raise WorkerStartupError(
                f"Ray did not place {world} bundles of {_fmt(bundle)} within {wait_s:.0f} s: "
                f"the cluster has {_fmt(ray.cluster_resources())}, of which "
                f"{_fmt(ray.available_resources())} are free"
            )

        # One actor per bundle; none knows its rank, environment or GPU yet.
        run_id = uuid.uuid4().hex[:8]
        actors = [
            _RemoteActor.options(
                name=f"zmqworker-{run_id}-{i}",
                num_cpus=cpus,
                num_gpus=1 if use_gpu else 0,
                max_concurrency=ACTOR_CONCURRENCY,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=group,
                    placement_group_bundle_index=i,
                    placement_group_capture_child_tasks=True,
                ),
            ).remote()
            for i in range(world)
        ]
        self.actors.extend(actors)
        found = self._gather(
            "reporting its placement", [a.placement.remote() for a in actors], timeout, by="actor"
        )
        places = [_placement(info) for info in found]
        driver_node = ray.get_runtime_context().get_node_id()
        order = order_ranks(places, driver_node)
        self.actors[:] = [actors[i] for i in order]
        self.placements = [places[i] for i in order]
        _warn_split_tp_groups(self.placements, parallel.tensor_parallel_size)
        local = all(p.node_id == driver_node for p in self.placements)

        if world > 1 and not parallel.distributed_init_method:
            [port] = self._gather("free_port", [self.actors[0].free_port.remote()], timeout)
            host = "127.0.0.1" if local else self.placements[0].ip
            parallel = msgspec.structs.replace(
                parallel, distributed_init_method=f"tcp://{host}:{port}"
            )
            self.config = msgspec.structs.replace(self.config, parallel=parallel)

        missing = [name for name in propagate if name not in os.environ]
        if missing:
            log.warning("propagate_env: %s not set in the driver", ", ".join(missing))
        propagated = {name: os.environ[name] for name in propagate if name in os.environ}
        envs, local_ranks = rank_environments(self.placements, use_gpu, {**propagated, **env})
        self._gather(
            "assign_rank", [a.assign_rank.remote(r) for r, a in enumerate(self.actors)], timeout
        )
        self._gather(
            "update_environment_variables",
            [a.update_environment_variables.remote(envs) for a in self.actors],
            timeout,
        )
        kwargs = [
            {"rank": r, "local_rank": local_ranks[r],
             "distributed_init_method": parallel.distributed_init_method or None}
            for r in range(world)
        ]  # fmt: skip
        encoded = msgspec.msgpack.encode(self.config)
        self._gather(
            "init_worker", [a.init_worker.remote(encoded, kwargs) for a in self.actors], timeout
        )

        # The data plane: our ROUTER, each actor's WorkerServer, the handshake.
        driver_ip = "127.0.0.1" if local else ray.util.get_node_ip_address()
        self._sock, self.address = bind_router(self._ctx, f"tcp://{driver_ip}")
        handshake = Handshake(world)
        starts = [
            a.start_server.remote(
                self.address, handshake.token, f"tcp://{'127.0.0.1' if local else p.ip}:*"
            )
            for a, p in zip(self.actors, self.placements, strict=True)
        ]
        self._gather("start_server", starts, timeout)
        self._serving = [a.wait_server.remote() for a in self.actors]
        self._watch = _ActorWatch(self._serving, [p.ip for p in self.placements])
        self.rpc = handshake.client(self._sock, self._watch, self.pids)
        handshake.run(self.config, timeout)
        self.collective_rpc("init_device", timeout=timeout)
        self.collective_rpc("load_model", timeout=timeout)

    def _gather(self, what: str, refs: list[Any], timeout: float, by: str = "rank") -> list[Any]:
        """Every ref's result, in order; a failure or silence names the rank (or the
        actor, before ranks exist) and its node."""
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        if pending:
            late = [i for i, ref in enumerate(refs) if ref in pending]
            raise WorkerStartupError(
                f"{what}: no answer from {by}(s) {late} within {timeout:.0f} s"
            )
        results = []
        for i, ref in enumerate(refs):
            try:
                results.append(ray.get(ref))
            except RayError as e:
                where = f" on node {self.placements[i].ip}" if i < len(self.placements) else ""
                raise WorkerStartupError(f"{what} failed on {by} {i}{where}: {e}") from e
        return results


class _ActorWatch(Liveness):
    """Deaths, through Ray. Each rank's wait_server call is open while its server runs;
    when it ends (the server stopped, the actor or its node died), that rank's pipe
    becomes readable, which wakes the RpcClient's poll, and check() names the rank and
    its node."""

    def __init__(self, serving: list[Any], nodes: list[str]) -> None:
        self._nodes = nodes
        self._pipes = [os.pipe() for _ in serving]
        self.fds = {read: rank for rank, (read, _) in enumerate(self._pipes)}
        self._rank_of = {ref: rank for rank, ref in enumerate(serving)}
        self._dead: list[int] = []  # ranks, in the order they died
        self._causes: dict[int, str] = {}
        self._lock = threading.Lock()
        self._expected = threading.Event()  # shutting down: exits are no news
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ray-actor-watch", daemon=True)
        self._thread.start()

    def check(self) -> WorkerDiedError | None:
        with self._lock:
            if not self._dead:
                return None
            rank = self._dead[0]
        return WorkerDiedError(rank, None, f" on node {self._nodes[rank]}")

    def cause(self, rank: int) -> str:
        """How the rank's server ended, in words ("" while it runs)."""
        with self._lock:
            return self._causes.get(rank, "")

    def expect_exits(self) -> None:
        """From now on a server that stops is no death (the polite shutdown stops them
        one by one); an actor that dies still is."""
        self._expected.set()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for read, write in self._pipes:
            os.close(read)
            os.close(write)
        self._pipes = []

    def _run(self) -> None:
        pending = list(self._rank_of)
        while pending and not self._stop.is_set():
            ready, pending = ray.wait(pending, num_returns=1, timeout=WATCH_SLICE_S)
            for ref in ready:
                rank = self._rank_of[ref]
                stopped, how = _ended(ref)
                if self._expected.is_set():
                    if stopped:  # asked to stop: not a death that should fail the call
                        continue
                else:
                    log.warning("rank %d on node %s: %s", rank, self._nodes[rank], how)
                with self._lock:
                    self._dead.append(rank)
                    self._causes[rank] = how
                os.write(self._pipes[rank][1], b"x")


# helpers (pure where they can be, so they are tested without a cluster) ----------------


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


def _placement(info: dict[str, Any]) -> Placement:
    return Placement(
        node_id=info["node_id"],
        ip=info["ip"],
        gpu_ids=tuple(info["gpu_ids"]),
        pid=info["pid"],
    )


def _warn_split_tp_groups(places: Sequence[Placement], tp: int) -> None:
    for start in range(0, len(places), tp):
        nodes = {p.ip for p in places[start : start + tp]}
        if len(nodes) > 1:
            log.warning(
                "TP group of ranks %d-%d spans nodes %s: its collectives cross the network",
                start, start + tp - 1, ", ".join(sorted(nodes)),
            )  # fmt: skip


def _connect(address: str | None, world: int, cpus_per_worker: float) -> bool:
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


def _wants_gpu(device: str) -> bool:
    if device == "cuda":
        return True
    if device == "cpu":
        return False
    if device == "auto":
        return ray.cluster_resources().get("GPU", 0) >= 1
    raise ValueError(f"device must be auto, cpu or cuda, got {device!r}")


def _check_resources(bundle: dict[str, float], world: int, layout: str) -> None:
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
            f"of {_fmt(bundle)} ({_fmt(asked)} in all), and the cluster has "
            f"{_fmt(have)} on {len(nodes)} node(s) ({why})"
        )


def _fmt(resources: dict[str, float]) -> str:
    """CPU and GPU (and other custom resources), without Ray's bookkeeping entries."""
    shown = {
        k: v for k, v in resources.items()
        if not k.startswith("node:") and k not in ("memory", "object_store_memory")
    }  # fmt: skip
    shown.setdefault("CPU", 0.0)
    shown.setdefault("GPU", 0.0)
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(shown.items())) + "}"


def _ended(ref: Any) -> tuple[bool, str]:
    """How a wait_server call ended: (the server stopped by itself, in words)."""
    try:
        return True, f"its server stopped (exit code {ray.get(ref, timeout=0)})"
    except RayError as e:
        what = "its actor died" if isinstance(e, RayActorError) else "its server failed"
        return False, f"{what} ({type(e).__name__}: {str(e).splitlines()[0]})"


def _release(actors: list[Any], groups: list[Any]) -> None:
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
