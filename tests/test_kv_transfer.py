"""KV transfer between a prefill instance and a decode instance, each an engine core with
its own worker process: greedy tokens equal a colocated engine's (prefix caching and
chunked prefill on, and a decode side small enough to preempt), a prompt whose leading
blocks the decode side has cached pulls only the rest, a pull from a dead or silent
prefill fails its request by name with no block left held (and a RemoteKV naming no
address, or a malformed one, its request alone), a prompt of which little enough is not
cached on the decode side is computed there alone, logprobs come through the in-process
routers as a colocated engine gives them, and a peer without the deployment's keys gets
nothing."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest
import zmq

from messages import (
    CacheConfig,
    DeviceConfig,
    LogprobsLists,
    ModelConfig,
    SamplingParams,
    SchedulerConfig,
    WorkerConfig,
)
from messages.kv_peer import KVBlocks, KVPull
from messages.kv_transfer import RemoteKV
from tests.tiny import cached_tiny_checkpoint
from zmqworker.engine.core import EngineCore
from zmqworker.engine.disaggregated import DisaggregatedEngine, start_disaggregated
from zmqworker.engine.request import RemotePrefill, Request
from zmqworker.engine.threaded_router import ThreadedRouter
from zmqworker.kv_transfer import wire
from zmqworker.transport.curve import KVKeys

MAX_MODEL_LEN = 96
BLOCK = 4
# Shared prefixes (prefix caching), one prompt over the prefill's token budget (chunked).
PROMPTS = [
    [5, 17, 42, 9, 100, 3, 77],
    [5, 17, 42, 9, 100, 3, 77, 8, 1],
    list(range(10, 60)),
    [200, 201, 7, 7, 7, 7, 7, 7, 7, 7, 9],
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SHARED = list(range(100, 120))  # five blocks: a prefix two prompts share
# bench/run_on_gpu.sh runs these on CUDA too (ZMQWORKER_TEST_DEVICE=cuda).
DEVICE = os.environ.get("ZMQWORKER_TEST_DEVICE", "cpu")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_config(num_blocks: int, batched_tokens: int = 256) -> WorkerConfig:
    path = cached_tiny_checkpoint(family="llama", num_layers=2, vocab_size=256)
    page = 2 * BLOCK * 2 * 16 * 4  # the tiny Llama: 2 kv heads of 16, float32
    return WorkerConfig(
        model=ModelConfig(path=path, max_model_len=MAX_MODEL_LEN),
        cache=CacheConfig(block_size=BLOCK, kv_cache_bytes=num_blocks * 2 * page),
        device=DeviceConfig(device=DEVICE, num_threads=1),
        scheduler=SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=batched_tokens, warmup_batch_sizes=[1]
        ),
    )


KEYS = KVKeys.new()


@pytest.fixture(scope="module")
def pair() -> Iterator[DisaggregatedEngine]:
    """Prefill with chunks of 16 tokens; a decode side of 40 blocks, with prefix caching."""
    config = worker_config(40)
    engine = start_disaggregated(
        config,
        MAX_MODEL_LEN,
        free_port(),
        prefill_scheduler=msgspec.structs.replace(config.scheduler, max_num_batched_tokens=16),
        enable_prefix_caching=True,
        timeout_s=3.0,
        keys=KEYS,
    )
    try:
        yield engine
    finally:
        engine.shutdown()


def free_blocks(core: EngineCore) -> int:
    return core.block_manager.num_free_blocks


def run_colocated(
    core: EngineCore, params: SamplingParams = GREEDY, prompts: list[list[int]] = PROMPTS
) -> list[list[int]]:
    """prompts prefilled and decoded by core alone."""
    requests = [Request(f"c{i}", p, params) for i, p in enumerate(prompts)]
    for request in requests:
        core.add_request(request)
    while core.has_work():
        core.step()
    return [r.output_token_ids for r in requests]


def test_disaggregated_greedy_equals_colocated(pair: DisaggregatedEngine) -> None:
    # The decode instance serves ordinary requests too: colocated, on the same workers.
    colocated = run_colocated(pair.decode)
    pair.decode.reset_prefix_cache()
    results = pair.generate(PROMPTS, GREEDY, timeout_s=300)
    assert [r.error for r in results] == [None] * len(PROMPTS)
    assert [r.token_ids for r in results] == colocated
    assert all(r.finish_reason == "length" for r in results)
    assert pair.decode.kv_connector.num_loaded == len(PROMPTS)  # none recomputed there
    # Every block is back on both sides once the transfers are reported.
    while pair.has_work():
        pair.step()
    for core in (pair.prefill, pair.decode):
        assert free_blocks(core) == core.block_manager.num_blocks
    # Again, twice as many: the decode side finds the prefixes in its cache, and its 40
    # blocks do not hold eight requests at once (it waits, or preempts).
    again = pair.generate(PROMPTS * 2, GREEDY, timeout_s=300)
    assert [r.token_ids for r in again] == colocated * 2


@pytest.mark.parametrize("threaded", [False, True], ids=["stepped", "threaded"])
def test_short_prompts_are_computed_on_the_decode_side(
    pair: DisaggregatedEngine, monkeypatch, threaded: bool
) -> None:
    """With max_local_prefill_tokens, prompts of at most that many tokens go to the decode
    instance alone, which computes them; the longer ones are pulled as before; greedy
    tokens equal colocated ones either way, through either router."""
    colocated = run_colocated(pair.decode)
    pair.decode.reset_prefix_cache()
    local = 9
    monkeypatch.setattr(pair, "_local_limit", local)  # as max_local_prefill_tokens=9 makes it
    loaded = pair.decode.kv_connector.num_loaded
    router = ThreadedRouter(pair) if threaded else pair
    try:
        results = router.generate(PROMPTS, GREEDY, timeout_s=300)
    finally:
        if threaded:
            router.stop()
    assert [(r.token_ids, r.error) for r in results] == [(c, None) for c in colocated]
    pulled = sum(len(p) > local for p in PROMPTS)
    assert 0 < pulled < len(PROMPTS)
    assert pair.decode.kv_connector.num_loaded == loaded + pulled
    while pair.has_work():
        pair.step()
    for core in (pair.prefill, pair.decode):
        assert free_blocks(core) == core.block_manager.num_blocks


@pytest.mark.parametrize("threaded", [False, True], ids=["stepped", "threaded"])
def test_a_conversation_s_next_turn_is_computed_on_the_decode_side(
    pair: DisaggregatedEngine, monkeypatch, threaded: bool
) -> None:
    """The limit counts what the decode instance's cache lacks: a conversation's first
    turn, too long, is pulled; the next one (the first's prompt and answer and three
    tokens more) is computed on the decode side, which holds all but its last 6 tokens; a
    prompt as long that shares nothing is pulled. Tokens equal colocated ones."""
    first = [*SHARED, 1, 2, 3]
    [answer] = run_colocated(pair.decode, prompts=[first])
    second = [*first, *answer, 9, 9, 9]
    other = list(range(150, 150 + len(second)))
    expected = [answer, *run_colocated(pair.decode, prompts=[second, other])]
    pair.decode.reset_prefix_cache()
    monkeypatch.setattr(pair, "_local_limit", 8)  # as max_local_prefill_tokens=8 makes it
    connector = pair.decode.kv_connector
    loaded = connector.num_loaded
    router = ThreadedRouter(pair) if threaded else pair
    try:
        turns = [router.generate([prompt], GREEDY, timeout_s=300)[0] for prompt in (first, second)]
        assert connector.num_loaded == loaded + 1  # the first turn only
        assert not pair.prefills_locally(other, GREEDY)
        turns += router.generate([other], GREEDY, timeout_s=300)
    finally:
        if threaded:
            router.stop()
    assert [(r.token_ids, r.error) for r in turns] == [(e, None) for e in expected]
    assert connector.num_loaded == loaded + 2
    while pair.has_work():
        pair.step()
    for core in (pair.prefill, pair.decode):
        assert free_blocks(core) == core.block_manager.num_blocks


def test_the_threaded_router_gives_the_same_tokens(pair: DisaggregatedEngine) -> None:
    """Each instance in a loop thread of its own, as served."""
    expected = [r.token_ids for r in pair.generate(PROMPTS, GREEDY, timeout_s=300)]
    router = ThreadedRouter(pair)
    try:
        results = router.generate(PROMPTS, GREEDY, timeout_s=300)
    finally:
        router.stop()
    assert [(r.token_ids, r.finish_reason, r.error) for r in results] == [
        (tokens, "length", None) for tokens in expected
    ]
    assert all(len(r.token_times) == len(r.token_ids) for r in results)


def test_a_prompt_whose_prefix_the_decode_side_holds_pulls_only_the_rest(
    pair: DisaggregatedEngine,
) -> None:
    decode, connector = pair.decode, pair.decode.kv_connector
    first, second = [*SHARED, 1, 2, 3], [*SHARED, 7, 7, 7, 7, 8, 9]  # 5 full blocks shared
    [colocated] = run_colocated(decode, prompts=[second])
    decode.reset_prefix_cache()
    assert pair.generate([first], GREEDY, timeout_s=300)[0].error is None
    hits, pulled = connector.num_hit_blocks, connector.num_pulled_blocks
    [result] = pair.generate([second], GREEDY, timeout_s=300)
    assert (result.error, result.token_ids) == (None, colocated)
    # Its 26 tokens fill 7 blocks: the 5 the first one left cached, 2 pulled.
    assert (connector.num_hit_blocks - hits, connector.num_pulled_blocks - pulled) == (5, 2)
    stats = decode.stats()
    assert (stats.num_remote_hit_blocks, stats.num_remote_pulled_blocks) == (
        connector.num_hit_blocks,
        connector.num_pulled_blocks,
    )
    while pair.has_work():
        pair.step()
    assert free_blocks(decode) == decode.block_manager.num_blocks


def test_sleep_waits_for_the_kv_a_finished_prefill_holds_for_its_decode_side(
    pair: DisaggregatedEngine,
) -> None:
    """Finished on the prefill side, a request's KV is held for the decode side (staged
    by the next step): a sleep then would drop it, and the decode side would pull the
    new cache's blocks in its place. It is refused until the pull has ended."""
    prompt = PROMPTS[1]
    [colocated] = run_colocated(pair.decode, prompts=[prompt])
    pair.decode.reset_prefix_cache()
    pair.add_request("held", prompt, GREEDY)
    while not pair.requests["held"].token_ids:  # the prefill's step, its first token
        pair.step()
    assert pair.prefill.num_unfinished == 0
    with pytest.raises(RuntimeError, match="the KV of 1 finished prefill.s. held for a decode"):
        pair.prefill.sleep(1)
    while pair.has_work():
        pair.step()
    assert (pair.requests["held"].error, pair.requests["held"].token_ids) == (None, colocated)
    pair.prefill.sleep(1)
    pair.prefill.wake_up(None)
    [again] = pair.generate([prompt], GREEDY, timeout_s=300)
    assert (again.error, again.token_ids) == (None, colocated)


def test_kv_computed_before_a_weight_change_is_never_shared_on_the_decode_side(
    pair: DisaggregatedEngine, tmp_path
) -> None:
    """A prefill's KV staged with the old weights, both instances updated before the
    decode side takes the request: the request runs on (as one across an update does),
    but its blocks never enter the decode side's prefix cache, where a request sharing
    its prefix would read the old weights' keys and values."""
    import torch
    import transformers

    base = worker_config(40).model.path
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.3 * torch.randn(param.shape, generator=torch.Generator().manual_seed(3)))
    model.save_pretrained(tmp_path)
    prefill, decode = pair.prefill, pair.decode
    probe = [*SHARED, 7, 8, 9]
    held = Request("across", SHARED, GREEDY, remote_decode=True)
    prefill.add_request(held)
    while held.kv_transfer_out is None:
        prefill.step()
    try:
        for core in (prefill, decode):
            core.weights.reload_weights(str(tmp_path))
        [new] = run_colocated(decode, prompts=[probe])
        decode.reset_prefix_cache()
        remote = RemotePrefill(held.kv_transfer_out, held.output_token_ids[0])
        decode.add_request(Request("across", SHARED, GREEDY, remote=remote))
        while decode.has_work() or prefill.has_work():
            decode.step()
            prefill.step()
        assert decode.kv_connector.num_loaded and not decode.block_manager._cached
        assert run_colocated(decode, prompts=[probe]) == [new]
    finally:
        for core in (prefill, decode):
            core.weights.reload_weights(base)
        decode.reset_prefix_cache()


@pytest.mark.parametrize("threaded", [False, True], ids=["stepped", "threaded"])
def test_logprobs_through_the_in_process_routers_equal_colocated(
    pair: DisaggregatedEngine, monkeypatch, threaded: bool
) -> None:
    """Every token's logprobs (a pulled prompt's first token's from the prefill side, the
    rest from the decode side) and the prompt's (from the side that computed it), through
    either router, equal a colocated run's, for pulled prompts and short ones computed on
    the decode side alone; a request that asks for neither gets none."""
    asked = msgspec.structs.replace(GREEDY, logprobs=2, prompt_logprobs=1)
    expected = run_with_logprobs(pair.decode, asked)
    pair.decode.reset_prefix_cache()
    monkeypatch.setattr(pair, "_local_limit", 9)  # as max_local_prefill_tokens=9 makes it
    loaded = pair.decode.kv_connector.num_loaded
    router = ThreadedRouter(pair) if threaded else pair
    try:
        results = router.generate(PROMPTS, asked, timeout_s=300)
        [plain] = router.generate(PROMPTS[:1], GREEDY, timeout_s=300)
    finally:
        if threaded:
            router.stop()
    assert pair.decode.kv_connector.num_loaded == loaded + 2  # the two longer prompts
    for got, (tokens, rows, prompt_rows) in zip(results, expected, strict=True):
        assert (got.token_ids, got.error) == (tokens, None)
        for mine, theirs in ((got.logprobs, rows), (got.prompt_logprobs, prompt_rows)):
            assert mine is not None
            np.testing.assert_array_equal(mine.logprob_token_ids, theirs.logprob_token_ids)
            np.testing.assert_array_equal(mine.sampled_token_ranks, theirs.sampled_token_ranks)
            np.testing.assert_allclose(mine.logprobs, theirs.logprobs, atol=1e-4)
    assert (plain.token_ids, plain.logprobs, plain.prompt_logprobs) == (expected[0][0], None, None)
    while pair.has_work():
        pair.step()
    for core in (pair.prefill, pair.decode):
        assert free_blocks(core) == core.block_manager.num_blocks


def test_a_prompt_asking_for_prompt_logprobs_is_computed_where_it_has_none_cached(
    pair: DisaggregatedEngine, monkeypatch
) -> None:
    """Every position is computed for prompt logprobs: a prompt the decode side holds
    all but a token of goes to the prefill side when it asks for them, and a request
    whose first token ends it gets them from there, with that token's logprobs alone."""
    prompt = [*SHARED, 1]
    run_colocated(pair.decode, prompts=[prompt])  # its blocks now cached there
    monkeypatch.setattr(pair, "_local_limit", 8)
    asked = msgspec.structs.replace(GREEDY, max_tokens=1, logprobs=0, prompt_logprobs=0)
    assert pair.prefills_locally(prompt, GREEDY) and not pair.prefills_locally(prompt, asked)
    loaded = pair.decode.kv_connector.num_loaded
    [result] = pair.generate([prompt], asked, timeout_s=300)
    assert pair.decode.kv_connector.num_loaded == loaded  # never went to the decode side
    assert len(result.token_ids) == 1 and result.finish_reason == "length"
    assert result.logprobs.logprob_token_ids[:, 0].tolist() == result.token_ids
    assert result.prompt_logprobs.logprob_token_ids[:, 0].tolist() == prompt[1:]
    while pair.has_work():
        pair.step()


def run_with_logprobs(
    core: EngineCore, params: SamplingParams
) -> list[tuple[list[int], LogprobsLists, LogprobsLists]]:
    """PROMPTS computed by core alone: each one's tokens, their logprobs and its prompt's."""
    requests = [Request(f"lp{i}", p, params) for i, p in enumerate(PROMPTS)]
    for request in requests:
        core.add_request(request)
    while core.has_work():
        core.step()
    results = []
    for request in requests:
        rows = request.take_logprobs()
        assert rows is not None and request.prompt_logprobs is not None
        assert len(rows.logprob_token_ids) == len(request.output_token_ids)
        prompt_rows = request.prompt_logprobs.take()
        assert len(prompt_rows.logprob_token_ids) == len(request.prompt_token_ids) - 1
        results.append((request.output_token_ids, rows, prompt_rows))
    return results


def test_a_pull_nobody_answers_fails_the_request_and_frees_its_blocks(
    pair: DisaggregatedEngine,
) -> None:
    """Its prompt's first blocks are in the decode side's prefix cache: they are reused,
    and stay cached after the failure; the blocks taken for the rest are freed."""
    decode, kv = pair.decode, pair.decode.block_manager
    run_colocated(decode, prompts=[[*SHARED, 1]])  # the shared prefix cached there
    cached, _ = kv.get_computed_blocks("probe", [*SHARED, 0])
    assert len(cached) == len(SHARED) // BLOCK
    dead = f"tcp://127.0.0.1:{free_port()}"  # nothing listens: as if the prefill died
    prompt = [*SHARED, 5, 5, 5, 5, 5]
    remote = RemotePrefill(RemoteKV("gone", len(prompt), [dead]), first_token=3)
    request = Request("orphan", prompt, GREEDY, remote=remote)
    decode.add_request(request)
    decode.step()
    assert kv.block_ids("orphan")[: len(cached)] == cached  # reused, not pulled
    while decode.has_work():
        decode.step()
    assert request.is_finished and request.finish_reason.value == "abort"
    assert request.error is not None and "'orphan'" in request.error and dead in request.error
    assert free_blocks(decode) == decode.block_manager.num_blocks
    assert kv.get_computed_blocks("probe", [*SHARED, 0])[0] == cached


def test_a_remote_kv_naming_no_or_a_malformed_address_fails_only_its_request(
    pair: DisaggregatedEngine,
) -> None:
    """Neither fails the decode step (a request decoding beside them goes on) nor stops
    the decode rank's puller (a request after them is pulled)."""
    decode = pair.decode
    beside = Request("beside", PROMPTS[0], GREEDY)
    decode.add_request(beside)
    while len(beside.output_token_ids) < 2:
        decode.step()
    bad = [
        Request(name, [1, 2, 3, 4, 5], GREEDY, remote=RemotePrefill(RemoteKV(name, 5, at), 3))
        for name, at in (("nowhere", []), ("no-port", ["tcp://127.0.0.1"]))
    ]
    for request in bad:
        decode.add_request(request)
    while decode.has_work():
        decode.step()
    [later] = pair.generate([PROMPTS[1]], GREEDY)
    assert beside.error is None and len(beside.output_token_ids) == GREEDY.max_tokens
    assert "its RemoteKV names no address" in (bad[0].error or "")
    assert "the prefill address 'tcp://127.0.0.1' lacks a host or a port" in (bad[1].error or "")
    assert later.error is None and len(later.token_ids) == GREEDY.max_tokens


def test_a_peer_without_the_keys_gets_no_blocks(pair: DisaggregatedEngine) -> None:
    """A puller with a key pair of its own (and the server's public key, which is no
    secret) is refused at the CURVE handshake and never answered; one with the
    deployment's pair is."""
    address = pair.prefill.kv_connector.addresses[0]
    ctx = zmq.Context()
    try:
        answers = []
        for keys in (KVKeys.new(), KEYS):
            sock = ctx.socket(zmq.DEALER)
            sock.linger = 0
            sock.curve_serverkey = KEYS.public
            sock.curve_publickey, sock.curve_secretkey = keys.public, keys.secret
            sock.connect(address)
            sock.send(wire.encode(KVPull("anything", rank=1)))  # answered at once: no rank 1
            answers.append(wire.decode(sock.recv()) if sock.poll(2000) else None)
    finally:
        ctx.destroy(linger=0)
    assert answers[0] is None
    assert isinstance(answers[1], KVBlocks) and "meant for rank 1" in answers[1].error


def test_a_prefill_killed_mid_transfer_fails_the_request_and_frees_both_sides(
    pair: DisaggregatedEngine,
) -> None:
    """Last: it kills the pair's prefill worker once the request's KV is staged, before
    the decode side pulls it."""
    prefill, decode = pair.prefill, pair.decode
    request = Request("doomed", PROMPTS[2], GREEDY, remote_decode=True)
    prefill.add_request(request)
    while request.kv_transfer_out is None:
        prefill.step()
    prefill.step()  # the step that stages it
    prefill.executor.procs[0].kill()
    remote = RemotePrefill(request.kv_transfer_out, request.output_token_ids[0])
    on_decode = Request("doomed", PROMPTS[2], GREEDY, remote=remote)
    decode.add_request(on_decode)
    while decode.has_work():
        decode.step()
    assert on_decode.finish_reason.value == "abort" and "'doomed'" in on_decode.error
    assert free_blocks(decode) == decode.block_manager.num_blocks
    # The prefill side's next step finds its worker dead: every block comes back.
    with pytest.raises(Exception, match="died|dead|exited"):
        while prefill.has_work():
            prefill.step()
    assert free_blocks(prefill) == prefill.block_manager.num_blocks
