"""RayExecutor on a local Ray instance (CPU only, small numbers) that this module starts.

Skipped, with the reason, where Ray cannot be imported (pip install 'zmqworker[ray]').
"""

from __future__ import annotations

import os
import signal
import time

import msgspec
import pytest
import zmq

try:
    import ray
except ImportError as e:  # the ray extra is optional: say why these tests do not run
    pytest.skip(
        f"Ray cannot be imported ({e}): pip install 'zmqworker[ray]'", allow_module_level=True
    )

from bench.echo_worker import EchoExtension, EchoWorker  # noqa: E402
from messages import DeviceConfig, SamplingParams  # noqa: E402
from tests.runner_helpers import hf_greedy  # noqa: E402
from tests.test_executor import echo_config  # noqa: E402
from tests.tiny import cached_tiny_checkpoint  # noqa: E402
from zmqworker.executor.errors import (  # noqa: E402
    ExecutorError,
    WorkerDiedError,
    WorkerError,
    WorkerStartupError,
)
from zmqworker.executor.ray_actor import RayWorkerActor  # noqa: E402
from zmqworker.executor.ray_executor import (  # noqa: E402
    Placement,
    RayExecutor,
    order_ranks,
    rank_environments,
)
from zmqworker.frontend.llm import LLM  # noqa: E402

CLUSTER_CPUS = 4


class EnvAtInitWorker(EchoWorker):
    """Records the environment as its constructor saw it (late instantiation)."""

    def __init__(self, *args, **kwargs) -> None:
        self.env_at_init = dict(os.environ)
        super().__init__(*args, **kwargs)


class EnvAtInitExtension(EchoExtension):
    def env_seen_at_init(self, name: str) -> str | None:
        return self.env_at_init.get(name)

    def my_local_rank(self) -> int:
        return self.local_rank


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(
        address="local",
        num_cpus=CLUSTER_CPUS,
        num_gpus=0,
        include_dashboard=False,
        object_store_memory=100 << 20,
        # The actors import this module and bench/ by name: the repository on their path.
        runtime_env={"env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"]}},
    )
    yield ray
    ray.shutdown()


def live_actors() -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("zmqworker-")]  # fmt: skip


def live_placement_groups() -> list[str]:
    return [g["placement_group_id"] for g in ray.util.placement_group_table().values()
            if g["state"] != "REMOVED"]  # fmt: skip


def assert_nothing_left(within: float = 10.0) -> None:
    end = time.monotonic() + within
    while (live_actors() or live_placement_groups()) and time.monotonic() < end:
        time.sleep(0.05)
    assert live_actors() == []
    assert live_placement_groups() == []


@pytest.mark.parametrize("tp, pp", [(1, 2), (2, 1)])
def test_greedy_output_equals_transformers(ray_cluster, tp, pp):
    """Ray's executor as a factory of this process: its engine core runs in a thread
    here, a driver of this test's cluster. (The mp executor's tokens are transformers'
    at every layout: tests/test_engine_e2e.py.)"""
    path = cached_tiny_checkpoint(family="llama", num_layers=4)
    prompts = [[5, 17, 33, 2 + i] for i in range(3)] + [[9] * 11]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(
        model=path,
        executor=RayExecutor,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        kv_cache_bytes=1 << 20,
        max_num_seqs=4,
    ) as llm:
        outputs = [o.token_ids for o in llm.generate(prompts, greedy)]
    assert outputs == [hf_greedy(path, tuple(prompt), 8) for prompt in prompts]
    assert_nothing_left()


def test_executor_environment_reaches_the_worker_constructor(ray_cluster, monkeypatch):
    # Set in the driver after Ray started: an actor can only learn it from the executor.
    monkeypatch.setenv("ZW_RAY_PROPAGATED", "from-driver")
    cfg = echo_config(
        tp=2,
        worker_cls="tests.test_ray_executor.EnvAtInitWorker",
        worker_extension_cls="tests.test_ray_executor.EnvAtInitExtension",
    )
    ex = RayExecutor(
        cfg, env={"ZW_RAY_GIVEN": "given"}, propagate_env=["ZW_RAY_PROPAGATED", "ZW_RAY_UNSET"]
    )
    try:
        assert ex.collective_rpc("env_seen_at_init", ("ZW_RAY_GIVEN",)) == ["given", "given"]
        assert ex.collective_rpc("env_seen_at_init", ("ZW_RAY_PROPAGATED",)) == [
            "from-driver",
            "from-driver",
        ]
        assert ex.collective_rpc("env_seen_at_init", ("ZW_RAY_UNSET",)) == [None, None]
        assert ex.collective_rpc("my_local_rank") == [0, 1]
        assert ex.address.startswith("tcp://127.0.0.1:")
        assert ex.config.parallel.distributed_init_method.startswith("tcp://127.0.0.1:")
        assert len(set(ex.pids)) == 2 and os.getpid() not in ex.pids
        # The data path behaves as with MultiprocExecutor.
        assert ex.collective_rpc("echo", ([1, 2],), unique_reply_rank=1) == [1, 2]
        with pytest.raises(WorkerError) as info:
            ex.collective_rpc("fail_on_rank", (1,))
        assert (info.value.rank, info.value.exc_type) == (1, "RuntimeError")
        assert ex.collective_rpc("echo", (3,)) == [3, 3]
    finally:
        ex.shutdown()
    assert_nothing_left()


def test_killed_actor_fails_pending_calls_fast_and_shutdown_leaves_nothing(ray_cluster):
    ex = RayExecutor(echo_config(tp=2))
    try:
        pending = [ex.collective_rpc("sleep_for", (30,), non_block=True) for _ in range(2)]
        time.sleep(0.2)
        pid = ray.get(ex.actors[1].placement.remote())["pid"]
        node = ex.placements[1].ip
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        for future in pending:
            with pytest.raises(WorkerDiedError) as info:
                future.result(timeout=20)
            assert info.value.rank == 1
        assert time.monotonic() - start < 10.0  # not the 30 s the calls would take
        assert f"rank 1 on node {node}" in str(info.value)
        with pytest.raises(WorkerDiedError):
            ex.collective_rpc("echo", (1,), timeout=5)
    finally:
        ex.shutdown()
        ex.shutdown()
    assert_nothing_left()
    with pytest.raises(ExecutorError, match="shut down"):
        ex.collective_rpc("echo", (1,))


def test_cluster_too_small_fails_before_anything_starts(ray_cluster):
    start = time.monotonic()
    with pytest.raises(WorkerStartupError) as info:
        RayExecutor(echo_config(tp=CLUSTER_CPUS + 2))
    text = str(info.value)
    assert "6 bundle(s) of {CPU: 1, GPU: 0}" in text and f"CPU: {CLUSTER_CPUS}" in text
    gpu = msgspec.structs.replace(echo_config(tp=1), device=DeviceConfig(device="cuda"))
    with pytest.raises(WorkerStartupError, match="GPU: 1.*too little GPU"):
        RayExecutor(gpu)
    assert time.monotonic() - start < 10.0
    assert live_actors() == [] and live_placement_groups() == []


def test_worker_that_cannot_be_built_is_a_startup_error(ray_cluster):
    with pytest.raises(WorkerStartupError) as info:
        RayExecutor(echo_config(tp=2, worker_cls="bench.echo_worker.NoSuchWorker"))
    text = str(info.value)
    assert "prepare_worker failed on rank" in text and "NoSuchWorker" in text
    assert_nothing_left()


def test_ranks_are_grouped_by_node_and_gpus_made_visible():
    # Two nodes with two GPUs each, reported in scrambled order (no cluster needed).
    def place(node: str, gpu: str) -> Placement:
        return Placement(node, f"ip-of-{node}", (gpu,), 100)

    places = [place("node-b", "1"), place("node-a", "3"), place("node-b", "0"),
              place("node-a", "2")]  # fmt: skip
    order = order_ranks(places, driver_node="node-a")
    ranked = [places[i] for i in order]
    assert [(p.node_id, p.gpu_ids[0]) for p in ranked] == [
        ("node-a", "2"),
        ("node-a", "3"),
        ("node-b", "0"),
        ("node-b", "1"),
    ]
    envs, local_ranks = rank_environments(ranked, use_gpu=True, extra={"X": "1"})
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["2,3", "2,3", "0,1", "0,1"]
    assert local_ranks == [0, 1, 0, 1]
    assert all(e["X"] == "1" for e in envs)
    cpu_envs, cpu_local = rank_environments(ranked, use_gpu=False, extra={})
    assert cpu_envs == [{}] * 4 and cpu_local == [0, 1, 0, 1]
    with pytest.raises(WorkerStartupError, match="no GPU"):
        rank_environments([Placement("n", "ip", (), 1)], use_gpu=True, extra={})


def test_an_actor_waits_for_its_welcome_only_as_long_as_it_is_told() -> None:
    """A rank's server ends (status 3, as a worker process's) when no Welcome comes within
    the wait the executor gives it (its start-up bound and a margin), not a fixed 60 s."""
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.linger = 0
    port = router.bind_to_random_port("tcp://127.0.0.1")
    actor = RayWorkerActor()
    actor.assign_rank(0)
    started = time.monotonic()
    try:
        actor.start_server(f"tcp://127.0.0.1:{port}", "token", "tcp://127.0.0.1:*", "",
                           "1048576,1048576,1048576", welcome_timeout_s=0.5,
                           engine_silent_s=None)  # fmt: skip
        assert router.poll(10_000) and len(router.recv_multipart()) == 2  # its Hello
        assert actor.wait_server() == 3
        assert time.monotonic() - started < 10
    finally:
        router.close()
