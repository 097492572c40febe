"""LLM(disaggregate=True): prefill and decode engine cores on this host (one of each, or
two of each) behind the same client as the server's (frontend/disaggregated_client.py),
offline."""

from __future__ import annotations

from messages import SamplingParams
from tests.test_engine_e2e import PROMPTS, hf_greedy, make_llm
from tests.test_executor import wait_gone


def test_a_disaggregated_llm_gives_transformers_tokens_and_a_logprob_for_each() -> None:
    """Each prompt is prefilled on one engine core and decoded on the other (its KV
    pulled across): greedy tokens equal transformers', every token has its logprob (the
    first the prefill's), and both instances' processes leave with the LLM."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    with make_llm(disaggregate=True, kv_transfer_timeout_s=60.0) as llm:
        pids = [*llm.engine_core_pids, *llm.worker_pids]
        assert len(llm.engine_core_pids) == 2 and len(llm.worker_pids) == 2
        outs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.token_ids == hf_greedy(tuple(prompt), 6), prompt
        assert out.logprobs is not None and len(out.logprobs) == 6
        assert [lp.sampled.token_id for lp in out.logprobs] == out.token_ids
    assert wait_gone(pids, 10.0)


def test_two_prefill_and_two_decode_instances_each_take_their_share() -> None:
    """Four engine cores, roles from their Readies: every request is prefilled on one of
    the prefill instances and decoded on one of the decode instances (the least loaded),
    each instance taking some; greedy tokens equal transformers'."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = PROMPTS * 2
    with make_llm(
        disaggregate=True, prefill_instances=2, decode_instances=2, kv_transfer_timeout_s=60.0
    ) as llm:
        client = llm.client
        assert [e.ready.kv_role for e in client.engines] == ["producer"] * 2 + ["consumer"] * 2
        sent: list[int] = []
        send = client._send_request
        client._send_request = lambda engine, request: (
            sent.append(engine.index) or send(engine, request)
        )
        outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_greedy(tuple(prompt), 6), prompt
    assert sorted(set(sent)) == [0, 1, 2, 3], sent  # each instance took requests
    assert len(sent) == 2 * len(prompts)  # each request: one prefill, one decode
