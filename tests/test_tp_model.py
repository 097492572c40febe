"""Tensor parallelism: two gloo processes, each building its shard, give the logits of one
rank; the same processes then form a two-stage pipeline group; and set-up errors."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from messages import ModelConfig, ParallelConfig
from tests.tiny import PagedDriver, cached_tiny_checkpoint
from zmqworker.distributed.parallel_state import (
    GROUP_TIMEOUT_S,
    destroy_parallel_state,
    init_parallel_state,
    single_rank_state,
)
from zmqworker.models.registry import build_model

CPU = torch.device("cpu")
SCHEDULES = [{"a": [5, 9, 200, 31, 7, 64, 3], "b": [11, 12, 13]}, {"a": [40], "b": [249, 1, 77]}]
CASES = {
    "llama_biases": dict(family="llama", attention_bias=True, mlp_bias=True, num_layers=2),
    "qwen2": dict(family="qwen2", num_layers=2, seed=1),
    "qwen3_tied_one_kv_head_odd_vocab": dict(
        family="qwen3", tie_word_embeddings=True, num_kv_heads=1, vocab_size=251, num_layers=2
    ),
}


def run_schedules(model) -> torch.Tensor:
    driver = PagedDriver(model)
    out = []
    for schedule in SCHEDULES:
        out.extend(driver.step(schedule).values())
    return torch.cat(out)


def _tp_rank_main(rank: int, world: int, inits: list[str], paths: dict, out_dir: str) -> None:
    torch.set_num_threads(1)
    parallel = ParallelConfig(tensor_parallel_size=world, distributed_init_method=inits[0])
    state = init_parallel_state(parallel, rank, CPU, timeout_s=60)
    try:
        results = {
            name: run_schedules(build_model(ModelConfig(path=path), state))
            for name, path in paths.items()
        }
    finally:
        destroy_parallel_state()
    # The same two processes as a two-stage pipeline: a PP group and no TP group.
    parallel = ParallelConfig(pipeline_parallel_size=world, distributed_init_method=inits[1])
    state = init_parallel_state(parallel, rank, CPU, timeout_s=60)
    try:
        layout = torch.tensor(
            [state.pp_rank, state.tp_size, state.tp_group is None, state.is_last_stage]
        )
        total = torch.tensor([float(rank + 1)])
        dist.all_reduce(total, group=state.pp_group)
        results["pp_layout"], results["pp_sum"] = layout, total
        # The group's bound on a collective, not torch's 30 minutes (a dead rank's peers).
        timeout = state.pp_group._get_backend(CPU).options._timeout.total_seconds()
        results["pp_timeout"] = torch.tensor([timeout])
    finally:
        destroy_parallel_state()
    save_file(results, f"{out_dir}/rank{rank}.safetensors")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tp2_logits_equal_tp1_and_pp_groups_form(tmp_path):
    paths = {name: cached_tiny_checkpoint(**kwargs) for name, kwargs in CASES.items()}
    inits = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    mp.spawn(_tp_rank_main, args=(2, inits, paths, str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        got = load_file(tmp_path / f"rank{rank}.safetensors")
        assert got["pp_layout"].tolist() == [rank, 1, 1, rank == 1]
        assert got["pp_timeout"].tolist() == [GROUP_TIMEOUT_S]
        assert got["pp_sum"].item() == 3.0
        for name, path in paths.items():
            expected = run_schedules(build_model(ModelConfig(path=path), single_rank_state(CPU)))
            diff = (got[name] - expected).abs().max().item()
            assert diff < 1e-4, f"rank {rank}, {name}: max abs diff {diff}"


def test_single_rank_layout_needs_no_process_group():
    state = init_parallel_state(ParallelConfig(), 0, CPU)
    assert (state.world_size, state.tp_group, state.pp_group) == (1, None, None)
    assert state.is_first_stage and state.is_last_stage
    destroy_parallel_state()
    destroy_parallel_state()


def test_parallel_state_errors_name_the_layout():
    with pytest.raises(ValueError, match="distributed_init_method"):
        init_parallel_state(ParallelConfig(tensor_parallel_size=2), 0, CPU)
    with pytest.raises(ValueError, match="rank 4 is outside the layout tp=2 x pp=2"):
        init_parallel_state(
            ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2), 4, CPU
        )
