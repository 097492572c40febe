"""The torch Worker in process on the CPU with a tiny model: the start-up order, steps,
sleep and wake at both levels, the profiler, health, shutdown, and the WorkerWrapper."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from messages import (
    CacheConfig,
    CachedRequestData,
    DeviceConfig,
    ModelConfig,
    NewRequestData,
    ParallelConfig,
    ProfilerConfig,
    SamplingParams,
    SchedulerConfig,
    SchedulerOutput,
    WorkerConfig,
    make_kv_cache_config,
)
from messages.kv_transfer import KVConnectorMetadata, KVSave, KVTransferConfig
from tests.tiny import cached_tiny_checkpoint
from zmqworker.model_runner.async_output import AsyncModelRunnerOutput
from zmqworker.transport.curve import KV_CURVE_ENV, KVKeys
from zmqworker.worker.torch_worker import Worker
from zmqworker.worker.wrapper import WorkerWrapper, with_extension

BLOCK = 4
# ZMQWORKER_TEST_DEVICE=cuda runs these workers on a GPU (checked on the lent H200).
DEVICE = os.environ.get("ZMQWORKER_TEST_DEVICE", "cpu")
PROMPT = [5, 17, 42, 9, 100, 3, 77]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config(**kw) -> WorkerConfig:
    return WorkerConfig(
        model=ModelConfig(
            path=cached_tiny_checkpoint(family="llama", num_layers=4), max_model_len=128
        ),
        cache=CacheConfig(block_size=BLOCK, kv_cache_bytes=kw.pop("kv_cache_bytes", 1 << 20)),
        scheduler=SchedulerConfig(
            max_num_seqs=4, max_num_batched_tokens=64, warmup_batch_sizes=[1, 2]
        ),
        device=kw.pop("device", DeviceConfig(device=DEVICE)),
        **kw,
    )


def started(cfg: WorkerConfig | None = None) -> Worker:
    """A worker taken through the whole start-up order, the engine's part included."""
    w = Worker(cfg or config(), rank=0)
    w.init_device()
    w.load_model()
    available = w.determine_available_memory()
    spec = w.get_kv_cache_spec()
    num_blocks = available // (spec.page_size_bytes * len(spec.layer_names))
    assert num_blocks > 0
    w.initialize_from_config(make_kv_cache_config([spec], min(num_blocks, 64)))
    assert w.compile_or_warm_up_model() >= 0.0
    return w


def output(result) -> np.ndarray:
    assert isinstance(result, AsyncModelRunnerOutput)
    return result.get_output().sampled_token_ids


def generate(w: Worker, handle: int, steps: int = 6) -> list[int]:
    """Greedy tokens of PROMPT through execute_model, prefill then decode, then finish."""
    blocks = np.array([7, 2, 11, 5], np.int32) + handle * 4  # shuffled, per request
    new = NewRequestData(
        req_id=f"r{handle}",
        req_handle=handle,
        prompt_token_ids=np.array(PROMPT, np.int32),
        sampling_params=SamplingParams(temperature=0.0),
        block_ids=blocks,
        num_scheduled_tokens=len(PROMPT),
    )
    tokens = [
        int(
            output(w.execute_model(SchedulerOutput([new], CachedRequestData.empty(), len(PROMPT))))[
                0
            ]
        )
    ]
    for i in range(steps - 1):
        cached = CachedRequestData.build([handle], [len(PROMPT) + i], [1])
        tokens.append(int(output(w.execute_model(SchedulerOutput([], cached, 1)))[0]))
    w.execute_model(
        SchedulerOutput([], CachedRequestData.empty(), 0, finished_req_handles=[handle])
    )
    return tokens


def storage_bytes(tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


def test_startup_order_steps_and_shutdown_twice():
    w = started()
    first = generate(w, 1)
    assert generate(w, 2) == first  # same prompt, other blocks, same greedy tokens
    w.check_health()
    w.shutdown()
    w.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        w.execute_model(SchedulerOutput([], CachedRequestData.empty(), 0))


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_releases_memory_and_wake_restores_outputs(level):
    w = started()
    before = generate(w, 1)
    runner = w.model_runner
    kv_bytes = storage_bytes(runner.kv_caches)
    weight_bytes = storage_bytes(runner.model.parameters())
    assert kv_bytes > 0 and weight_bytes > 0
    device_before = torch.cuda.memory_allocated() if DEVICE == "cuda" else 0
    pools = []
    for _ in range(2):
        w.sleep(level)
        assert runner.graphs is None or not runner.graphs.captured
        assert storage_bytes(runner.kv_caches) == 0
        if DEVICE == "cuda":  # the device memory itself is given back
            torch.cuda.synchronize()
            assert torch.cuda.memory_allocated() <= device_before - kv_bytes - weight_bytes // 2
        # The parameters let go of their storage at both levels; level 1 keeps a copy in
        # the host pool (made once, then reused), level 2 keeps nothing.
        assert storage_bytes(runner.model.parameters()) == 0
        pool = w._sleep._pool.buffer
        assert (pool.numel() >= weight_bytes) == (level == 1)
        pools.append(pool.data_ptr())
        with pytest.raises(RuntimeError, match="asleep"):
            w.execute_model(SchedulerOutput([], CachedRequestData.empty(), 0))
        w.wake_up(["weights"])
        assert storage_bytes(runner.model.parameters()) == weight_bytes
        assert storage_bytes(runner.kv_caches) == 0
        w.wake_up(["kv_cache"])
        assert storage_bytes(runner.kv_caches) == kv_bytes
        # On CUDA the decode steps replay graphs again, captured over the new memory.
        assert (runner.graphs is not None and runner.graphs.captured) == (DEVICE == "cuda")
        if level == 2:  # the weights' memory came back, not their values
            with pytest.raises(RuntimeError, match=r"released by sleep\(level=2\)"):
                w.execute_model(SchedulerOutput([], CachedRequestData.empty(), 0))
            w.reload_weights()
        assert generate(w, 3) == before
    assert level == 2 or pools[0] == pools[1]
    w.shutdown()


def test_sleep_is_refused_while_a_prefill_s_kv_waits_in_the_cache(monkeypatch):
    """A producer's staged KV stays in its cache blocks until a puller takes it: sleep
    (which would release that cache) is refused by name until it is gone (here: expired),
    then goes ahead."""
    monkeypatch.setenv(KV_CURVE_ENV, KVKeys.new().to_env())
    transfer = KVTransferConfig(role="producer", port=free_port(), timeout_s=0.3)
    w = started(config(kv_transfer=transfer))
    generate(w, 1)
    save = KVSave("waiting", np.array([3], np.int32), 2)
    w.kv_connector.after_step(KVConnectorMetadata(saves=[save]))
    with pytest.raises(RuntimeError, match=r"KV of 1 request\(s\) staged for transfer"):
        w.sleep(1)
    deadline = time.monotonic() + 10
    while w.kv_connector.num_cache_readers:
        assert time.monotonic() < deadline, "the staged KV never expired"
        w.kv_connector.take_output(wait_s=0.05)
    w.sleep(1)
    w.wake_up()
    w.shutdown()


def test_sleep_and_wake_errors():
    w = started()
    with pytest.raises(ValueError, match="level"):
        w.sleep(3)
    w.sleep(1)
    with pytest.raises(RuntimeError, match="already asleep"):
        w.sleep(1)
    with pytest.raises(ValueError, match="unknown wake_up tags"):
        w.wake_up(["gpu"])
    w.wake_up()
    w.shutdown()


def test_the_kv_cache_stays_while_a_request_is_unfinished():
    """A new cache or a warm-up would overwrite the KV an unfinished request reads: both
    are refused naming it (before the memory check, whose free memory leaves out the
    cache in use); sleep and wake_up, whose loss of the KV is documented, still run."""
    w = started()
    params = SamplingParams(temperature=0.0)
    blocks = np.array([0, 1], np.int32)
    new = NewRequestData("held", 9, np.array(PROMPT, np.int32), params, blocks, len(PROMPT))
    w.execute_model(SchedulerOutput([new], CachedRequestData.empty(), len(PROMPT)))
    too_large = make_kv_cache_config([w.get_kv_cache_spec()], 1 << 20)
    for call in (lambda: w.initialize_from_config(too_large), w.compile_or_warm_up_model):
        with pytest.raises(RuntimeError, match="request 'held' \\(handle 9\\) among them"):
            call()
    w.sleep(1)
    w.wake_up()
    assert storage_bytes(w.model_runner.kv_caches) > 0 and len(w.model_runner.batch) == 1
    w.shutdown()


def test_profiler_writes_a_chrome_trace(tmp_path):
    w = started(config(profiler=ProfilerConfig(profiler="torch", output_dir=str(tmp_path))))
    w.profile(True)
    generate(w, 1, steps=2)
    w.profile(False)
    traces = list(tmp_path.glob("rank0-*.trace.json"))
    assert len(traces) == 1
    events = json.loads(traces[0].read_text())["traceEvents"]
    assert any("aten::" in e.get("name", "") for e in events)
    w.shutdown()


def test_profiler_errors_name_the_setting():
    with pytest.raises(ValueError, match="profiler.profiler"):
        Worker(config(profiler=ProfilerConfig(profiler="nsys")), rank=0)
    w = Worker(config(), rank=0)
    with pytest.raises(RuntimeError, match="profiler.profiler"):
        w.profile(True)


def test_kv_cache_that_does_not_fit_is_refused_with_numbers():
    w = Worker(config(kv_cache_bytes=4096), rank=0)
    w.init_device()
    w.load_model()
    assert w.determine_available_memory() == 4096
    spec = w.get_kv_cache_spec()
    with pytest.raises(ValueError, match=r"1000 blocks needs \d+ bytes.*only 4096 bytes"):
        w.initialize_from_config(make_kv_cache_config([spec], 1000))
    w.shutdown()


def test_memory_budget_is_measured_when_no_kv_bytes_given():
    cfg = msgspec.structs.replace(config(), cache=CacheConfig(block_size=BLOCK))
    w = Worker(cfg, rank=0)
    w.init_device()
    w.load_model()
    available = w.determine_available_memory()
    total = torch.cuda.mem_get_info()[1] if DEVICE == "cuda" else w._host_free_at_start
    assert 0 < available < total
    w.shutdown()


@pytest.mark.skipif(DEVICE != "cpu", reason="the host's memory is a CPU worker's budget")
def test_a_cpu_worker_s_memory_share_counts_the_host_s_ranks():
    """cpu_memory_fraction of the host is shared by every rank on it: a worker told of
    four (host_ranks: a disaggregated pair's, say) takes a quarter of what one alone
    does, the weights and activations taken off each alike."""
    available = []
    for host_ranks in (1, 4):
        parallel = ParallelConfig(host_ranks=host_ranks)
        cfg = msgspec.structs.replace(config(), cache=CacheConfig(block_size=BLOCK),
                                      parallel=parallel)  # fmt: skip
        w = Worker(cfg, rank=0)
        w.init_device()
        w._host_free_at_start = 64 << 30  # as if measured: the same host for both
        w.load_model()
        available.append(w.determine_available_memory())
        w.shutdown()
    share = int((64 << 30) * CacheConfig().cpu_memory_fraction)
    assert abs((available[0] - available[1]) - (share - share // 4)) < 256 << 20


def test_shutdown_after_a_failed_init_device():
    bad = msgspec.structs.replace(
        config(), device=msgspec.structs.replace(config().device, device="tpu")
    )
    with pytest.raises(ValueError, match="device must be"):
        Worker(bad, rank=0)
    w = Worker(config(device=DeviceConfig(device="cuda")), rank=0)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no GPU is visible"):
            w.init_device()
    w.shutdown()
    w.shutdown()


THREADS_SCRIPT = """
import sys
import torch
from messages import DeviceConfig, ModelConfig, ParallelConfig, WorkerConfig
from zmqworker.worker.wrapper import WorkerWrapper
late = dict(arg.split("=", 1) for arg in sys.argv[1:])
host_ranks = int(late.pop("host_ranks", 0))
w = WorkerWrapper(rpc_rank=0)
w.update_environment(late)  # as a Welcome's env does, torch long imported
config = WorkerConfig(model=ModelConfig(path="unused"), device=DeviceConfig(device="cpu"),
                      parallel=ParallelConfig(host_ranks=host_ranks))
w.init_worker(config)
w.init_device()
print(torch.get_num_threads())
w.shutdown()
"""


@pytest.mark.parametrize(
    ("at_start", "late", "host_ranks", "expected"),
    [
        (None, None, 0, "cores"),
        ("1", None, 0, 1),
        (None, "1", 0, 1),
        ("abc", None, 0, "cores"),
        (None, None, 2, "half the cores"),
        ("1", None, 2, 1),
    ],
)
def test_cpu_threads_follow_omp_num_threads_else_the_cores(at_start, late, host_ranks, expected):
    """A CPU worker with no num_threads takes OMP_NUM_THREADS when it is a count (Ray
    sets it to the actor's CPUs), set as the process starts or later by the engine's
    environment for the rank; else the cores it may run on, shared among the workers
    of the host (host_ranks: a disaggregated pair's, both instances')."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if at_start is not None:
        env["OMP_NUM_THREADS"] = at_start
    args = [] if late is None else [f"OMP_NUM_THREADS={late}"]
    args += [f"host_ranks={host_ranks}"]
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", THREADS_SCRIPT, *args], env=env, cwd=root,
                         capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    if expected == "cores":
        expected = len(os.sched_getaffinity(0))
    elif expected == "half the cores":
        expected = max(1, len(os.sched_getaffinity(0)) // 2)
    assert int(out.stdout.strip().splitlines()[-1]) == expected


STEP_MEMORY_SCRIPT = """
import resource, sys
import torch
from zmqworker.worker.host_malloc import keep_freed_memory
if sys.argv[1] == "kept":
    assert keep_freed_memory()
def step():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    temporaries = [torch.ones(n << 18) for n in (24, 8, 16, 4, 12)]  # MB, as activations
    del temporaries
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(*[step() for _ in range(8)])
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_step_memory_stays_mapped_once_kept():
    """With keep_freed_memory (a CPU worker's, after warm-up), step-sized temporaries are
    mostly reused from the second step on; without it, glibc gives them back and the next
    steps fault them in again (host_malloc.py).

    Which later step faults, and how much, varies from run to run with the address layout
    (kept: up to 5k of a step's 16k pages fault again, in one or two of seven steps; plain:
    the second step faults all of them again, later ones all or none). So the test asks
    that the kept process's seven later steps together fault less than its first one, and
    that the plain one's second step alone faults more than half as much as its first."""
    root = Path(__file__).resolve().parent.parent
    faults = {}
    for how in ("kept", "plain"):
        out = subprocess.run([sys.executable, "-c", STEP_MEMORY_SCRIPT, how], cwd=root,
                             capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
        faults[how] = [int(n) for n in out.stdout.split()]
    kept, plain = faults["kept"], faults["plain"]
    assert sum(kept[1:]) < kept[0] and plain[1] > plain[0] / 2, faults


class Extension:
    def double(self, x: int) -> int:
        return 2 * x

    def tagged(self, tag: str, *extra: int, step: SchedulerOutput | None) -> str:
        return f"{tag}{len(extra)}{step is None}"

    def call_of(self, *, call_id: int = 0, deadline: float = 0.0) -> list:
        return [call_id, deadline]

    def id_of(self, *, call_id: int = 0) -> int:
        return call_id


class Clash:
    def load_model(self) -> None:
        raise AssertionError("never called")


def test_wrapper_late_instantiation_extension_and_allowlist(monkeypatch):
    monkeypatch.delenv("ZMQWORKER_TEST_SEEN", raising=False)
    wrapper = WorkerWrapper(rpc_rank=1)
    with pytest.raises(AttributeError, match="does not exist yet"):
        wrapper.rank  # noqa: B018
    wrapper.update_environment({"ZMQWORKER_TEST_SEEN": "rank1"})
    cfg = msgspec.structs.replace(
        config(),
        worker_cls="tests.test_worker.EnvProbeWorker",
        worker_extension_cls="tests.test_worker.Extension",
        parallel=msgspec.structs.replace(config().parallel, tensor_parallel_size=2),
    )
    wrapper.init_worker(cfg)
    assert wrapper.worker.seen_at_init == "rank1"
    assert wrapper.rank == 1  # forwarded attribute
    assert wrapper.execute_method("double", 21) == 42
    # The call's id and deadline reach the methods that take them, keyword-only.
    assert wrapper.execute_method("call_of", call_id=7, deadline=12.5) == [7, 12.5]
    assert wrapper.execute_method("id_of", call_id=7, deadline=12.5) == 7
    assert wrapper.execute_method("double", 4, call_id=7, deadline=12.5) == 8
    # Message arguments are checked by name past *args, and unions with None take None.
    empty = SchedulerOutput([], CachedRequestData.empty(), 0)
    assert wrapper.execute_method("tagged", "a", 1, 2, step=empty) == "a2False"
    assert wrapper.execute_method("tagged", "b", step=None) == "b0True"
    with pytest.raises(TypeError, match="^tagged: step must be a SchedulerOutput or None, got int"):
        wrapper.execute_method("tagged", "c", step=5)
    with pytest.raises(TypeError, match="grammar_output must be a GrammarOutput or None, got str"):
        wrapper.execute_method("sample_tokens", "not a grammar output")
    assert "double" in wrapper.rpc_methods and "load_model" in wrapper.rpc_methods
    with pytest.raises(AttributeError, match="not callable over RPC"):
        wrapper.execute_method("_runner")
    with pytest.raises(AttributeError, match="not callable over RPC"):
        wrapper.execute_method("seen_at_init")
    with pytest.raises(ValueError, match="redefines load_model"):
        with_extension(Worker, Clash)
    assert not hasattr(Worker, "double")  # the worker class itself is untouched
    with pytest.raises(ValueError, match="no class"):
        WorkerWrapper(0).init_worker(
            msgspec.structs.replace(cfg, worker_cls="zmqworker.worker.torch_worker.Nope")
        )


class EnvProbeWorker(Worker):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen_at_init = os.environ.get("ZMQWORKER_TEST_SEEN")


TP_SCRIPT = textwrap.dedent(
    """
    import json, sys, msgspec
    from messages import ParallelConfig
    from messages import make_kv_cache_config
    from tests.test_worker import config, generate
    from zmqworker.worker.torch_worker import Worker
    rank, init = int(sys.argv[1]), sys.argv[2]
    cfg = msgspec.structs.replace(config(), parallel=ParallelConfig(
        tensor_parallel_size=2, distributed_init_method=init))
    w = Worker(cfg, rank=rank)
    w.init_device()
    w.load_model()
    spec = w.get_kv_cache_spec()
    w.initialize_from_config(make_kv_cache_config([spec], 64))
    out = {"tp_rank": w.state.tp_rank, "heads": spec.num_kv_heads, "tokens": generate(w, 1)}
    w.shutdown()
    print(json.dumps(out))
    """
)


@pytest.mark.skipif(
    DEVICE == "cuda" and torch.cuda.device_count() < 2, reason="NCCL needs a GPU per rank"
)
def test_two_ranks_start_distributed_with_tp2():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parent.parent
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", TP_SCRIPT, str(r), f"tcp://127.0.0.1:{port}"],
            stdout=subprocess.PIPE,
            text=True,
            cwd=root,
        )
        for r in range(2)
    ]
    outs = [json.loads(p.communicate(timeout=240)[0].strip().splitlines()[-1]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert [o["tp_rank"] for o in outs] == [0, 1]
    assert outs[0]["tokens"] == outs[1]["tokens"]
    single = started()
    assert outs[0]["tokens"] == generate(single, 1)
    single.shutdown()
