"""Mixtures of experts on a GPU (ZMQWORKER_TEST_DEVICE=cuda): greedy tokens equal
transformers' with CUDA graphs and without, for Qwen3-MoE and Mixtral; no Triton kernel
compiles after warm-up; no step synchronises the host. On the CPU the same paths run
through Triton's interpreter in test_moe_triton_runner.py."""

from __future__ import annotations

import pytest
import torch

from tests.runner_helpers import (
    DEVICE,
    GREEDY,
    MiniScheduler,
    Pipeline,
    expected,
    make_runner,
    run_scenario,
)
from tests.tiny import MOE_CHECKPOINTS, moe_checkpoint

pytestmark = [
    pytest.mark.filterwarnings("ignore:The given buffer is not writable"),
    pytest.mark.skipif(DEVICE.type != "cuda", reason="the CPU runs these in the interpreter"),
]


@pytest.mark.parametrize("enforce_eager", [False, True])
@pytest.mark.parametrize("family", sorted(MOE_CHECKPOINTS))
def test_greedy_tokens_match_transformers(family: str, enforce_eager: bool) -> None:
    path = moe_checkpoint(family)
    runner = make_runner(path, enforce_eager=enforce_eager)
    assert (runner.graphs is not None) == (not enforce_eager)
    result = run_scenario(path, Pipeline([runner]))
    assert {n: result[n] for n in "abcdef"} == expected(path, result)


def test_no_triton_kernel_compiles_after_warm_up() -> None:
    """Steps of 1 to 200 tokens reach one token's kernels and three of the fused experts'
    tile sets (8 experts, top 3: from 43 and from 171 tokens); warm-up compiled each."""
    from zmqworker.models.layers import fused_moe, moe_sort, one_token_experts

    kernels = [
        moe_sort.route_kernel,
        moe_sort.place_kernel,
        moe_sort.route_place_kernel,
        fused_moe._gate_up_kernel,
        fused_moe._down_kernel,
        fused_moe._combine_kernel,
        one_token_experts._slices_kernel,
        one_token_experts._slices_combine_kernel,
    ]

    def compiled() -> list[int]:
        return [sum(len(cache[0]) for cache in k.device_caches.values()) for k in kernels]

    runner = make_runner(
        moe_checkpoint("qwen3_moe"), max_seqs=8, max_tokens=200, graph_sizes=(1, 2, 4)
    )
    after_warm_up = compiled()
    sched = MiniScheduler(budget=200, seed=3)
    for i, (count, length) in enumerate([(1, 7), (3, 60), (8, 5), (2, 150), (6, 3)]):
        for j in range(count):
            sched.add(f"r{i}-{j}", list(range(5 + j, 5 + j + length)), 3, GREEDY)
        while sched.busy():
            sched.update(runner.execute_model(sched.schedule()).get_output())
    assert compiled() == after_warm_up


def test_steps_never_synchronise_the_host() -> None:
    runner = make_runner(moe_checkpoint("mixtral"), max_seqs=8, max_tokens=64, graph_sizes=(1, 2))
    sched = MiniScheduler(budget=64, seed=9)
    for i in range(4):  # 4 decodes: past the largest graph, so some steps run eagerly
        sched.add(f"s{i}", list(range(10 + i, 30 + i)), 5, GREEDY)
    torch.cuda.set_sync_debug_mode("error")
    try:
        while sched.busy():
            sched.update(runner.execute_model(sched.schedule()).get_output())
    finally:
        torch.cuda.set_sync_debug_mode("default")
