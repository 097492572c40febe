"""Mixture-of-experts models across ranks: greedy tokens equal transformers' for tiny
Qwen3-MoE and Mixtral checkpoints at (tp, pp) in {1, 2} x {1, 2}, with and without
expert parallelism; the engine with expert parallelism over real worker processes; and a
layout whose experts do not divide, refused before any worker starts."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
import torch.multiprocessing as mp

from messages import ModelConfig, ParallelConfig, SamplingParams
from tests.test_models import prompts
from tests.test_moe import greedy, hf_greedy
from tests.test_tp_model import free_port
from tests.tiny import MOE_CHECKPOINTS, PagedDriver, moe_checkpoint
from zmqworker.distributed.parallel_state import (
    ParallelState,
    destroy_parallel_state,
    expert_group_ranks,
    init_parallel_state,
    single_rank_state,
)
from zmqworker.frontend.errors import EngineCoreStartupError
from zmqworker.frontend.llm import LLM
from zmqworker.models.registry import build_model

CPU = torch.device("cpu")
FAMILIES = sorted(MOE_CHECKPOINTS)
NEW_TOKENS = 8


def stages(path: str, state: ParallelState, pp: int) -> list[torch.nn.Module]:
    """The pipeline's stage models in this process (each stage's layers, this TP rank's
    shard): chained by PagedDriver as the stages' ranks chain them."""
    return [
        build_model(ModelConfig(path=path), dataclasses.replace(state, pp_rank=r, pp_size=pp))
        for r in range(pp)
    ]


def layout_tokens(state: ParallelState, paths: dict[str, str]) -> dict[str, list[int]]:
    """Greedy tokens of every family at one and two stages; at tp > 1 with and without
    expert parallelism (state has it on; off, every rank holds a slice of every expert)."""
    layouts = {f"tp{state.tp_size}": state}
    if state.ep_size > 1:
        layouts[f"tp{state.tp_size}-ep"] = state
        layouts[f"tp{state.tp_size}"] = dataclasses.replace(
            state, ep_rank=0, ep_size=1, ep_group=None
        )
    prompt = prompts(lens=(13,))[0]
    out = {}
    for family, path in paths.items():
        for pp in (1, 2):
            for name, layout in layouts.items():
                driver = PagedDriver(stages(path, layout, pp))
                out[f"{family}/{name}/pp{pp}"] = greedy(driver, prompt, NEW_TOKENS)
    return out


def _rank_main(rank: int, init: str, paths: dict[str, str], out_dir: str) -> None:
    torch.set_num_threads(1)
    parallel = ParallelConfig(
        tensor_parallel_size=2, distributed_init_method=init, enable_expert_parallel=True
    )
    state = init_parallel_state(parallel, rank, CPU, timeout_s=60)
    try:
        assert (state.ep_rank, state.ep_size, state.ep_group) == (rank, 2, state.tp_group)
        tokens = layout_tokens(state, paths)
    finally:
        destroy_parallel_state()
    if rank == 0:  # tp = 1, where expert parallelism has nothing to deal out
        tokens.update(layout_tokens(single_rank_state(CPU), paths))
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(tokens, f)


def test_greedy_tokens_equal_transformers_at_every_layout(tmp_path):
    paths = {family: moe_checkpoint(family) for family in FAMILIES}
    prompt = prompts(lens=(13,))[0]
    expected = {family: hf_greedy(path, prompt, NEW_TOKENS) for family, path in paths.items()}
    mp.spawn(
        _rank_main,
        args=(f"tcp://127.0.0.1:{free_port()}", paths, str(tmp_path)),
        nprocs=2,
        join=True,
    )
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert len(results[0]) == 2 * 2 * 3 and len(results[1]) == 2 * 2 * 2
    for result in results:
        for key, tokens in result.items():
            assert tokens == expected[key.split("/")[0]], key


def test_expert_groups_span_the_data_parallel_replicas():
    # tp 2 x pp 2: a replica's 4 ranks follow the previous replica's.
    assert expert_group_ranks(2, 2, 1, 1) == [2, 3]
    assert expert_group_ranks(2, 2, 2, 0) == [0, 1, 4, 5]
    assert expert_group_ranks(2, 2, 2, 1) == [2, 3, 6, 7]


def test_the_engine_serves_a_mixture_of_experts_with_expert_parallelism():
    path = moe_checkpoint("qwen3_moe")
    prompt = prompts(lens=(13,))[0]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLM(
        model=path,
        tensor_parallel_size=2,
        enable_expert_parallel=True,
        block_size=4,
        max_model_len=64,
        kv_cache_bytes=1 << 20,
    ) as llm:
        assert llm.worker_config.parallel.enable_expert_parallel
        [out] = llm.generate([prompt], params)
    assert out.token_ids == hf_greedy(path, prompt, NEW_TOKENS)


def test_experts_that_do_not_divide_are_refused_before_any_worker_starts(tmp_path):
    folder = tmp_path / "seven_experts"
    shutil.copytree(moe_checkpoint("mixtral"), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_local_experts": 7}))

    def no_workers(worker_config):
        raise AssertionError("a worker was about to start")

    with pytest.raises(
        ValueError, match="7 experts are not divisible by the expert-parallel size 2"
    ):
        LLM(
            model=str(folder),
            tensor_parallel_size=2,
            enable_expert_parallel=True,
            executor=no_workers,
        )
    # Without expert parallelism every rank slices each expert: 40 rows split in two. (The
    # factory runs in the engine core, a thread here: its error is the start-up's.)
    with pytest.raises(EngineCoreStartupError, match="a worker was about to start"):
        LLM(model=str(folder), tensor_parallel_size=2, executor=no_workers)
