"""Token graphs (prefills, chunks over a cached prefix, mixed steps replayed from CUDA
graphs by token count) on the CPU: the captured sizes, a step's padding in the
persistent inputs, and replays through a recorder in Triton's interpreter that write the
KV cache and give the logits of the eager path. The GPU runs the real graphs in
test_model_runner.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from messages import CachedRequestData, NewRequestData, SchedulerOutput  # noqa: E402
from tests.runner_helpers import DEVICE, GREEDY, Pipeline, hf_greedy, make_runner  # noqa: E402
from tests.test_triton_runner import Recorded, small_checkpoint  # noqa: E402
from zmqworker.model_runner.cuda_graphs import (  # noqa: E402
    default_token_sizes,
    token_graph_reqs,
)
from zmqworker.model_runner.device_inputs import DeviceInputs  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")


def test_token_sizes_pad_a_step_by_at_most_an_eighth_above_128_tokens():
    sizes = default_token_sizes(8192)
    assert sizes[:9] == [16, 32, 48, 64, 80, 96, 112, 128, 144]
    assert sizes[-1] == 8192 and 2048 in sizes and 2304 in sizes and 640 in sizes
    assert all(b - a <= max(16, a // 8) for a, b in zip(sizes, sizes[1:], strict=False))
    assert len(sizes) == 56
    assert default_token_sizes(40) == [16, 32, 40]
    assert default_token_sizes(12) == [12]
    assert default_token_sizes(1) == []  # a step of one token is a decode


def test_token_graph_request_slots_leave_one_for_the_padding():
    assert token_graph_reqs(16, max_num_reqs=256) == 16  # at most 15 requests and padding
    assert token_graph_reqs(512, max_num_reqs=256) == 257
    assert token_graph_reqs(2, max_num_reqs=1) == 2


def test_a_step_pads_to_its_token_graph_with_a_request_of_no_history():
    inputs = DeviceInputs(32, 4, 8, 4, 2, 32, torch.device("cpu"))
    tokens = np.arange(100, 164, dtype=np.int32).reshape(2, 32)
    table = np.array([[3, 4, 5, 0, 0, 0, 0, 0], [6, 7, 0, 0, 0, 0, 0, 0]], np.int32)
    # A chunk of 5 over a cached prefix of 6, and a decode at position 4.
    rows, computed, scheduled = np.array([0, 1]), np.array([6, 4], np.int32), np.array([5, 1])
    reqs = token_graph_reqs(16, 4)
    inputs.write(tokens, table, rows, computed, scheduled, 6, None, np.array([4, 5]),
                 pad_tokens=(16, reqs))  # fmt: skip
    step = inputs.views(16, reqs, 16, 4)
    meta = step.metadata
    assert not meta.decode_only and meta.num_splits == 1
    assert meta.slot_mapping.tolist() == [18, 19, 20, 21, 22, 28] + [-1] * 10
    assert meta.positions.tolist() == [6, 7, 8, 9, 10, 4] + [0] * 10
    assert step.input_ids.tolist() == [106, 107, 108, 109, 110, 136] + [0] * 10
    assert meta.query_start_loc.tolist() == [0, 5, 6, 16, 16, 16]
    assert meta.seq_lens.tolist() == [11, 5, 0, 0, 0]
    assert step.sample_index.tolist() == [4, 5, 0, 0]
    assert step.feed_index.tolist() == [-1] * 16
    # Padding tokens need a request slot of their own; a step that fills the graph not.
    with pytest.raises(ValueError, match="does not pad to a token graph of 16 tokens and 2"):
        inputs.write(tokens, table, rows, computed, scheduled, 6, None, np.array([4, 5]),
                     pad_tokens=(16, 2))  # fmt: skip
    inputs.write(tokens, table, rows, computed, scheduled, 6, None, np.array([4, 5]),
                 pad_tokens=(6, 2))  # fmt: skip
    assert inputs.views(6, 2, 6, 2).metadata.query_start_loc.tolist() == [0, 5, 6]


def prefill(runner, prompt: list[int], blocks: list[int]) -> torch.Tensor:
    """One new request's whole prompt in a step: its logits, then its sample."""
    new = NewRequestData(
        "p", 1, np.array(prompt, np.int32), GREEDY, np.array(blocks, np.int32), len(prompt)
    )
    so = SchedulerOutput([new], CachedRequestData.empty(), len(prompt))
    assert runner.execute_model(so, sample=False) is None
    logits = runner._step_logits.logits.clone()
    runner.sample_tokens(None).get_output()
    return logits


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the GPU runs real graphs elsewhere")
def test_a_prefill_replays_a_token_graph_writing_only_its_own_slots():
    """A prompt of 7 tokens replays the graph of 16: the logits are the eager path's, the
    KV cache holds the prompt's keys and values where the eager path put them (and no
    more), and the padding tokens wrote nothing (every other cell keeps its sentinel)."""
    path = small_checkpoint("llama")
    prompt = [5, 9, 14, 3, 77, 41, 8]
    runs = {}
    for eager in (False, True):
        options = {"enforce_eager": True} if eager else {"graph_capture": Recorded}
        runner = make_runner(path, max_seqs=2, max_tokens=16, kernels="triton", **options)
        assert (runner.path.token_graphs is None) == eager
        for cache in runner.kv_caches:
            cache.fill_(7.0)
        before = Recorded.replays
        logits = prefill(runner, prompt, [3, 4])
        assert Recorded.replays - before == (0 if eager else 1)
        runs[eager] = (logits, [c.clone() for c in runner.kv_caches])
    # Not to the bit: the CPU's matmuls block 16 rows differently from 7.
    torch.testing.assert_close(runs[False][0], runs[True][0], rtol=1e-5, atol=1e-5)
    prompt_blocks = torch.zeros_like(runs[True][1][0], dtype=torch.bool)
    prompt_blocks[:, 3:5] = True
    for graph_cache, eager_cache in zip(runs[False][1], runs[True][1], strict=True):
        torch.testing.assert_close(graph_cache, eager_cache, rtol=1e-5, atol=1e-5)
        assert (graph_cache[~prompt_blocks] == 7.0).all()
        assert (graph_cache[prompt_blocks] != 7.0).sum() == 7 * graph_cache[0, 0].numel() // 2


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the GPU runs real graphs elsewhere")
def test_a_step_that_samples_nothing_keeps_the_samples_the_next_step_feeds():
    """A samples; the next step is only B's first chunk (it samples nothing), a token
    graph whose logits rows still run; then A's decode reads its sample on the device (the
    token feed). The graph's argmax must write no row of a step that samples nothing, or
    A is fed B's argmax (on a GPU: a resumed request's recompute between two decodes)."""
    path = small_checkpoint("llama")
    runner = make_runner(path, max_seqs=2, max_tokens=16, kernels="triton", graph_capture=Recorded)
    pipeline = Pipeline([runner])
    prompts = {"a": [5, 9, 14, 3, 77, 41, 8], "b": list(range(40, 52))}
    a = NewRequestData("a", 1, np.array(prompts["a"], np.int32), GREEDY, np.arange(2), 7)
    tokens = {"a": pipeline.step(SchedulerOutput([a], CachedRequestData.empty(), 7))}
    sampled = runner.path.inputs.sampled.clone()
    b = NewRequestData("b", 2, np.array(prompts["b"], np.int32), GREEDY, np.arange(2, 4), 6)
    before = Recorded.replays
    out = pipeline.step(SchedulerOutput([b], CachedRequestData.empty(), 6))
    assert Recorded.replays - before == 1 and out.sampled_token_ids.tolist() == [-1]
    assert torch.equal(runner.path.inputs.sampled, sampled)
    step = CachedRequestData.build([1, 2], [7, 6], [1, 6], [[], [4]])
    out = pipeline.step(SchedulerOutput([], step, 7))
    tokens["a"] = tokens["a"].sampled_token_ids.tolist() + [int(out.sampled_token_ids[0])]
    tokens["b"] = [int(out.sampled_token_ids[1])]
    for name, prompt in prompts.items():
        assert tokens[name] == hf_greedy(path, tuple(prompt), len(tokens[name])), name
