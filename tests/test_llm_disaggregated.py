"""LLM(disaggregate=True): prefill and decode engine cores on this host (one of each, or
two of each; of one pipeline stage or two, alike or not) behind the same client as the
server's (frontend/disaggregated_client.py), offline."""

from __future__ import annotations

import re

from messages import SamplingParams, StructuredOutputsParams
from tests.test_engine_e2e import PROMPTS, hf_greedy, make_llm
from tests.test_executor import wait_gone
from zmqworker.transport.host import boot_id


def test_a_disaggregated_llm_gives_transformers_tokens_and_a_logprob_for_each() -> None:
    """Each prompt of more than max_local_prefill_tokens is prefilled on one engine core
    and decoded on the other (its KV pulled across), each shorter one computed and
    decoded on the decode instance alone: greedy tokens equal transformers', every token
    has its logprob (a pulled prompt's first the prefill's), each instance's Ready names
    this host, and both instances' processes leave with the LLM."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    local = 4
    with make_llm(
        disaggregate=True, kv_transfer_timeout_s=60.0, max_local_prefill_tokens=local
    ) as llm:
        pids = [*llm.engine_core_pids, *llm.worker_pids]
        assert len(llm.engine_core_pids) == 2 and len(llm.worker_pids) == 2
        assert {e.ready.host_id for e in llm.client.engines} == {boot_id()}  # this host's
        sent: list[tuple[int, bool, int]] = []  # (prompt length, remote KV, engine core)
        send = llm.client._send_request

        def recorded(engine, request):
            transfer = request.kv_transfer_params
            remote = transfer is not None and transfer.remote is not None
            sent.append((len(request.prompt_token_ids), remote, engine.index))
            return send(engine, request)

        llm.client._send_request = recorded
        outs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.token_ids == hf_greedy(tuple(prompt), 6), prompt
        assert out.logprobs is not None and len(out.logprobs) == 6
        assert [lp.sampled.token_id for lp in out.logprobs] == out.token_ids
    lengths = sorted(len(p) for p in PROMPTS)
    assert sorted((n, remote, e) for n, remote, e in sent if n <= local) == [
        (n, False, 1) for n in lengths if n <= local
    ]
    assert sorted((n, remote, e) for n, remote, e in sent if n > local) == sorted(
        [(n, False, 0) for n in lengths if n > local] + [(n, True, 1) for n in lengths if n > local]
    )
    assert wait_gone(pids, 10.0)


def test_a_decode_instance_of_two_stages_gives_transformers_tokens_and_constrained_ones() -> None:
    """Every request prefilled on one stage and decoded on two (--decode-pp 2), each
    decode stage pulling its layers from the prefill's one: greedy tokens equal
    transformers'; constrained ones (their steps' forward and sample sent apart, the
    decode stages' transfer reports combined across both) keep their constraint.
    (Two stages on both sides: tests/test_kv_transfer_pp.py.)"""
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    date = r"20[0-9]{2}-[01][0-9]"
    constrained = [
        SamplingParams(temperature=1.0, seed=1, max_tokens=8,
                       structured_outputs=StructuredOutputsParams(choice=["red", "green"])),
        SamplingParams(temperature=1.0, seed=2, max_tokens=12,
                       structured_outputs=StructuredOutputsParams(regex=date)),
    ]  # fmt: skip
    with make_llm(
        disaggregate=True, kv_transfer_timeout_s=60.0, decode_pipeline_parallel_size=2
    ) as llm:
        sent: list[tuple[int, bool]] = []  # (engine core, remote KV)
        send = llm.client._send_request

        def recorded(engine, request):
            transfer = request.kv_transfer_params
            sent.append((engine.index, transfer is not None and transfer.remote is not None))
            return send(engine, request)

        llm.client._send_request = recorded
        outs = llm.generate(PROMPTS, greedy)
        color, year = llm.generate(["Pick:", "Date:"], constrained)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.token_ids == hf_greedy(tuple(prompt), 6), prompt
    assert color.text in ("red", "green") and re.fullmatch(date, year.text), (color, year)
    requests = len(PROMPTS) + 2
    assert sorted(sent) == [(0, False)] * requests + [(1, True)] * requests


def test_two_prefill_and_two_decode_instances_each_take_their_share() -> None:
    """Four engine cores, roles from their Readies: every request is prefilled on one of
    the prefill instances and decoded on one of the decode instances (the least loaded),
    each instance taking some; the samples of one prompt (n=2) are prefilled where its
    first is, to share its blocks; greedy tokens equal transformers'."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = PROMPTS * 2
    with make_llm(
        disaggregate=True, prefill_instances=2, decode_instances=2, kv_transfer_timeout_s=60.0
    ) as llm:
        client = llm.client
        assert [e.ready.kv_role for e in client.engines] == ["producer"] * 2 + ["consumer"] * 2
        sent: list[tuple[str, str | None, int]] = []  # (request, its sibling, engine core)
        send = client._send_request

        def recorded(engine, request):
            sent.append((request.request_id, request.shares_prompt_with, engine.index))
            return send(engine, request)

        client._send_request = recorded
        outs = llm.generate(prompts, params)
        twins = llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=6, n=2))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_greedy(tuple(prompt), 6), prompt
    assert [t.token_ids for t in twins] == [hf_greedy(tuple(PROMPTS[0]), 6)] * 2
    engines = [engine for _, _, engine in sent]
    assert sorted(set(engines)) == [0, 1, 2, 3], sent  # each instance took requests
    assert len(sent) == 2 * (len(prompts) + 2)  # each request: one prefill, one decode
    prefilled_on = {rid: engine for rid, _, engine in sent if engine < 2}
    siblings = [(rid, first) for rid, first, engine in sent if first is not None and engine < 2]
    assert siblings and all(prefilled_on[rid] == prefilled_on[first] for rid, first in siblings)


def test_a_next_turn_whose_prefix_the_decode_instance_dropped_goes_through_a_prefill() -> None:
    """The router's record says a conversation's first turn is cached on the decode
    instance, so its next turn goes there to be computed (max_local_prefill_tokens); that
    instance has dropped its cache since, so it refuses the request unrun, more than the
    limit uncached there, and the router sends it through the prefill instance: tokens
    equal transformers', the caller sees no failure, and the decode instance computed no
    more of it than of a first turn's pulled KV. A third turn, whose prefix the second's
    KV and answer left there, is computed there."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    first = list(range(10, 60))
    with make_llm(
        disaggregate=True,
        kv_transfer_timeout_s=60.0,
        max_local_prefill_tokens=8,
        enable_prefix_caching=True,
    ) as llm:
        client = llm.client
        [turn1] = llm.generate([first], params)
        second = [*first, *turn1.token_ids, 7, 7]
        sent: list[tuple[int, str]] = []  # (engine core, how it was sent)
        send = client._send_request

        def recorded(engine, request):
            transfer = request.kv_transfer_params
            how = (
                "remote"
                if transfer.remote
                else "local"
                if transfer.max_uncached_tokens
                else "prefill"
            )
            sent.append((engine.index, how))
            return send(engine, request)

        client._send_request = recorded
        client.call("reset_prefix_cache", engines=[1])  # the decode instance's alone
        [before] = client.call("stats", engines=[1])
        [turn2] = llm.generate([second], params)
        [after] = client.call("stats", engines=[1])
        [turn3] = llm.generate([[*second, *turn2.token_ids, 8]], params)
    assert turn2.token_ids == hf_greedy(tuple(second), 6)
    assert turn3.token_ids == hf_greedy(tuple([*second, *turn2.token_ids, 8]), 6)
    assert sent[:3] == [(1, "local"), (0, "prefill"), (1, "remote")]
    assert sent[3:] == [(1, "local")]
    # Turn 1's KV was pulled there too: what a pulled prompt costs the decode instance.
    pulled = before.num_prefill_tokens
    assert after.num_prefill_tokens - before.num_prefill_tokens == pulled  # none of the 58
