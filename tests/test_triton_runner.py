"""The model runner's Triton path (the CUDA step) on the CPU, through Triton's
interpreter: persistent device inputs, the on-device token feed and the graphs' padded
replays (decode and token graphs), with a recorder standing in for CUDA graph capture.
Greedy tokens must equal transformers'. The same paths run on a GPU in
test_model_runner.py."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from messages import (  # noqa: E402
    CachedRequestData,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
)
from tests.runner_helpers import (  # noqa: E402
    DEVICE,
    GREEDY,
    MiniScheduler,
    Pipeline,
    hf_greedy,
    hf_model,
    make_runner,
)
from tests.tiny import cached_tiny_checkpoint  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore:The given buffer is not writable"),
    pytest.mark.skipif(DEVICE.type != "cpu", reason="the GPU runs these in test_model_runner"),
]


class Recorded:
    """A 'graph' that replays the captured function: the buffers, padding and outputs of
    the graph path, without CUDA."""

    replays = 0

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn

    def replay(self) -> None:
        Recorded.replays += 1
        self.fn()


# Every step here has at most 14 tokens (run()'s budget is 12): one token graph of 16
# covers them all, and warm-up captures and compiles nothing larger that no step uses.
STEP_TOKENS = 16


def small_checkpoint(family: str) -> str:
    return cached_tiny_checkpoint(family=family, num_layers=2, tie_word_embeddings=True)


def run(
    runner,
    prompts: dict[str, list[int]],
    max_tokens: dict[str, int],
    joins: dict[int, str],
    params: SamplingParams | dict[str, SamplingParams] = GREEDY,
):
    """Requests joining at the given steps; two in flight at most under a 12-token budget.
    params: every request's, or each's by name (GREEDY for the others)."""
    sched = MiniScheduler(budget=12, seed=7)
    reqs = {}
    step = 0
    pipeline = Pipeline([runner])
    while step == 0 or sched.busy() or len(reqs) < len(prompts):
        name = joins.get(step)
        if name is not None:
            own = params.get(name, GREEDY) if isinstance(params, dict) else params
            reqs[name] = sched.add(name, prompts[name], max_tokens[name], own)
        sched.update(pipeline.step(sched.schedule()))
        step += 1
        assert step < 80
    return {name: r.outputs for name, r in reqs.items()}


def spy_on_sampler(runner) -> list[bool]:
    """The all_greedy flag of every call of the runner's sampler, as it comes."""
    calls: list[bool] = []
    sampler = runner.sampler

    def spy(logits, metadata, out=None):
        calls.append(metadata.all_greedy)
        return sampler(logits, metadata, out)

    runner.sampler = spy
    return calls


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_triton_path_greedy_tokens_match_transformers(family: str) -> None:
    """Chunked prefill, decodes in graphs of 2 and 4 (3 requests pad to 4), a request that
    finishes while the next takes its batch row with a longer prompt: a stale token feed
    would corrupt that prompt."""
    path = small_checkpoint(family)
    runner = make_runner(
        path,
        max_seqs=4,
        max_tokens=STEP_TOKENS,
        kernels="triton",
        graph_capture=Recorded,
        graph_sizes=(2, 4),
    )
    assert runner.graphs is not None and runner.graphs.captured
    rng = np.random.default_rng(0)
    prompts = {
        name: rng.integers(3, 250, n).tolist()
        for name, n in [("a", 5), ("b", 17), ("c", 9), ("d", 14)]
    }
    # Five steps of prefill chunks, a decode of 3 (padded to 4), then one of 2.
    max_tokens = {"a": 3, "b": 5, "c": 4, "d": 2}
    before = Recorded.replays
    result = run(runner, prompts, max_tokens, joins={0: "a", 1: "b", 2: "c", 3: "d"})
    assert Recorded.replays > before
    for name, prompt in prompts.items():
        assert result[name] == hf_greedy(path, tuple(prompt), max_tokens[name]), name


def test_a_greedy_decode_graph_samples_in_the_graph() -> None:
    """Graphs take their argmax into the token feed's buffer: an all-greedy step, decode
    or prefill, calls no sampler and still gives transformers' tokens. Seeded random
    requests run the sampler after the replay, and get the tokens of the eager path."""
    path = small_checkpoint("llama")
    prompts = {"a": [5, 9, 14, 3, 77, 41, 8], "b": [60, 2, 33, 90, 11]}
    max_tokens = {"a": 3, "b": 3}
    graphs = {"graph_capture": Recorded, "graph_sizes": (2,)}
    runner = make_runner(path, max_seqs=2, max_tokens=STEP_TOKENS, kernels="triton", **graphs)
    calls = spy_on_sampler(runner)
    before = Recorded.replays
    result = run(runner, prompts, max_tokens, joins={0: "a", 1: "b"})
    replays = Recorded.replays - before
    # Two decode steps (the second pads 1 to 2) and two with a prefill in them (token
    # graphs): no sampler.
    assert replays == 4 and calls == []
    for name, prompt in prompts.items():
        assert result[name] == hf_greedy(path, tuple(prompt), max_tokens[name]), name
    seeded = SamplingParams(temperature=0.9, seed=11)
    sampled = {}
    for options in (graphs, {"enforce_eager": True}):
        runner = make_runner(path, max_seqs=2, max_tokens=STEP_TOKENS, kernels="triton", **options)
        calls = spy_on_sampler(runner)
        sampled[bool(options.get("graph_sizes"))] = run(
            runner, prompts, max_tokens, joins={0: "a", 1: "b"}, params=seeded
        )
        assert calls and not any(calls)
    assert sampled[True] == sampled[False]


def test_penalties_on_the_triton_path_give_the_torch_path_tokens() -> None:
    """One request with every penalty and bias, one plain greedy one, in decode graphs:
    the penalised request's steps run the sampler (its kernels through the interpreter)
    after the replay, and both paths give the same tokens; the plain request still gets
    transformers' greedy ones."""
    path = small_checkpoint("llama")
    prompts = {"a": [5, 9, 14, 3, 77, 41, 8], "b": [60, 2, 33, 90, 11]}
    # a's last two tokens come after min_tokens, when its stop token is allowed again.
    max_tokens = {"a": 5, "b": 5}
    free = hf_greedy(path, tuple(prompts["a"]), 5)
    penalised = SamplingParams(
        temperature=0.0,
        repetition_penalty=1.4,
        frequency_penalty=0.6,
        presence_penalty=0.3,
        logit_bias={free[1]: -3.0, 17: 1.5},
        min_tokens=3,
        stop_token_ids=[free[0]],
        bad_words_token_ids=[[free[2], free[3]]],
    )
    params = {"a": penalised}
    results = {}
    for kernels, options in (("triton", {"graph_capture": Recorded, "graph_sizes": (2,)}),
                             ("torch", {})):  # fmt: skip
        runner = make_runner(path, max_seqs=2, max_tokens=STEP_TOKENS, kernels=kernels, **options)
        calls = spy_on_sampler(runner)
        results[kernels] = run(runner, prompts, max_tokens, joins={0: "a", 1: "b"}, params=params)
        assert len(calls) > 2  # more than the prefill steps: the penalised decodes
    assert results["triton"] == results["torch"]
    assert results["triton"]["a"] != free
    assert results["triton"]["b"] == hf_greedy(path, tuple(prompts["b"]), 5)


def test_triton_path_eager_decode_and_preempted_request_resumes() -> None:
    path = small_checkpoint("llama")
    runner = make_runner(
        path, max_seqs=4, max_tokens=STEP_TOKENS, kernels="triton", enforce_eager=True
    )
    assert runner.graphs is None
    prompt = list(range(30, 41))
    new = NewRequestData(
        "p", 1, np.array(prompt, np.int32), GREEDY, np.arange(4, dtype=np.int32), 11
    )
    pipeline = Pipeline([runner])
    tokens = [
        int(
            pipeline.step(SchedulerOutput([new], CachedRequestData.empty(), 11)).sampled_token_ids[
                0
            ]
        )
    ]
    for computed in (11, 12):
        so = SchedulerOutput([], CachedRequestData.build([1], [computed], [1]), 1)
        tokens.append(int(pipeline.step(so).sampled_token_ids[0]))
    # preempted right after a decode: its tokens must reach the host before it is parked
    runner.execute_model(SchedulerOutput([], CachedRequestData.empty(), 0, [], [1]))
    resumed = CachedRequestData.build([1], [0], [14], [[5, 6, 7, 8]], None, [1])
    tokens.append(int(pipeline.step(SchedulerOutput([], resumed, 14)).sampled_token_ids[0]))
    assert tokens == hf_greedy(path, tuple(prompt), 4)


@pytest.mark.parametrize("reused_handle", [False, True])
def test_token_feed_skips_a_row_taken_by_another_request(reused_handle: bool) -> None:
    """A finishes right after a sample; B takes its batch row with a prompt that covers
    the sample's position: B's prompt token must stay B's. The engine hands a dropped
    handle out again once the step that dropped it is back: then B has A's handle too."""
    path = small_checkpoint("llama")
    runner = make_runner(
        path, max_seqs=2, max_tokens=STEP_TOKENS, kernels="triton", enforce_eager=True
    )
    pipeline = Pipeline([runner])
    a = NewRequestData(
        "a", 1, np.array([5, 6, 7, 8, 9], np.int32), GREEDY, np.arange(2, dtype=np.int32), 5
    )
    pipeline.step(SchedulerOutput([a], CachedRequestData.empty(), 5))
    dropped = [1]
    if reused_handle:  # A dropped by a step of its own
        runner.execute_model(SchedulerOutput([], CachedRequestData.empty(), 0, dropped))
        dropped = []
    prompt = list(range(40, 52))
    handle = 1 if reused_handle else 2
    b = NewRequestData(
        "b", handle, np.array(prompt, np.int32), GREEDY, np.arange(2, 5, dtype=np.int32), 12
    )
    out = pipeline.step(SchedulerOutput([b], CachedRequestData.empty(), 12, dropped))
    assert runner.batch.row_of[handle] == 0  # the row A had
    assert int(out.sampled_token_ids[0]) == hf_greedy(path, tuple(prompt), 1)[0]


def spy_on_mlp_kernels(monkeypatch) -> set[int | str]:
    """The skinny MLP kernel's row tiles that run, and "silu" once the SiLU kernel runs
    (steps above the tiles); spied on before a runner is built, which binds them."""
    from zmqworker.models.layers import row_tiles, skinny_gate_up, triton_ops

    seen: set[int | str] = set()
    skinny, silu = skinny_gate_up.gate_up_silu, triton_ops.silu_and_mul

    def skinny_spy(x, *args, **kwargs):
        seen.add(row_tiles.row_tile(x.shape[0]))
        return skinny(x, *args, **kwargs)

    def silu_spy(x):
        seen.add("silu")
        return silu(x)

    monkeypatch.setattr(skinny_gate_up, "gate_up_silu", skinny_spy)
    monkeypatch.setattr(triton_ops, "silu_and_mul", silu_spy)
    return seen


def test_warm_up_runs_each_kernel_choice_of_the_mlp(monkeypatch) -> None:
    """Each row tile of the skinny MLP kernel is a compile of its own, and so is the SiLU
    kernel of larger steps: decodes of up to max_num_seqs requests reach the first tile
    only, and warm-up runs prefills of the token counts that reach the others."""
    from zmqworker.models.layers.row_tiles import ROW_TILES

    seen = spy_on_mlp_kernels(monkeypatch)
    runner = make_runner(small_checkpoint("llama"), max_seqs=8, max_tokens=80, kernels="triton")
    assert seen == {*ROW_TILES, "silu"}
    assert runner.path.prefill_kernel_tokens(8, 80) == [17, 33, 65]
    assert runner.path.prefill_kernel_tokens(8, 20) == [17]
    # A decode of one request asks its history ahead (triton_metadata.PREFETCH_REQS), a
    # kernel of its own, even where two requests take as many splits.
    assert {1, 2, 17, 33, 65} <= set(runner.path.decode_kernel_sizes(72))


def test_warm_up_spreads_its_prefills_over_prompts_that_fit_max_model_len(monkeypatch) -> None:
    """With 16-token prompts, steps of 17 and 33 tokens take several prompts; 65 tokens
    would take five, more than max_num_seqs, so no step has that many."""
    seen = spy_on_mlp_kernels(monkeypatch)
    path = small_checkpoint("llama")
    make_runner(path, max_seqs=4, max_tokens=80, kernels="triton", max_model_len=16)
    assert seen == {16, 32, 64}


def test_split_k_projections_match_transformers_over_graph_replays() -> None:
    """Layers wide enough that the skinny linear splits K (o over 2 splits, down over 4):
    decodes replay graphs over the layers' split counters, which each replay must leave at
    zero for the next, and greedy tokens still equal transformers'."""
    from zmqworker.models.layers.linear import SkinnyPath

    path = cached_tiny_checkpoint(
        family="llama", num_layers=1, hidden_size=256, intermediate_size=512
    )
    runner = make_runner(
        path,
        max_seqs=2,
        max_tokens=STEP_TOKENS,
        kernels="triton",
        graph_capture=Recorded,
        graph_sizes=(2,),
    )
    modules = runner.model.modules()
    paths = [m for m in modules if isinstance(m, SkinnyPath) and m.kernel is not None]
    assert len(paths) == 3  # q/k/v, o, down; gate/up has its own kernel
    rng = np.random.default_rng(1)
    prompts = {"a": rng.integers(3, 250, 6).tolist(), "b": rng.integers(3, 250, 4).tolist()}
    # Two decode replays after the two token graphs' (the second decode pads 1 to 2).
    max_tokens = {"a": 3, "b": 3}
    before = Recorded.replays
    result = run(runner, prompts, max_tokens, joins={0: "a", 1: "b"})
    assert Recorded.replays - before == 4
    assert not any(p.counters.any() for p in paths)
    for name, prompt in prompts.items():
        assert result[name] == hf_greedy(path, tuple(prompt), max_tokens[name]), name


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_max_model_len_below_the_block_size(monkeypatch, kernels: str) -> None:
    """max_model_len 3 under blocks of 4: no profiling or warm-up step reaches position 3,
    past the rotary table (the torch path raised IndexError there, the Triton kernels read
    past its end), and greedy tokens equal transformers' up to max_model_len."""
    from zmqworker.models.layers.rotary import RotaryEmbedding

    positions: list[int] = []
    for_step = RotaryEmbedding.for_step

    def spy(self, step_positions, look_up):
        positions.append(int(step_positions.max()))
        return for_step(self, step_positions, look_up)

    monkeypatch.setattr(RotaryEmbedding, "for_step", spy)
    path = small_checkpoint("llama")
    runner = make_runner(path, max_seqs=2, kernels=kernels, max_model_len=3)
    runner.profile_run()
    assert positions and max(positions) <= 2
    prompts = {"a": [5, 9, 77], "b": [31]}
    max_tokens = {"a": 1, "b": 2}
    result = run(runner, prompts, max_tokens, joins={0: "a", 1: "b"})
    for name, prompt in prompts.items():
        assert result[name] == hf_greedy(path, tuple(prompt), max_tokens[name]), name
    assert max(positions) <= 2


def test_prompt_logprobs_on_the_triton_path_equal_transformers() -> None:
    """A step that keeps prompt positions runs eagerly (no graph keeps hidden states)
    and gives transformers' log_softmax at each of them."""
    path = small_checkpoint("llama")
    runner = make_runner(path, max_seqs=4, max_tokens=STEP_TOKENS, kernels="triton",
                         graph_capture=Recorded, graph_sizes=(2, 4))  # fmt: skip
    prompt = list(range(20, 32))
    params = SamplingParams(temperature=0.0, prompt_logprobs=2)
    blocks = np.arange(3, dtype=np.int32)
    new = [NewRequestData("p", 0, np.array(prompt, np.int32), params, blocks, 12)]
    before = Recorded.replays
    out = Pipeline([runner]).step(SchedulerOutput(new, CachedRequestData.empty(), 12))
    assert Recorded.replays == before
    got = out.prompt_logprobs
    assert got is not None and got.first_positions.tolist() == [1] and got.num_rows.tolist() == [11]
    with torch.no_grad():
        expected = torch.log_softmax(hf_model(path)(torch.tensor([prompt])).logits[0, :-1], -1)
    targets = torch.tensor(prompt[1:])
    np.testing.assert_allclose(got.rows.logprobs[:, 0], expected[range(11), targets], atol=1e-4)
    np.testing.assert_allclose(got.rows.logprobs[:, 1:], expected.topk(2).values, atol=1e-4)
    assert got.rows.logprob_token_ids[:, 0].tolist() == prompt[1:]
