"""Live weights and sleep on a GPU (ZMQWORKER_TEST_DEVICE=cuda; skipped on the CPU):
an update from CUDA tensors of this process goes through CUDA IPC with no host sync in
the worker, and the graphs captured before it (the prompts' token graph, the decode
graphs) replay the new weights; CPU tensors go through shared memory; sleep gives the
device memory back at both levels and captures both sets of graphs again."""

from __future__ import annotations

import os

import pytest

from tests.test_weight_updates import PROMPTS, SEED, checkpoint, hf_model, hf_tokens, tokens
from zmqworker.frontend.llm import LLM

DEVICE = os.environ.get("ZMQWORKER_TEST_DEVICE", "cpu")
pytestmark = pytest.mark.skipif(DEVICE != "cuda", reason="CUDA IPC and graphs need a GPU")


@pytest.fixture(scope="module")
def llm():
    with LLM(
        model=checkpoint(False),
        device="cuda",
        dtype="float32",  # as the reference runs (auto would take bfloat16 on CUDA)
        block_size=4,
        max_model_len=64,
        max_num_seqs=len(PROMPTS),
        kv_cache_bytes=1 << 20,
        enable_prefix_caching=True,
        worker_extension_cls="tests.sync_debug.SyncDebug",
    ) as llm:
        yield llm


def test_an_update_from_cuda_tensors_syncs_nothing_and_graphs_see_it(llm):
    old, new = hf_tokens(False, None), hf_tokens(False, SEED)
    assert tokens(llm) == old  # every step replays a graph captured at start-up
    weights = [(n, t.detach().cuda()) for n, t in hf_model(False, SEED).named_parameters()]
    llm.collective_rpc("set_sync_debug_mode", ("error",))
    try:
        llm.update_weights(weights)
    finally:
        llm.collective_rpc("set_sync_debug_mode", ("default",))
    assert tokens(llm) == new
    llm.update_weights(hf_model(False, None).named_parameters())  # CPU: shared memory
    assert tokens(llm) == old


def test_sleep_cycles_give_memory_back_and_capture_the_graphs_again(llm):
    """(tests/test_worker.py checks the bytes given back, in process.)"""
    old = hf_tokens(False, None)
    for level in (1, 2, 1):
        # Measured before each sleep: a capture after wake_up may take other blocks of the
        # allocator than the one before it.
        [awake] = llm.collective_rpc("device_memory_in_use")
        llm.sleep(level)
        [asleep] = llm.collective_rpc("device_memory_in_use")
        assert asleep < awake, (level, asleep, awake)
        llm.wake_up()
        if level == 2:
            llm.reload_weights()
        assert tokens(llm) == old
