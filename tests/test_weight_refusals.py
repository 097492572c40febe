"""Weight changes that go wrong, below and around the workers: the push's plan of chunks
(any chunk size ends, and covers every byte once), what the engine core keeps of a
failure that may have changed weights (it refuses requests until a whole update or a
reload), and a weight-transfer group over data-parallel replicas."""

from __future__ import annotations

import contextlib
import os
import random
import signal
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from messages import RemoteError, SharedWeightRef, SharedWeights
from tests.engine_helpers import FakeExecutor, greedy, run
from zmqworker.distributed.weight_segment import ALIGN, HEADER_BYTES
from zmqworker.engine.core import EngineCore
from zmqworker.engine.request import Request
from zmqworker.executor.errors import WorkerError
from zmqworker.executor.weight_push import chunk_capacity, plan_chunks

# -- the plan of chunks ---------------------------------------------------------------


@contextlib.contextmanager
def ends_within(seconds: float) -> Iterator[None]:
    """A plan that does not end (it grew a chunk without bound) fails, by SIGALRM."""

    def stop(*_: object) -> None:
        raise AssertionError(f"the plan did not end within {seconds} s")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def covered(items: list[tuple[str, torch.Tensor]], capacity: int) -> list[list]:
    """The plan's chunks, once every byte of every tensor is found in exactly one piece,
    each piece aligned and inside the chunk, no two pieces of a chunk overlapping."""
    with ends_within(2.0):
        chunks = list(plan_chunks(items, capacity))
    seen = {name: np.zeros(t.nbytes, np.int32) for name, t in items}
    for chunk in chunks:
        assert chunk, "an empty chunk"
        spans = []
        for name, t, start, rows, offset in chunk:
            row_bytes = t.nbytes // t.shape[0] if t.dim() and t.shape[0] else t.nbytes
            size = rows * row_bytes
            assert rows >= 1 and offset % ALIGN == 0
            assert HEADER_BYTES <= offset and offset + size <= HEADER_BYTES + capacity
            seen[name][start * row_bytes : start * row_bytes + size] += 1
            spans.append((offset, offset + size))
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False)), spans
    for name, counts in seen.items():
        assert (counts == 1).all(), f"{name}: bytes covered {set(counts.tolist())} times"
    return chunks


def test_a_capacity_off_the_alignment_ends_and_covers_every_row_once():
    """`used` grew past a capacity that was not a multiple of 64: the plan appended
    pieces of negative rows for ever."""
    items = [("a", torch.zeros(4, 5)), ("b", torch.zeros(64))]
    chunks = covered(items, 100)
    assert [[(n, start, rows) for n, _, start, rows, _ in c] for c in chunks] == [
        [("a", 0, 3)],
        [("a", 3, 1)],
        [("b", 0, 16)],
        [("b", 16, 16)],
        [("b", 32, 16)],
        [("b", 48, 16)],
    ]
    assert chunk_capacity(items, 100) == 64  # rounded down, still a row of the widest
    assert chunk_capacity(items, 10) == 64
    with pytest.raises(ValueError, match="cannot hold a row of a"):
        list(plan_chunks([("a", torch.zeros(2, 20))], 64))  # 80-byte rows


def test_random_shapes_and_capacities_are_covered_exactly_once():
    rng = random.Random(0)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float64]
    for _ in range(300):
        items = []
        for i in range(rng.randint(1, 5)):
            dims = rng.choice([0, 1, 2, 3])
            shape = [rng.randint(0 if k else 1, 9) for k in range(dims)]
            items.append((f"t{i}", torch.zeros(shape, dtype=rng.choice(dtypes))))
        chunk_bytes = rng.choice([1, 63, 64, 65, 100, 127, 1000, rng.randint(1, 5000)])
        covered(items, chunk_capacity(items, chunk_bytes))


# -- what the engine core keeps --------------------------------------------------------


class WeightExecutor(FakeExecutor):
    """A FakeExecutor whose workers answer collective_rpc: None, or the error of fail."""

    call_timeout_s = 30.0

    def __init__(self) -> None:
        super().__init__()
        self.fail: dict[str, RemoteError] = {}

    def collective_rpc(self, method, args=(), kwargs=None, timeout=None, **_):
        self.calls.append(method)
        if method in self.fail:
            raise WorkerError(method, self.fail.pop(method))
        return [None]


def partial(message: str, rank: int = 1) -> RemoteError:
    return RemoteError(rank, "PartialLoadError", message, "")


def generate(core: EngineCore, prompt: list[int]) -> list[int]:
    request = Request(f"r{len(core.executor.calls)}", prompt, greedy(max_tokens=2))
    core.add_request(request)
    run(core)
    return request.output_token_ids


CHUNK = SharedWeights(1, 3, 1, 128, [SharedWeightRef("w", 64, 0, 1)])


def test_a_failure_that_may_have_changed_weights_is_kept_until_a_whole_update():
    executor = WeightExecutor()
    core = EngineCore(executor, max_model_len=64, enable_prefix_caching=True)
    prompt = list(range(1, 13))
    generate(core, prompt)
    assert core.block_manager.num_cached_tokens(prompt) > 0
    # Refused before any weight changed (every rank alike): still serving.
    executor.fail["reload_weights"] = RemoteError(0, "CheckpointError", "lacks tensor(s)", "")
    with pytest.raises(ValueError, match="lacks tensor"):
        core.weights.reload_weights("/elsewhere")
    assert core.not_ready() is None
    assert core.block_manager.num_cached_tokens(prompt) > 0
    # Failed after copying began on rank 1: not ready, the cached prefixes forgotten.
    executor.fail["reload_weights"] = partial("loading failed after 3 tensor(s): OSError")
    with pytest.raises(RuntimeError, match="rank 1: loading failed after 3"):
        core.weights.reload_weights("/elsewhere")
    assert core.not_ready() == "rank 1: loading failed after 3 tensor(s): OSError"
    assert core.block_manager.num_cached_tokens(prompt) == 0
    with pytest.raises(RuntimeError, match="no step: rank 1: loading failed"):
        generate(core, prompt)
    core.weights.reload_weights(None)
    assert core.not_ready() is None
    assert len(generate(core, prompt)) == 2
    # An update from the group that failed midway, the same.
    executor.fail["update_weights_from_group"] = partial("failed midway", rank=0)
    with pytest.raises(RuntimeError, match="failed midway"):
        core.weights.update_weights_from_group(None)  # type: ignore[arg-type]
    assert core.not_ready() == "rank 0: failed midway"
    core.weights.update_weights_from_group(None)  # type: ignore[arg-type]
    assert core.not_ready() is None


def test_a_pushed_update_is_followed_call_by_call():
    executor = WeightExecutor()
    core = EngineCore(executor, max_model_len=64, enable_prefix_caching=True)
    rpc = core.collective_rpc
    rpc("start_weight_update", (None,))
    assert core.not_ready() is None  # nothing has come yet
    rpc("load_weight_chunk", (CHUNK,))
    assert "in progress" in core.not_ready()
    rpc("finish_weight_update")
    assert core.not_ready() is None
    # Aborted after rows came: the workers refuse steps, and so does the engine.
    rpc("start_weight_update", (None,))
    rpc("load_weight_chunk", (CHUNK,))
    rpc("abort_weight_update")
    assert "ended before all of its tensors came" in core.not_ready()
    rpc("start_weight_update", (None,))
    rpc("load_weight_chunk", (CHUNK,))
    rpc("finish_weight_update")
    assert core.not_ready() is None
    # A chunk the workers refused before anything changed, then its end, refused too.
    rpc("start_weight_update", (None,))
    executor.fail["load_weight_chunk"] = RemoteError(0, "ValueError", "bad ref", "")
    with pytest.raises(ValueError, match="bad ref"):
        rpc("load_weight_chunk", (CHUNK,))
    executor.fail["finish_weight_update"] = RemoteError(0, "ValueError", "without all", "")
    with pytest.raises(ValueError):
        rpc("finish_weight_update")
    assert core.not_ready() is None
    # The workers' verdict that weights changed, kept with its reason.
    rpc("start_weight_update", (None,))
    rpc("load_weight_chunk", (CHUNK,))
    executor.fail["finish_weight_update"] = partial("without all of 2 tensors; changed")
    with pytest.raises(RuntimeError, match="without all of 2"):
        rpc("finish_weight_update")
    assert core.not_ready() == "rank 1: without all of 2 tensors; changed"
    rpc("start_weight_update", (None,))
    rpc("load_weight_chunk", (CHUNK,))
    rpc("finish_weight_update")
    assert core.not_ready() is None


# -- a group over data-parallel replicas -----------------------------------------------


@pytest.mark.skipif(
    os.environ.get("ZMQWORKER_TEST_DEVICE", "cpu") == "cuda" and torch.cuda.device_count() < 2,
    reason="two replicas on CUDA need two GPUs",
)
def test_a_group_over_two_replicas_takes_the_workers_of_both():
    """world_size was 1 + one replica's workers (docs/rl.md): the second replica's
    worker found its rank outside the group once the first had joined."""
    from tests.test_weight_updates import LLM, SEED, Trainer, checkpoint, hf_tokens, tokens

    with LLM(
        model=checkpoint(False),
        data_parallel_size=2,
        block_size=4,
        max_model_len=64,
        max_num_batched_tokens=24,
        kv_cache_bytes=1 << 20,
    ) as llm:
        assert llm.num_workers == 2
        with Trainer(llm, False, SEED) as trainer:
            assert trainer.world == 3
            with pytest.raises(ValueError, match=r"world_size = 1 \+ llm.num_workers"):
                llm.init_weight_transfer_group("127.0.0.1", trainer.port, 2, timeout_s=5.0)
            assert trainer.push(llm) == (0, None)
        assert tokens(llm) == hf_tokens(False, SEED)
