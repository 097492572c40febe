"""Mixtures of experts on the model runner's Triton path (the CUDA step) on the CPU,
through Triton's interpreter: greedy tokens equal transformers' over the fused experts,
in recorded token graphs (the prefills, padded) and decode graphs; warm-up runs every
tile set a step can choose."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("triton")

from tests.runner_helpers import DEVICE, hf_greedy, make_runner  # noqa: E402
from tests.test_triton_runner import STEP_TOKENS, Recorded, run  # noqa: E402
from tests.tiny import MOE_CHECKPOINTS, cached_tiny_checkpoint  # noqa: E402
from zmqworker.models.moe import SparseMoeBlock  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore:The given buffer is not writable"),
    pytest.mark.skipif(DEVICE.type != "cpu", reason="the GPU runs these in test_model_runner"),
]


def one_layer(family: str) -> str:
    """The tiny mixture of experts of the other tests, one sparse layer of it."""
    kwargs = {**MOE_CHECKPOINTS[family], "num_layers": 1, "tie_word_embeddings": True}
    kwargs.pop("mlp_only_layers", None)
    return cached_tiny_checkpoint(**kwargs)


@pytest.mark.parametrize("family", sorted(MOE_CHECKPOINTS))
def test_fused_experts_give_transformers_greedy_tokens(family: str, monkeypatch) -> None:
    path = one_layer(family)
    runner = make_runner(
        path,
        max_seqs=2,
        max_tokens=STEP_TOKENS,
        kernels="triton",
        graph_capture=Recorded,
        graph_sizes=(2,),
    )
    blocks = [m for m in runner.model.modules() if isinstance(m, SparseMoeBlock)]
    assert len(blocks) == 1 and blocks[0]._fused is not None
    replayed: set[str] = set()
    for graphs in (runner.path.graphs, runner.path.token_graphs):
        assert graphs is not None

        def replay(size: int, graphs=graphs, original=graphs.replay):
            replayed.add(graphs.kind)
            return original(size)

        monkeypatch.setattr(graphs, "replay", replay)
    rng = np.random.default_rng(3)
    prompts = {"a": rng.integers(3, 250, 9).tolist(), "b": rng.integers(3, 250, 5).tolist()}
    max_tokens = {"a": 4, "b": 4}
    result = run(runner, prompts, max_tokens, joins={0: "a", 1: "b"})
    assert replayed == {"decode", "token"}
    for name, prompt in prompts.items():
        assert result[name] == hf_greedy(path, tuple(prompt), max_tokens[name]), name


def test_warm_up_runs_each_tile_set_of_the_fused_experts(monkeypatch) -> None:
    """Each tile set is a compile of its own: decodes reach the first, warm-up's prefills
    the ones whose token counts fit a step (8 experts, top 3: the second from 43 tokens,
    the third from 171)."""
    from zmqworker.models.layers import fused_moe

    seen: set[int] = set()
    tiles_for = fused_moe.tiles_for

    def spy(num_tokens: int, top_k: int, num_local: int, *args):
        tiles = tiles_for(num_tokens, top_k, num_local, *args)
        seen.add(tiles.block_m)
        return tiles

    monkeypatch.setattr(fused_moe, "tiles_for", spy)
    runner = make_runner(one_layer("qwen3_moe"), max_seqs=4, max_tokens=60, kernels="triton")
    assert seen == {16, 32}
    assert {43, 171} <= set(runner.path.prefill_kernel_tokens(4, 180))
