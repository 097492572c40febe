"""KV transfer between instances of two tensor-parallel ranks each: rank i pulls from
rank i, and a transfer is reported once both ranks have it; and between instances of
different sizes (prefill 2 -> decode 1, 1 -> 2), each decode rank pulling its heads from
the prefill ranks that hold them. Greedy tokens equal the decode instance's own
(colocated) ones, and no block is left held on either side."""

from __future__ import annotations

import msgspec
import pytest

from messages import ParallelConfig, SamplingParams
from tests.test_kv_transfer import PROMPTS, run_colocated, worker_config
from zmqworker.engine.disaggregated import start_disaggregated
from zmqworker.frontend.disaggregated_plan import free_ports

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 2), (2, 1), (1, 2)])
def test_disaggregated_greedy_equals_colocated(prefill_tp: int, decode_tp: int) -> None:
    config = worker_config(64)
    config = msgspec.structs.replace(config, parallel=ParallelConfig(prefill_tp))
    # Rank r of the prefill instance serves on port + r: all must be free.
    pair = start_disaggregated(
        config,
        96,
        free_ports(prefill_tp),
        timeout_s=10.0,
        decode_parallel=ParallelConfig(decode_tp),
    )
    try:
        colocated = run_colocated(pair.decode, GREEDY)
        results = pair.generate(PROMPTS, GREEDY, timeout_s=300)
        assert [r.error for r in results] == [None] * len(PROMPTS)
        assert [r.token_ids for r in results] == colocated
        assert pair.decode.kv_connector.num_loaded == len(PROMPTS)
        while pair.has_work():
            pair.step()
        for core in (pair.prefill, pair.decode):
            assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
    finally:
        pair.shutdown()
