"""The router of disaggregated serving over several instances, by its bookkeeping alone:
engine cores that are sockets without a peer, their Readies and outputs handed to the
client as its receive loop would. The instances' real processes are in
tests/test_llm_disaggregated.py and tests/test_serve_disaggregated.py."""

from __future__ import annotations

import numpy as np
import pytest

from messages import (
    PROMPT_NOT_CACHED,
    AbortRequests,
    EngineCoreFailure,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequest,
    EngineCoreStats,
    FinishedOutput,
    KVTransferParams,
    RemoteKV,
    SamplingParams,
)
from zmqworker.frontend.core_process import RemoteEngineCore
from zmqworker.frontend.disaggregated_client import DisaggregatedClient
from zmqworker.frontend.engine_connection import Failed
from zmqworker.frontend.prefix_affinity import SLACK, prompt_hashes

ROLES = ["producer", "producer", "consumer", "consumer"]
IDS = ["a", "b", "c", "d"]
PROMPT = np.arange(1, 4, dtype=np.int32)


def _client(
    tmp_path,
    prefix_caching: bool = False,
    max_local_prefill_tokens: int | None = None,
    hosts: tuple[str, ...] = ("",) * len(ROLES),
    num_blocks: int = 8,
) -> DisaggregatedClient:
    addresses = [f"ipc://{tmp_path}/core{i}" for i in range(len(ROLES))]
    handles = [RemoteEngineCore(i, address) for i, address in enumerate(addresses)]
    client = DisaggregatedClient(
        addresses, handles, "token", max_local_prefill_tokens=max_local_prefill_tokens
    )
    for engine, role, host in zip(client.engines, ROLES, hosts, strict=True):
        engine.ready = EngineCoreReady(
            engine.index, 96, num_blocks, 4, 8, 256, 1, 0, kv_role=role,
            prefix_caching=prefix_caching, host_id=host,
        )  # fmt: skip
    client.wait_ready(0.0)  # every Ready is in
    return client


def _prefilled(client: DisaggregatedClient, engine_index: int, ids: list[str]) -> None:
    """Prefill instance engine_index says ids are done there, their KV staged."""
    kv = [RemoteKV(r, 3, [f"tcp://127.0.0.1:{9000 + engine_index}"]) for r in ids]
    msg = EngineCoreOutputs(
        engine_index,
        ids,
        np.full(len(ids), 7, np.int32),
        EngineCoreStats(0, 0, 8, 8, 0, 0),
        finished=[FinishedOutput(i, "length", kv_transfer=k) for i, k in enumerate(kv)],
    )
    client._on_outputs(client.engines[engine_index], msg, [])


def test_requests_spread_over_each_role_and_a_lost_prefill_fails_only_its_own(tmp_path) -> None:
    """Four requests over two prefill instances, then two decode instances (the least
    loaded each time); prefill instance 0 lost once they were handed on: the requests
    that pull from it fail naming it, and are forgotten; the others run on."""
    client = _client(tmp_path)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4)
        for request_id in IDS:
            client.add_request(EngineCoreRequest(request_id, PROMPT, params))
        prefill = {r: client.engine_of(r) for r in IDS}
        assert sorted(prefill.values()) == [0, 0, 1, 1]
        for index in (0, 1):
            _prefilled(client, index, [r for r in IDS if prefill[r] == index])
        decode = {r: client.engine_of(r) for r in IDS}
        assert sorted(decode.values()) == [2, 2, 3, 3]
        events: list = []
        client._lose(client.engines[0], RuntimeError("engine core 0 (pid 1) exited"), events)
        failed = [e for e in events if isinstance(e, Failed) and e.request_ids]
        pulled_from_0 = sorted(r for r in IDS if prefill[r] == 0)
        assert [sorted(f.request_ids) for f in failed] == [pulled_from_0]
        assert "the prefill instance: engine core 0 (pid 1) exited" in str(failed[0].error)
        assert all(client.engine_of(r) is None for r in pulled_from_0)
        assert all(client.engine_of(r) == decode[r] for r in IDS if prefill[r] == 1)
        # Prefill instance 1 still takes requests; a decode instance gone, the other one
        # takes what is handed on.
        client.add_request(EngineCoreRequest("e", PROMPT, params))
        assert client.engine_of("e") == 1
        client._lose(client.engines[2], RuntimeError("engine core 2 (pid 3) exited"), [])
        _prefilled(client, 1, ["e"])
        assert client.engine_of("e") == 3
    finally:
        client.close()


def test_a_new_request_avoids_an_instance_whose_end_is_news(tmp_path) -> None:
    """An instance's end not yet taken in when a request comes: the router looks first,
    and the request goes to a live instance, where it used to go to the ended one (and
    fail with it)."""
    client = _client(tmp_path)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4)
        client.engines[0].handle._never.wake()  # prefill instance 0's process ended
        client.add_request(EngineCoreRequest("a", PROMPT, params))
        assert client.engines[0].dead is not None and client.engine_of("a") == 1
        [lost] = client.drain()  # the end's event, kept for the caller
        assert isinstance(lost, Failed) and lost.engine_index == 0 and lost.request_ids == []
    finally:
        client.close()


def test_with_prefix_caching_a_shared_prefix_keeps_to_one_instance_of_each_role(
    tmp_path,
) -> None:
    """Prompts that share their first blocks go to the prefill instance, then the decode
    instance, that took the first of them; another prompt to the least loaded."""
    client = _client(tmp_path, prefix_caching=True)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4)
        prefix = list(range(20, 28))  # two blocks of 4
        for k, request_id in enumerate(IDS):
            prompt = np.asarray([*prefix, 30 + k], np.int32)
            client.add_request(EngineCoreRequest(request_id, prompt, params))
        assert {client.engine_of(r) for r in IDS} == {0}
        client.add_request(EngineCoreRequest("other", PROMPT, params))
        assert client.engine_of("other") == 1
        _prefilled(client, 0, IDS)
        assert {client.engine_of(r) for r in IDS} == {2}
    finally:
        client.close()


def test_a_short_prompt_goes_straight_to_a_decode_instance(tmp_path) -> None:
    """With max_local_prefill_tokens, a prompt of at most that many tokens is sent to a
    decode instance (the least loaded) to compute, with that limit for the decode
    instance to check (max_uncached_tokens), its samples (n > 1) after it; a longer
    one goes to a prefill instance marked to go on. A decode instance lost fails the
    short prompts it held."""
    client = _client(tmp_path, max_local_prefill_tokens=len(PROMPT))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4)
        sent: list[EngineCoreRequest] = []
        send = client._send_request

        def recorded(engine, request):
            sent.append(request)
            return send(engine, request)

        client._send_request = recorded
        for request_id in ("a", "b"):
            client.add_request(EngineCoreRequest(request_id, PROMPT, params))
        client.engines[2].reported_load = 1  # the least loaded is 3: only "a" leads to 2
        client.add_request(EngineCoreRequest("a2", PROMPT, params, shares_prompt_with="a"))
        longer = np.arange(1, len(PROMPT) + 2, dtype=np.int32)
        client.add_request(EngineCoreRequest("long", longer, params))
        engines = {r: client.engine_of(r) for r in ("a", "b", "a2", "long")}
        assert engines == {"a": 2, "b": 3, "a2": 2, "long": 0}
        local = KVTransferParams(max_uncached_tokens=len(PROMPT))
        assert [r.kv_transfer_params for r in sent[:3]] == [local] * 3
        assert sent[3].kv_transfer_params.do_remote_decode
        events: list = []
        client._lose(client.engines[2], RuntimeError("engine core 2 (pid 3) exited"), events)
        failed = [e for e in events if isinstance(e, Failed) and e.request_ids]
        assert [sorted(f.request_ids) for f in failed] == [["a", "a2"]]
        assert client.engine_of("b") == 3 and client.engine_of("long") == 0
    finally:
        client.close()


def test_max_local_prefill_tokens_below_one_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="max_local_prefill_tokens must be at least 1, got 0"):
        _client(tmp_path, max_local_prefill_tokens=0)


def test_a_prefill_s_kv_goes_to_a_decode_instance_of_its_host(tmp_path) -> None:
    """Prefill instances on hosts A and B, decode instances on B and A: each request
    goes on to the decode instance of its prefill's host, unless that one is more than
    SLACK requests above the least loaded."""
    client = _client(tmp_path, hosts=("host-a", "host-b", "host-b", "host-a"))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4)
        for request_id in ("a", "b"):
            client.add_request(EngineCoreRequest(request_id, PROMPT, params))
        assert (client.engine_of("a"), client.engine_of("b")) == (0, 1)
        _prefilled(client, 0, ["a"])
        _prefilled(client, 1, ["b"])
        assert (client.engine_of("a"), client.engine_of("b")) == (3, 2)
        client.engines[3].reported_load = SLACK + 2  # host A's decode instance is busy
        client.add_request(EngineCoreRequest("c", PROMPT, params))
        assert client.engine_of("c") == 0
        _prefilled(client, 0, ["c"])
        assert client.engine_of("c") == 2
    finally:
        client.close()


def test_a_conversation_s_next_turn_is_computed_where_its_last_one_decoded(tmp_path) -> None:
    """With prefix caching and max_local_prefill_tokens, the limit counts what the decode
    instance lacks, as its record of prompts tells: a first turn too long goes through a
    prefill instance; the next, whose new tokens are within the limit, straight to the
    decode instance its first turn went on to, even where that one is busier (and its
    sample after it), and so does the turn after, counted from turn 2's prompt; a
    prompt that shares nothing, or whose new part is too long, to a prefill instance."""
    client = _client(tmp_path, prefix_caching=True, max_local_prefill_tokens=6, num_blocks=400)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4)
        first = np.arange(100, 100 + 4 * 300, dtype=np.int32)  # 300 blocks: past MAX_BLOCKS
        client.add_request(EngineCoreRequest("turn1", first, params))
        assert client.engine_of("turn1") in (0, 1)
        _prefilled(client, client.engine_of("turn1"), ["turn1"])
        decode = client.engine_of("turn1")
        assert decode in (2, 3)
        client.engines[decode].reported_load = SLACK - 4  # busier, still within SLACK
        answer, question = [7, 7, 7], [8, 8]
        second = np.asarray([*first, *answer, *question], np.int32)  # 5 tokens new
        client.add_request(EngineCoreRequest("turn2", second, params))
        assert client.engine_of("turn2") == decode
        sibling = EngineCoreRequest("turn2b", second, params, shares_prompt_with="turn2")
        client.add_request(sibling)
        assert client.engine_of("turn2b") == decode
        # Turn 2's prompt was recorded there: 4 tokens new past its 301 blocks (8 past
        # turn 1's 300 alone); 10 new are too many.
        third = np.asarray([*second, 9, 9, 9], np.int32)
        client.add_request(EngineCoreRequest("turn3", third, params))
        assert client.engine_of("turn3") == decode
        too_long = np.asarray([*second, *range(9)], np.int32)
        client.add_request(EngineCoreRequest("too-long", too_long, params))
        client.add_request(EngineCoreRequest("other", first[::-1].copy(), params))
        assert client.engine_of("too-long") in (0, 1) and client.engine_of("other") in (0, 1)
    finally:
        client.close()


def _decode_step(client, decode: int, tokens: dict[str, list[int]], ended: list[str]) -> None:
    """Decode instance decode's step: tokens by request, those in ended ending."""
    ids = list(tokens)
    offsets = np.cumsum([0, *(len(t) for t in tokens.values())]).astype(np.int32)
    msg = EngineCoreOutputs(
        decode, ids, np.asarray([t for ts in tokens.values() for t in ts], np.int32),
        EngineCoreStats(0, 0, 8, 8, 0, 0),
        token_offsets=None if offsets[-1] == len(ids) else offsets,
        finished=[FinishedOutput(ids.index(r), "length") for r in ended],
    )  # fmt: skip
    client._on_outputs(client.engines[decode], msg, [])


@pytest.mark.parametrize("ending", ["length", "stop string"])
def test_a_next_turn_counts_the_answer_its_decode_instance_holds(tmp_path, ending: str) -> None:
    """The decode instance's record takes a request's answer as it ends there (finished,
    or aborted by the caller on a stop string): all but its last token (never computed),
    on that instance alone. A next turn of the first prompt, that answer and 2 tokens
    more (6 past its 301 blocks) is computed there; one 5 tokens more (9 past them), or
    whose answer differs, is not; a request aborted otherwise leaves nothing followed."""
    client = _client(tmp_path, prefix_caching=True, max_local_prefill_tokens=6, num_blocks=400)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=16)
        first = np.arange(100, 100 + 4 * 300, dtype=np.int32)
        answer = [7, *range(11, 18)]  # the prefill's first token, then 7 decoded
        client.add_request(EngineCoreRequest("t1", first, params))
        _prefilled(client, client.engine_of("t1"), ["t1"])
        decode = client.engine_of("t1")
        # One token a step, then several for t1 after another request's (offsets).
        _decode_step(client, decode, {"t1": answer[1:2], "other": [5]}, [])
        last = [] if ending == "stop string" else ["t1"]
        _decode_step(client, decode, {"other": [6, 6], "t1": answer[2:]}, last)
        if ending == "stop string":
            client.abort(["t1"], reason="stop")
        assert client.engine_of("t1") is None  # ended
        held = prompt_hashes(np.asarray([*first, *answer[:-1]], np.int32), 4, None)
        other = 5 - decode  # the other decode instance (2 or 3)
        assert client._affinity.matched(held, other) == 0
        for request_id, new in (("t3", [8] * 5), ("u", [7, *range(31, 38), 8, 8])):
            prompt = np.asarray([*first, *(answer if request_id == "t3" else []), *new], np.int32)
            client.add_request(EngineCoreRequest(request_id, prompt, params))
            assert client.engine_of(request_id) in (0, 1)
        near = np.asarray([*first, *answer, 8, 8], np.int32)
        client.add_request(EngineCoreRequest("t2", near, params))
        assert client.engine_of("t2") == decode
        client.add_request(EngineCoreRequest("gone", first, params))
        _prefilled(client, client.engine_of("gone"), ["gone"])
        client.abort(["gone"])
        assert set(client._decoded._held) == {"t2"}  # computed there, running
    finally:
        client.close()


def _declined(client: DisaggregatedClient, decode: int, ids: list[str]) -> list:
    """Decode instance decode says it did not run ids, too little of them cached; the
    events the client makes of it."""
    events: list = []
    failure = EngineCoreFailure(decode, ids, PROMPT_NOT_CACHED, "not cached here")
    client._on_failure(client.engines[decode], failure, events)
    return events


def test_a_prompt_its_decode_instance_declines_goes_through_a_prefill_instance(tmp_path) -> None:
    """A next turn sent to its decode instance to compute, which says too little of it is
    cached there (its blocks evicted since), goes to a prefill instance as the caller sent
    it (to go on to a decode instance), the caller none the wiser, and the decode
    instance's record forgets the prompt's blocks past what can be cached there (more
    than the limit is not), keeping the prefix it shares with others: the same prompt
    again goes to a prefill instance. One asking for prompt logprobs counts whole, and
    goes to a prefill instance at once. One its caller aborted meanwhile is dropped; with
    every prefill instance gone, it fails with their error; another failure of a decode
    instance's fails its requests as before."""
    client = _client(tmp_path, prefix_caching=True, max_local_prefill_tokens=6, num_blocks=400)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4)
        first = np.arange(100, 100 + 4 * 20, dtype=np.int32)
        client.add_request(EngineCoreRequest("turn1", first, params))
        _prefilled(client, client.engine_of("turn1"), ["turn1"])
        decode = client.engine_of("turn1")
        second = np.asarray([*first, 7, 7, 8], np.int32)
        sent: list[EngineCoreRequest] = []
        send = client._send_request
        client._send_request = lambda engine, r: sent.append(r) or send(engine, r)
        for request_id in ("turn2", "aborted", "lost", "failed"):
            client.add_request(EngineCoreRequest(request_id, second, params))
            assert client.engine_of(request_id) == decode
        client.abort(["aborted"])
        assert _declined(client, decode, ["turn2", "aborted"]) == []
        assert client.engine_of("turn2") in (0, 1) and client.engine_of("aborted") is None
        assert sent[-1].request_id == "turn2" and sent[-1].kv_transfer_params.do_remote_decode
        # 83 tokens, more than 6 uncached: at most 19 of their 20 full blocks are cached.
        assert client._affinity.matched(prompt_hashes(second, 4, None), decode) == 19
        client.add_request(EngineCoreRequest("again", second, params))
        assert client.engine_of("again") in (0, 1)
        logprobs = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=1)
        short = np.asarray([*first[:76], 9], np.int32)  # 19 blocks recorded, and a token
        client.add_request(EngineCoreRequest("short", short, params))
        client.add_request(EngineCoreRequest("whole", short, logprobs))
        assert client.engine_of("short") == decode and client.engine_of("whole") in (0, 1)
        events: list = []
        error = EngineCoreFailure(decode, ["failed"], "ValueError", "refused")
        client._on_failure(client.engines[decode], error, events)
        [failed] = events
        assert failed.request_ids == ["failed"] and "refused" in str(failed.error)
        for prefill in client.engines[:2]:
            prefill.dead = RuntimeError(f"prefill {prefill.index} gone")
        [lost] = _declined(client, decode, ["lost"])
        assert lost.request_ids == ["lost"] and str(lost.error) == "prefill 0 gone"
        assert client.engine_of("lost") is None
    finally:
        client.close()


def test_an_abort_before_the_pull_reaches_the_prefill_instance_too(tmp_path) -> None:
    """A request aborted once handed on, before its decode instance's first output (its
    KV not known pulled): the abort goes to the decode instance and to the prefill
    instance, which withdraws the KV instead of holding its blocks until the timeout.
    One whose decode instance answered already is aborted there alone."""
    client = _client(tmp_path)
    sent: list[tuple[int, AbortRequests]] = []
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4)
        for request_id in ("a", "b"):
            client.add_request(EngineCoreRequest(request_id, PROMPT, params))
        prefill = {r: client.engine_of(r) for r in ("a", "b")}
        for request_id, index in prefill.items():
            _prefilled(client, index, [request_id])
        decode = {r: client.engine_of(r) for r in ("a", "b")}
        answered = EngineCoreOutputs(
            decode["b"], ["b"], np.array([8], np.int32), EngineCoreStats(1, 0, 8, 7, 0, 0)
        )
        client._on_outputs(client.engines[decode["b"]], answered, [])
        client._send = lambda engine, msg: sent.append((engine.index, msg))  # type: ignore[method-assign]
        client.abort(["a", "b"])
        told = sorted((index, msg.request_ids) for index, msg in sent)
        expected = [(decode["a"], ["a"]), (decode["b"], ["b"]), (prefill["a"], ["a"])]
        assert told == sorted(expected)
    finally:
        client.close()
