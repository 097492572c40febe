"""The disaggregated plan with a decode instance of another tensor parallel size: the
decode engine core's workers get that size and the same blocks as the prefill's, both
instances' CPU workers share the host's cores, on CUDA the decode instance takes the GPUs
after the prefill's where there are enough, and a size the model cannot be cut into is
refused by name before anything starts. Several instances of each role: each prefill
instance's KV on ports of its own, each instance on GPUs of its own where there are
enough; pipeline stages on both sides, each rank's KV on a port of its own, and a decode
instance of other stages; and the roles a router reads from the engine cores'
Readies."""

from __future__ import annotations

import inspect

import pytest

from messages import EngineCoreReady
from tests.tiny import cached_tiny_checkpoint
from zmqworker.cli import build_parser
from zmqworker.cli import serve as serve_cli
from zmqworker.frontend import disaggregated_plan, engine_plan
from zmqworker.frontend.devices import SHARE_GPUS_ENV
from zmqworker.frontend.disaggregated_client import instance_roles
from zmqworker.frontend.disaggregated_plan import DisaggregatedPlan
from zmqworker.frontend.engine_plan import EnginePlan
from zmqworker.frontend.llm import LLM

PREFILL, DECODE = 0, 1  # the engine cores of one prefill and one decode instance


def plan(tp: int, layers: int = 2, **more) -> EnginePlan:
    options = {n: p.default for n, p in inspect.signature(LLM).parameters.items()}
    path = cached_tiny_checkpoint(family="llama", num_layers=layers, vocab_size=256)
    options.update(model=path, tensor_parallel_size=tp, device="cpu", kv_cache_bytes=4096)
    return EnginePlan.from_options({**options, **more})


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)])
def test_the_decode_instance_takes_its_own_size(prefill_tp: int, decode_tp: int) -> None:
    pair = DisaggregatedPlan.of(plan(prefill_tp), decode_tp=decode_tp)
    prefill = pair.engine_config(PREFILL, "ipc:///x", "t").worker
    decode = pair.engine_config(DECODE, "ipc:///y", "t").worker
    assert prefill.parallel.tensor_parallel_size == prefill_tp
    assert decode.parallel.tensor_parallel_size == decode_tp
    # The same blocks on both sides: bytes per worker scale with the heads each holds.
    assert decode.cache.kv_cache_bytes * decode_tp == 4096 * prefill_tp
    assert prefill.kv_transfer.role == "producer" and decode.kv_transfer.role == "consumer"


def test_the_two_instances_share_the_host() -> None:
    """On the CPU both instances' workers divide the host's cores over the pair's ranks
    (the worker's rule, told of the other instance: host_ranks), the decode's ranks
    placed after the prefill's only where the GPUs suffice (not on the CPU)."""
    pair = DisaggregatedPlan.of(plan(1), decode_tp=2)
    for index in (PREFILL, DECODE):
        parallel = pair.engine_config(index, "ipc:///x", "t").worker.parallel
        assert parallel.host_ranks == 3 and parallel.first_local_rank == 0


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "gpus", "decode_first"),
    [(2, 2, 4, 2), (1, 2, 3, 1), (2, 2, 3, 0), (1, 1, 1, 0)],
)
def test_cuda_places_the_decode_instance_after_the_prefill_s_gpus(
    monkeypatch, prefill_tp: int, decode_tp: int, gpus: int, decode_first: int
) -> None:
    """Apart where the GPUs suffice for both (the decode's from the GPU after the
    prefill's, each sized by memory: no kv_cache_bytes needed, and where given, the
    decode's scaled to the same blocks), sharing them from the first on fewer, where
    kv_cache_bytes is required, named in the error."""
    monkeypatch.setattr(disaggregated_plan, "visible_gpu_count", lambda: gpus)
    monkeypatch.setattr(engine_plan, "visible_gpu_count", lambda: gpus)
    monkeypatch.setenv(SHARE_GPUS_ENV, "1")
    pair = DisaggregatedPlan.of(plan(prefill_tp, device="cuda"), decode_tp=decode_tp)
    prefill = pair.engine_config(PREFILL, "ipc:///x", "t").worker
    decode = pair.engine_config(DECODE, "ipc:///y", "t").worker
    assert prefill.parallel.first_local_rank == 0
    assert decode.parallel.first_local_rank == decode_first
    assert decode.cache.kv_cache_bytes * decode_tp == 4096 * prefill_tp
    sized_by_memory = plan(prefill_tp, device="cuda", kv_cache_bytes=None)
    if decode_first:
        DisaggregatedPlan.of(sized_by_memory, decode_tp=decode_tp)
    else:
        named = f"{gpus} GPU.* visible for {prefill_tp} prefill and {decode_tp} decode"
        with pytest.raises(ValueError, match=f"{named}.*share the GPUs, so give --kv-cache-bytes"):
            DisaggregatedPlan.of(sized_by_memory, decode_tp=decode_tp)


def test_a_pair_of_ray_workers_shares_the_gpus(monkeypatch) -> None:
    """Ray places the workers itself (and may spread them over hosts): the planner
    neither places the decode instance apart nor counts the host's ranks."""
    monkeypatch.setattr(disaggregated_plan, "visible_gpu_count", lambda: 4)
    monkeypatch.setattr(engine_plan, "visible_gpu_count", lambda: 4)
    pair = DisaggregatedPlan.of(plan(1, device="cuda", executor="ray"))
    decode = pair.engine_config(DECODE, "ipc:///y", "t").worker.parallel
    assert decode.first_local_rank == 0 and decode.host_ranks == 0


def test_the_decode_instance_takes_its_own_stages(monkeypatch) -> None:
    """Prefill tp 1 over two stages, decode tp 2 over one: the decode's workers get that
    layout and the same blocks (bytes by the layers of the largest stage and the heads of
    a rank), and on CUDA its GPUs start after the prefill's two."""
    monkeypatch.setattr(disaggregated_plan, "visible_gpu_count", lambda: 4)
    monkeypatch.setattr(engine_plan, "visible_gpu_count", lambda: 4)
    monkeypatch.setenv(SHARE_GPUS_ENV, "1")
    two = plan(1, device="cuda", pipeline_parallel_size=2)
    pair = DisaggregatedPlan.of(two, decode_tp=2, decode_pp=1)
    prefill = pair.engine_config(PREFILL, "ipc:///x", "t").worker
    decode = pair.engine_config(DECODE, "ipc:///y", "t").worker
    assert prefill.parallel.pipeline_parallel_size == 2
    assert (decode.parallel.tensor_parallel_size, decode.parallel.pipeline_parallel_size) == (2, 1)
    assert decode.cache.kv_cache_bytes == 4096
    assert [w.parallel.first_local_rank for w in (prefill, decode)] == [0, 2]
    assert {w.parallel.host_ranks for w in (prefill, decode)} == {4}
    flat = DisaggregatedPlan.of(plan(1), decode_pp=2).engine_config(DECODE, "ipc:///y", "t")
    assert flat.worker.parallel.pipeline_parallel_size == 2
    assert flat.worker.cache.kv_cache_bytes == 2048
    # Three layers over two decode stages: the first holds two, and takes 2/3 of the bytes.
    uneven = DisaggregatedPlan.of(plan(1, layers=3), decode_pp=2)
    assert uneven.engine_config(DECODE, "ipc:///y", "t").worker.cache.kv_cache_bytes == 2731


def test_a_decode_size_the_model_cannot_take_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="prefill tensor parallel size 2 and decode 3, "
                       "prefill pipeline stages 1 and decode 1: "
                       "tensor_parallel_size=3 must divide"):  # fmt: skip
        DisaggregatedPlan.of(plan(2), decode_tp=3)
    with pytest.raises(ValueError, match="decode tensor parallel size must be >= 1"):
        DisaggregatedPlan.of(plan(2), decode_tp=0)
    with pytest.raises(ValueError, match="prefill pipeline stages 1 and decode 3: "
                       "pipeline_parallel_size=3 is more than the model's 2 layers"):  # fmt: skip
        DisaggregatedPlan.of(plan(2), decode_pp=3)
    with pytest.raises(ValueError, match="decode pipeline stages must be >= 1"):
        DisaggregatedPlan.of(plan(2), decode_pp=0)


@pytest.mark.parametrize(
    "flag, name",
    [
        ("--decode-tensor-parallel-size", "decode_tensor_parallel_size"),
        ("--decode-pipeline-parallel-size", "decode_pipeline_parallel_size"),
        ("--kv-port", "kv_port"),
        ("--kv-transfer-timeout", "kv_transfer_timeout_s"),
        ("--prefill-instances", "prefill_instances"),
        ("--decode-instances", "decode_instances"),
        ("--max-local-prefill-tokens", "max_local_prefill_tokens"),
    ],
)
def test_an_option_of_the_pair_needs_disaggregate(flag: str, name: str) -> None:
    """Refused by name before the model folder is opened, from the CLI and from LLM."""
    parser, _ = build_parser()
    args = parser.parse_args(["serve", "--model", "no/such/model", flag, "2"])
    with pytest.raises(ValueError, match=f"{name}=2.* needs disaggregate=True"):
        serve_cli.run(args)
    with pytest.raises(ValueError, match=f"{name}=2.* needs disaggregate=True"):
        LLM(model="no/such/model", **{name: 2})


def test_several_instances_of_each_role_each_have_their_ports_and_gpus(monkeypatch) -> None:
    """Two prefill instances of tp 1 and two decode instances of tp 2: engine cores 0, 1
    prefill, their KV on ports kv_port and kv_port + 1, then 2, 3 decode; on six GPUs
    each on GPUs of its own (0, 1, 2-3, 4-5), and every worker counts the host's six
    ranks. On fewer, all share them."""
    monkeypatch.setattr(disaggregated_plan, "visible_gpu_count", lambda: 6)
    monkeypatch.setattr(engine_plan, "visible_gpu_count", lambda: 6)
    monkeypatch.setenv(SHARE_GPUS_ENV, "1")
    pair = DisaggregatedPlan.of(plan(1, device="cuda"), 47000, 30.0, 2, prefills=2, decodes=2)
    assert pair.num_engines == 4
    workers = [pair.engine_config(i, f"ipc:///{i}", "t").worker for i in range(4)]
    assert [w.kv_transfer.role for w in workers] == ["producer"] * 2 + ["consumer"] * 2
    assert [w.kv_transfer.port for w in workers[:2]] == [47000, 47001]
    assert [w.parallel.first_local_rank for w in workers] == [0, 1, 2, 4]
    assert [w.parallel.tensor_parallel_size for w in workers] == [1, 1, 2, 2]
    assert all(w.parallel.host_ranks == 6 for w in workers)
    monkeypatch.setattr(disaggregated_plan, "visible_gpu_count", lambda: 5)
    shared = DisaggregatedPlan.of(plan(1, device="cuda"), 47000, 30.0, 2, 2, 2)
    assert {shared.engine_config(i, "ipc:///x", "t").worker.parallel.first_local_rank
            for i in range(4)} == {0}  # fmt: skip
    with pytest.raises(ValueError, match="this deployment runs 4"):
        shared.engine_config(4, "ipc:///x", "t")
    with pytest.raises(ValueError, match="--decode-instances must be >= 1, got 0"):
        DisaggregatedPlan.of(plan(1), decodes=0)
    with pytest.raises(ValueError, match="--kv-port must leave 2 port"):
        DisaggregatedPlan.of(plan(1), 65535, prefills=2)


def test_pipeline_stages_give_each_instance_a_port_and_a_gpu_a_rank(monkeypatch) -> None:
    """Two stages on both sides (a decode stage pulls from the prefill stage of its
    number): two prefill instances of tp 1, their KV on ports kv_port .. kv_port + 1 and
    kv_port + 2 .. + 3 (one a rank), then a decode instance of tp 2 on GPUs 4-7."""
    monkeypatch.setattr(disaggregated_plan, "visible_gpu_count", lambda: 8)
    monkeypatch.setattr(engine_plan, "visible_gpu_count", lambda: 8)
    monkeypatch.setenv(SHARE_GPUS_ENV, "1")
    two = plan(1, device="cuda", pipeline_parallel_size=2)
    pair = DisaggregatedPlan.of(two, 47000, 30.0, 2, prefills=2, decodes=1)
    workers = [pair.engine_config(i, f"ipc:///{i}", "t").worker for i in range(3)]
    assert [w.kv_transfer.port for w in workers[:2]] == [47000, 47002]
    assert [w.parallel.pipeline_parallel_size for w in workers] == [2, 2, 2]
    assert [w.parallel.first_local_rank for w in workers] == [0, 2, 4]
    assert all(w.parallel.host_ranks == 8 for w in workers)
    with pytest.raises(ValueError, match="--kv-port must leave 4 port"):
        DisaggregatedPlan.of(plan(1, pipeline_parallel_size=2), 65533, prefills=2)


def test_a_router_tells_the_roles_from_the_readies() -> None:
    """Each engine core's KV transfer role; one of neither, or a deployment without a
    prefill or a decode instance, refused by name."""

    def ready(index: int, role: str) -> EngineCoreReady:
        return EngineCoreReady(index, 96, 8, 4, 8, 256, 1, 100 + index, kv_role=role)

    def roles(*readies: EngineCoreReady) -> list[str]:
        return instance_roles(
            readies, [f"engine core {i} at tcp://h{i}:1" for i in range(3)][: len(readies)]
        )

    readies = [ready(0, "consumer"), ready(1, "producer"), ready(2, "producer")]
    assert roles(*readies) == ["decode", "prefill", "prefill"]
    with pytest.raises(ValueError, match="engine core 1 at tcp://h1:1 has no KV transfer"):
        roles(ready(0, "producer"), ready(0, ""))  # engine cores served alone all say 0
    with pytest.raises(ValueError, match="KV transfer role 'both'"):
        roles(ready(0, "both"), ready(1, "consumer"))
    with pytest.raises(ValueError, match="needs a decode instance among its 2 engine core"):
        roles(ready(0, "producer"), ready(1, "producer"))


def test_a_pair_takes_no_engine_cores_in_this_process() -> None:
    with pytest.raises(ValueError, match="disaggregate runs its engine cores as processes"):
        in_process = plan(1, executor=lambda config: None)
        DisaggregatedPlan.from_options(in_process, {"disaggregate": True})
