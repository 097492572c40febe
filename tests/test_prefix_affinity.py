"""Placing a request by its prompt's prefix: the engine core that was sent the longest
prefix of it takes it, within SLACK requests of the least loaded; the least loaded takes
the rest. Each engine core's record is bounded by its cache's blocks."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from messages import (
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequest,
    EngineCoreStats,
    SamplingParams,
)
from zmqworker.frontend.core_client import EngineCoreClient
from zmqworker.frontend.core_process import RemoteEngineCore
from zmqworker.frontend.prefix_affinity import (
    MAX_BLOCKS,
    SLACK,
    PrefixAffinity,
    place,
    prompt_hashes,
)


@dataclass(eq=False)
class FakeEngine:
    index: int
    load: int = 0
    dead: Exception | None = None
    disconnected_at: float | None = None


def tokens(*values: int) -> np.ndarray:
    return np.asarray(values, np.int32)


PREFIX = tuple(range(100, 112))  # three blocks of 4


def test_a_hash_names_its_block_and_every_block_before_it() -> None:
    a = prompt_hashes(tokens(*PREFIX, 1, 2, 3, 4, 5), 4)
    b = prompt_hashes(tokens(*PREFIX, 9, 9, 9, 9), 4)
    other_start = prompt_hashes(tokens(7, *PREFIX[1:], 1, 2, 3, 4), 4)
    assert len(a) == len(b) == 4  # full blocks only: the 17th token is not hashed
    assert a[:3] == b[:3] and a[3] != b[3]
    assert not set(other_start) & set(a)  # a different first block: nothing matches
    assert prompt_hashes(tokens(1, 2, 3), 4) == []
    long = np.arange((MAX_BLOCKS + 3) * 2, dtype=np.int32)
    assert len(prompt_hashes(long, 2)) == MAX_BLOCKS
    assert prompt_hashes(long, 2, None)[:MAX_BLOCKS] == prompt_hashes(long, 2)
    assert len(prompt_hashes(long, 2, None)) == MAX_BLOCKS + 3  # all of them


def test_the_engine_core_sent_the_longest_prefix_takes_the_request() -> None:
    affinity = PrefixAffinity(4, {0: 100, 1: 100, 2: 100})
    engines = [FakeEngine(0), FakeEngine(1, load=1), FakeEngine(2, load=2)]
    assert place(tokens(*PREFIX, 1), engines, affinity) is engines[0]  # none sent: least
    engines[0].load = 5
    assert place(tokens(*PREFIX, 2, 3, 4, 5), engines, affinity) is engines[0]
    assert place(tokens(*PREFIX[:8], 0, 0, 0, 0), engines, affinity) is engines[0]
    assert place(tokens(1, 2, 3, 4, 5), engines, affinity) is engines[1]  # no prefix: least
    # Two engine cores were sent the same prefix: the less loaded of them, though a third
    # is less loaded than both.
    engines[2].load = 3
    affinity.sent(2, prompt_hashes(tokens(*PREFIX), 4))
    assert place(tokens(*PREFIX, 6), engines, affinity) is engines[2]
    # A longer prefix wins over a shorter one on a less loaded engine core.
    affinity.sent(1, prompt_hashes(tokens(*PREFIX, 7, 7, 7, 7), 4))
    assert place(tokens(*PREFIX, 7, 7, 7, 7, 8), engines, affinity) is engines[1]
    # Equals in prefix and load: the first.
    engines[1].load = engines[2].load
    assert place(tokens(*PREFIX, 9), engines, affinity) is engines[1]


def test_an_engine_core_past_the_slack_gives_way_to_the_next_best_prefix() -> None:
    affinity = PrefixAffinity(4, {0: 100, 1: 100, 2: 100})
    engines = [FakeEngine(0), FakeEngine(1, load=1), FakeEngine(2, load=2)]
    affinity.sent(0, prompt_hashes(tokens(*PREFIX), 4))
    affinity.sent(1, prompt_hashes(tokens(*PREFIX[:8]), 4))
    engines[0].load = SLACK + 1
    assert place(tokens(*PREFIX, 1), engines, affinity) is engines[0]  # within SLACK of 1
    engines[2].load = 0
    assert place(tokens(*PREFIX, 2), engines, affinity) is engines[1]  # 0 is past it now
    engines[1].load = SLACK + 1
    assert place(tokens(*PREFIX, 3), engines, affinity) is engines[2]  # both are past it


def test_a_busy_engine_core_s_prefix_gives_way_to_the_least_loaded() -> None:
    affinity = PrefixAffinity(4, {0: 100, 1: 100})
    engines = [FakeEngine(0), FakeEngine(1)]
    assert place(tokens(*PREFIX), engines, affinity) is engines[0]
    engines[0].load = SLACK
    assert place(tokens(*PREFIX, 1), engines, affinity) is engines[0]
    engines[0].load = SLACK + 1
    assert place(tokens(*PREFIX, 2), engines, affinity) is engines[1]
    # The least loaded now holds the prefix too, and keeps it while the other is busy.
    assert place(tokens(*PREFIX, 3), engines, affinity) is engines[1]


def test_dead_engine_cores_are_skipped_and_none_live_raises_their_error() -> None:
    affinity = PrefixAffinity(4, {0: 100, 1: 100})
    engines = [FakeEngine(0), FakeEngine(1, load=3)]
    assert place(tokens(*PREFIX), engines, affinity) is engines[0]
    engines[0].dead = RuntimeError("engine core 0 died")
    assert place(tokens(*PREFIX), engines, affinity) is engines[1]
    engines[1].dead = RuntimeError("engine core 1 died")
    with pytest.raises(RuntimeError, match="engine core 0 died"):
        place(tokens(*PREFIX), engines, affinity)
    with pytest.raises(RuntimeError, match="engine core 0 died"):
        place(tokens(*PREFIX), engines, None)


def test_an_engine_core_whose_connection_dropped_is_the_last_choice() -> None:
    """It may be gone (stopped, its host lost): a request sent there would fail when its
    grace ends, while another replica serves. Alone, it is still tried."""
    engines = [FakeEngine(0), FakeEngine(1, load=SLACK + 5)]
    affinity = PrefixAffinity(4, {0: 100, 1: 100})
    engines[0].disconnected_at = 12.5
    for chooser in (affinity, None):
        assert place(tokens(*PREFIX), engines, chooser) is engines[1]
    engines[1].dead = RuntimeError("engine core 1 died")
    assert place(tokens(*PREFIX), engines, None) is engines[0]


def test_a_record_forgets_a_prompt_s_last_blocks_first() -> None:
    affinity = PrefixAffinity(4, {0: 3, 1: 100})
    engines = [FakeEngine(0), FakeEngine(1, load=1)]
    assert place(tokens(*PREFIX), engines, affinity) is engines[0]  # its 3 blocks
    assert place(tokens(9, 9, 9, 9), engines, affinity) is engines[0]  # evicts PREFIX's last
    engines[0].load = 2
    assert place(tokens(*PREFIX[:8], 5), engines, affinity) is engines[0]  # its first two
    assert place(tokens(5, 5, 5, 5), engines, affinity) is engines[1]
    affinity.sent(0, prompt_hashes(tokens(6, 6, 6, 6, 7, 7, 7, 7, 8, 8, 8, 8), 4))
    assert place(tokens(*PREFIX), engines, affinity) is engines[1]  # all of it forgotten


def test_one_engine_core_no_prefix_cache_or_mixed_block_sizes_place_by_load_alone() -> None:
    def ready(index: int, block_size: int, prefix_caching: bool = True) -> EngineCoreReady:
        return EngineCoreReady(
            index, 96, 50, block_size, 8, 128, 1, 1, prefix_caching=prefix_caching
        )

    assert PrefixAffinity.of({0: ready(0, 4)}) is None
    assert PrefixAffinity.of({0: ready(0, 4), 1: ready(1, 8)}) is None
    assert PrefixAffinity.of({0: ready(0, 4), 1: None}) is None
    assert PrefixAffinity.of({0: ready(0, 4), 1: ready(1, 4, prefix_caching=False)}) is None
    assert PrefixAffinity.of({0: ready(0, 4), 1: ready(1, 0)}) is None
    both = PrefixAffinity.of({0: ready(0, 4), 1: ready(1, 4)})
    assert both is not None and both.block_size == 4
    with pytest.raises(ValueError, match="block size 0"):
        PrefixAffinity(0, {0: 10})


def test_requests_aborted_leave_their_replica_s_load_at_once(tmp_path) -> None:
    """A client's aborts take its requests out of the replica's load: the engine core
    tells a client of its load only with outputs for it, so eight samples aborted after
    their first output left the replica looking full, and every new request went to the
    other one."""
    addresses = [f"ipc://{tmp_path}/core{i}" for i in range(2)]
    handles = [RemoteEngineCore(i, address) for i, address in enumerate(addresses)]
    client = EngineCoreClient(addresses, handles, "token")
    try:
        for engine in client.engines:  # sockets without a peer: Readies handed in
            engine.ready = EngineCoreReady(engine.index, 96, 64, 4, 8, 256, 1, 0)
        client.wait_ready(0.0)
        prompt, params = np.arange(1, 4, dtype=np.int32), SamplingParams(max_tokens=4)
        samples = [EngineCoreRequest(f"s.{i}", prompt, params) for i in range(8)]
        for sample in samples:  # n = 8: one replica
            client._send_request(client.engines[0], sample)
        ids = [s.request_id for s in samples]
        stats = EngineCoreStats(8, 0, 64, 56, 0, 0)
        outputs = EngineCoreOutputs(0, ids, np.full(8, 7, np.int32), stats)
        client._on_outputs(client.engines[0], outputs, [])
        client.abort(ids)
        assert [engine.load for engine in client.engines] == [0, 0]
        placed = [client.add_request(EngineCoreRequest(f"r{i}", prompt, params)) for i in range(8)]
        assert sorted(placed) == [0] * 4 + [1] * 4
    finally:
        client.close()
