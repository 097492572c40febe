"""RayExecutor: MultiprocExecutor's workers, placed by Ray, for layouts past one machine.

Ray is the control plane: it reserves one bundle per rank (a placement group), starts
one actor per rank, tells the executor where each landed, carries the start-up calls
(environment, worker construction, server start) and reports deaths. The data plane
stays ours: each actor runs a WorkerServer that connects to the executor's ROUTER over
tcp:// and then carries every step, reply and pipeline tensor with the msgspec codec,
exactly as a worker process does.

Start-up: placement group (checked against the cluster first) -> actors -> where each
runs -> ranks ordered so that a TP group shares a node -> each rank's environment
(CUDA_VISIBLE_DEVICES, propagated variables) -> prepare_worker -> servers -> handshake
(Hello/Welcome, the PP address exchange) -> init_device, load_model.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
import weakref
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq

try:
    import ray
    from ray.exceptions import RayError
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError as e:  # the extra is optional
    raise ImportError(f"RayExecutor needs Ray: pip install 'zmqworker[ray]' ({e})") from e

from messages import WorkerConfig
from zmqworker.executor.abstract import Executor
from zmqworker.executor.calls import Liveness
from zmqworker.executor.errors import ExecutorError, WorkerDiedError, WorkerStartupError
from zmqworker.executor.handshake import (
    STUCK_AFTER_S,
    WELCOME_MARGIN_S,
    Handshake,
    bind_router,
    new_token,
    polite_shutdown,
)
from zmqworker.executor.message_limits import message_limits
from zmqworker.executor.ray_actor import RayWorkerActor
from zmqworker.executor.ray_cluster import (
    Placement,
    check_resources,
    connect_ray,
    fmt_resources,
    how_it_ended,
    order_ranks,
    placement_of,
    rank_environments,
    release,
    wants_gpu,
    warn_split_tp_groups,
)
from zmqworker.executor.rpc_client import RpcClient
from zmqworker.transport.curve import RunKeys, start_zap
from zmqworker.transport.heartbeats import check_bound

log = logging.getLogger("zmqworker.executor")

PLACEMENT_TIMEOUT_S = 60.0  # resources the cluster has but others hold: wait this long
SHUTDOWN_GRACE_S = 5.0
WATCH_SLICE_S = 0.2  # how often the death watcher looks whether it should stop
ACTOR_CONCURRENCY = 4  # wait_server stays open; the other calls need threads too

_RemoteActor = ray.remote(RayWorkerActor)


class RayExecutor(Executor):
    def __init__(
        self,
        config: WorkerConfig,
        address: str | None = None,
        start_timeout: float = 600.0,
        env: dict[str, str] | None = None,
        propagate_env: Sequence[str] = (),
        num_cpus_per_worker: float = 1.0,
        curve: bool = True,
        stuck_after_s: float | None = STUCK_AFTER_S,
    ) -> None:
        """address: a running cluster ("auto", "ray://...", host:port); None: the Ray this
        process is connected to, else $RAY_ADDRESS, else a new local one. env: variables
        set in every worker before it is built; propagate_env: names of the driver's
        variables copied to every worker. curve: CURVE on every socket of the run (tcp,
        across the network); False only for a network you trust. stuck_after_s: a rank
        silent for that long fails the calls with WorkerStuckError and is killed."""
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
        check_bound("stuck_after_s", stuck_after_s)
        self.config = config
        self.curve = curve
        self.stuck_after_s = stuck_after_s
        self.actors: list[Any] = []  # ray actor handles, by rank
        self.placements: list[Placement] = []  # by rank
        self.address = ""
        self.rpc: RpcClient | None = None
        self._closed = False
        self._groups: list[Any] = []  # the placement group, once there is one
        self._watch: _ActorWatch | None = None
        self._serving: list[Any] = []  # the wait_server calls, by rank
        self._sock: zmq.Socket | None = None
        self._zap: Any = None  # the ZAP handler of the CURVE run
        self._started_ray = connect_ray(address, config.parallel.world_size, num_cpus_per_worker)
        self._ctx = zmq.Context()
        self._finalizer = weakref.finalize(self, release, self.actors, self._groups)
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

    def collective_rpc(
        self,
        method: str,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        unique_reply_rank: int | list[int] | None = None,
        non_block: bool = False,
    ) -> Any:
        if self._closed:
            raise ExecutorError(f"{method}: the executor is shut down")
        if self.rpc is None:  # only while the start-up has not reached the handshake
            raise ExecutorError(f"{method}: the workers are not connected")
        return self.rpc.collective_rpc(method, args, kwargs, timeout, unique_reply_rank, non_block)

    def shutdown(self) -> None:
        """Polite shutdown call, stop the servers, kill the actors, remove the placement
        group, close the socket, and stop Ray if this executor started it."""
        if self._closed:
            return
        self._closed = True
        if self._watch is not None:
            self._watch.expect_exits()
        polite = self.rpc is not None and polite_shutdown(
            self.rpc, len(self.actors), SHUTDOWN_GRACE_S
        )
        if self._serving:
            for actor in self.actors:
                actor.stop_server.remote("the executor shuts down")
            grace = SHUTDOWN_GRACE_S if polite else 1.0
            ray.wait(self._serving, num_returns=len(self._serving), timeout=grace)
        if self.rpc is not None:  # a call still waited on fails now; before the pipes close
            self.rpc.close()
        if self._watch is not None:
            self._watch.close()
        release(self.actors, self._groups)
        if self._serving:  # they end when their actors are gone: wait for that, bounded
            ray.wait(self._serving, num_returns=len(self._serving), timeout=SHUTDOWN_GRACE_S)
        if self._sock is not None:
            self._sock.close(linger=0)
        if self._zap is not None:
            self._zap.stop()
        self._ctx.term()
        self._finalizer.detach()
        if self._started_ray:
            ray.shutdown()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.placements]

    @property
    def failure(self) -> ExecutorError | None:
        return None if self.rpc is None else self.rpc.dead

    # start-up -------------------------------------------------------------------------

    def _start(
        self, timeout: float, env: dict[str, str], propagate: list[str], cpus: float
    ) -> None:
        parallel = self.config.parallel
        world = parallel.world_size
        use_gpu = wants_gpu(self.config.device.device)
        bundle = {"CPU": cpus, "GPU": 1.0} if use_gpu else {"CPU": cpus}
        check_resources(
            bundle,
            world,
            f"tp={parallel.tensor_parallel_size} x pp={parallel.pipeline_parallel_size}",
        )
        group = placement_group([dict(bundle) for _ in range(world)], strategy="PACK")
        self._groups.append(group)
        wait_s = min(timeout, PLACEMENT_TIMEOUT_S)
        if not group.wait(wait_s):
            raise WorkerStartupError(
                f"Ray did not place {world} bundles of {fmt_resources(bundle)} within "
                f"{wait_s:.0f} s: "
                f"the cluster has {fmt_resources(ray.cluster_resources())}, of which "
                f"{fmt_resources(ray.available_resources())} are free"
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
        places = [placement_of(info) for info in found]
        driver_node = ray.get_runtime_context().get_node_id()
        order = order_ranks(places, driver_node)
        self.actors[:] = [actors[i] for i in order]
        self.placements = [places[i] for i in order]
        warn_split_tp_groups(self.placements, parallel.tensor_parallel_size)
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
            "update_environment",
            [a.update_environment.remote(envs[r]) for r, a in enumerate(self.actors)],
            timeout,
        )
        encoded = msgspec.msgpack.encode(self.config)
        init_method = parallel.distributed_init_method or None
        prepares = [
            a.prepare_worker.remote(
                encoded, {"local_rank": local_ranks[r], "distributed_init_method": init_method}
            )
            for r, a in enumerate(self.actors)
        ]
        self._gather("prepare_worker", prepares, timeout)

        # The data plane: our ROUTER, each actor's WorkerServer, the handshake.
        driver_ip = "127.0.0.1" if local else ray.util.get_node_ip_address()
        keys = RunKeys.new() if self.curve else None
        if keys is not None:
            self._zap = start_zap(self._ctx, keys.worker_public)
        limits = message_limits(self.config)
        self._sock, self.address = bind_router(
            self._ctx, f"tcp://{driver_ip}", limits.reply_bytes, self.stuck_after_s, keys
        )
        token = new_token()
        worker_keys = keys.for_workers().to_env() if keys is not None else ""
        # One deadline for every Hello, from before any actor's Welcome wait starts.
        hellos_by = time.monotonic() + timeout
        starts = [
            a.start_server.remote(
                self.address,
                token,
                f"tcp://{'127.0.0.1' if local else p.ip}:*",
                worker_keys,
                limits.to_env(),
                timeout + WELCOME_MARGIN_S,
                self.stuck_after_s,
            )
            for a, p in zip(self.actors, self.placements, strict=True)
        ]
        self._gather("start_server", starts, timeout)
        self._serving = [a.wait_server.remote() for a in self.actors]
        self._watch = _ActorWatch(self._serving, [p.ip for p in self.placements], self.actors)
        handshake = Handshake(world, token, self.pids)
        self.rpc = RpcClient(
            self._sock,
            self._watch,
            on_other=handshake.on_hello,
            stuck_after_s=self.stuck_after_s,
            max_request_bytes=limits.request_bytes,
        )
        handshake.run(self.rpc, self.config, max(0.0, hellos_by - time.monotonic()))
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

    def __init__(self, serving: list[Any], nodes: list[str], actors: list[Any]) -> None:
        pipes = [os.pipe() for _ in serving]
        super().__init__({read: rank for rank, (read, _) in enumerate(pipes)})
        self._actors = actors
        self._nodes = nodes
        self._pipes = pipes
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

    def kill(self, rank: int) -> None:
        ray.kill(self._actors[rank], no_restart=True)

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
                stopped, how = how_it_ended(ref)
                if self._expected.is_set():
                    if stopped:  # asked to stop: not a death that should fail the call
                        continue
                else:
                    log.warning("rank %d on node %s: %s", rank, self._nodes[rank], how)
                with self._lock:
                    self._dead.append(rank)
                    self._causes[rank] = how
                os.write(self._pipes[rank][1], b"x")
