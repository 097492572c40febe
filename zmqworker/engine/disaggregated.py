"""Disaggregated prefill and decode in one process: a router over a prefill engine core
and a decode engine core, each with its own workers.

A request goes to the prefill instance first, marked remote_decode: it computes the
prompt and samples the first token, which the router hands out at once; its KV stays
staged there. The router then gives the decode instance the request with that token and
where the KV waits (RemoteKV); the decode workers pull it and decode from there. A
request whose first token already ends it never goes to the decode side. With
max_local_prefill_tokens, a prompt of which at most that many tokens are not cached on
the decode instance goes there alone, which computes it as a colocated engine core
would (local_prefill.py). A pull that
fails (the prefill instance died, or did not answer within the timeout) finishes the
request with an error naming it; its blocks are freed on both sides (the prefill side's
when its staged KV expires).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import msgspec

from messages import (
    KVTransferConfig,
    LogprobsLists,
    ParallelConfig,
    RemoteKV,
    SamplingParams,
    SchedulerConfig,
    WorkerConfig,
)
from zmqworker.engine.core import EngineCore
from zmqworker.engine.local_prefill import computes_locally, local_prefill_limit
from zmqworker.engine.prompt_logprobs import join_rows
from zmqworker.engine.request import RemotePrefill, Request
from zmqworker.executor.multiproc import MultiprocExecutor
from zmqworker.transport.curve import KV_CURVE_ENV, KVKeys


@dataclass
class RoutedRequest:
    """What the router knows of a request: its tokens so far, from either side, and
    their logprobs where it asked for them (the first token's and the prompt's from the
    side that computed the prompt)."""

    req_id: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    first_token_time: float | None = None  # time.monotonic() of the prefill's token
    token_times: list[float] = field(default_factory=list)  # one per token, monotonic
    # A row per prompt position after the first (SamplingParams.prompt_logprobs).
    prompt_logprobs: LogprobsLists | None = None
    _logprob_parts: list[LogprobsLists] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def logprobs(self) -> LogprobsLists | None:
        """A row per output token so far (SamplingParams.logprobs): column 0 the token,
        then the top ones; None where none were asked for."""
        return join_rows(self._logprob_parts) if self._logprob_parts else None

    def update(
        self,
        output_token_ids: Sequence[int],
        finish_reason: str | None,
        error: str | None,
        logprobs: tuple[LogprobsLists | None, LogprobsLists | None] = (None, None),
    ) -> None:
        """Take a side's view of the request: its outputs so far (the prefill's first
        token included on the decode side), how it ended there (None: it goes on), and
        the logprobs its step gave (Request.take_routed_logprobs)."""
        rows, prompt = logprobs
        if rows is not None:
            self._logprob_parts.append(rows)
        if prompt is not None:
            self.prompt_logprobs = prompt
        now = time.monotonic()
        new = output_token_ids[len(self.token_ids) :]
        if new and self.first_token_time is None:
            self.first_token_time = now
        self.token_ids.extend(new)
        self.token_times.extend([now] * len(new))
        if finish_reason is not None:
            self.finish_reason, self.error = finish_reason, error


class DisaggregatedEngine:
    """Not thread-safe: one thread calls add_request, step and the rest (ThreadedRouter's
    own thread asks prefills_locally while the cores step in theirs)."""

    def __init__(
        self, prefill: EngineCore, decode: EngineCore, max_local_prefill_tokens: int | None = None
    ) -> None:
        """max_local_prefill_tokens: a prompt of which at most this many tokens are not
        cached on the decode instance is computed there (None: every prompt on the
        prefill instance)."""
        self._local_limit = local_prefill_limit(max_local_prefill_tokens)
        for name, core, role in (("prefill", prefill, "addresses"), ("decode", decode, None)):
            if core.kv_connector is None:
                raise ValueError(f"the {name} engine core has no KV connector (kv_transfer)")
            if role and not core.kv_connector.addresses:
                raise ValueError("the prefill engine core's workers do not serve KV (producer)")
        self.prefill = prefill
        self.decode = decode
        self.requests: dict[str, RoutedRequest] = {}
        self._params: dict[str, tuple[list[int], SamplingParams, list[int]]] = {}

    def add_request(
        self,
        req_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        eos_token_ids: Iterable[int] = (),
    ) -> None:
        check_routed(req_id, self.requests)
        eos = list(eos_token_ids)
        if self.prefills_locally(prompt_token_ids, params):
            self.decode.add_request(Request(req_id, prompt_token_ids, params, eos_token_ids=eos))
        else:
            self.prefill.add_request(
                Request(req_id, prompt_token_ids, params, eos_token_ids=eos, remote_decode=True)
            )
            self._params[req_id] = (list(prompt_token_ids), params, eos)
        self.requests[req_id] = RoutedRequest(req_id)

    def prefills_locally(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> bool:
        """Whether a prompt of these tokens is computed on the decode instance (one that
        asks for prompt logprobs is computed whole: nothing of it counts as cached). The
        threaded router asks it from its own thread (KVBlockManager.num_cached_tokens)."""
        num_tokens, limit = len(prompt_token_ids), self._local_limit
        decided = limit == 0 or num_tokens <= limit or params.prompt_logprobs is not None
        cached = 0 if decided else self.decode.block_manager.num_cached_tokens(prompt_token_ids)
        return computes_locally(num_tokens, cached, limit)

    def abort_request(self, req_id: str) -> None:
        self.prefill.abort_request(req_id)
        self.decode.abort_request(req_id)
        routed = self.requests.get(req_id)
        if routed is not None and not routed.finished:
            routed.finish_reason = "abort"
        self._params.pop(req_id, None)

    def has_work(self) -> bool:
        return self.prefill.has_work() or self.decode.has_work()

    def step(self) -> list[RoutedRequest]:
        """A turn of each instance; the requests that got tokens or finished."""
        changed: dict[str, RoutedRequest] = {}
        for request in self.prefill.step():
            goes_on = request.kv_transfer_out is not None  # to the decode instance
            routed = self._take(request, goes_on)
            changed[routed.req_id] = routed
            if goes_on:
                assert request.kv_transfer_out is not None
                first = request.output_token_ids[0]
                self.decode.add_request(
                    decode_request(
                        request.req_id, self._params[request.req_id], request.kv_transfer_out, first
                    )
                )
        for request in self.decode.step():
            routed = self._take(request)
            changed[routed.req_id] = routed
        for routed in changed.values():
            if routed.finished:
                self._params.pop(routed.req_id, None)
        return list(changed.values())

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        eos_token_ids: Iterable[int] = (),
        timeout_s: float = 600.0,
    ) -> list[RoutedRequest]:
        """Run prompts to the end (bounded by timeout_s); their results in order."""
        return run_to_end(self, "disagg", prompts, params, eos_token_ids, timeout_s, self.step)

    def shutdown(self) -> None:
        for core in (self.decode, self.prefill):
            core.shutdown()

    def _take(self, request: Request, goes_on: bool = False) -> RoutedRequest:
        routed = self.requests[request.req_id]
        reason = request.finish_reason
        finish = None if goes_on or reason is None else reason.value
        routed.update(
            request.output_token_ids, finish, request.error, request.take_routed_logprobs()
        )
        return routed


def check_routed(req_id: str, requests: dict) -> None:
    """A request an in-process router takes (ValueError naming what it cannot)."""
    if req_id in requests:
        raise ValueError(f"request id {req_id!r} is already in the router")


def decode_request(
    req_id: str, inputs: tuple[list[int], SamplingParams, list[int]], kv: RemoteKV, first: int
) -> Request:
    """The decode instance's request for a prompt (inputs: its tokens, parameters and
    EOS ids) prefilled elsewhere: from its KV there and its first token. Its prompt
    logprobs came with that token; the decode side never computes the prompt, and
    refuses a request that asks for them."""
    prompt, params, eos = inputs
    if params.prompt_logprobs is not None:
        params = msgspec.structs.replace(params, prompt_logprobs=None)
    return Request(req_id, prompt, params, eos_token_ids=eos, remote=RemotePrefill(kv, first))


class Router(Protocol):
    """What run_to_end drives: DisaggregatedEngine, or ThreadedRouter."""

    requests: dict[str, RoutedRequest]

    def add_request(
        self,
        req_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        eos_token_ids: Iterable[int] = (),
    ) -> None: ...


def run_to_end(
    router: Router,
    prefix: str,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    eos_token_ids: Iterable[int],
    timeout_s: float,
    advance: Callable[[], object],
) -> list[RoutedRequest]:
    """Add prompts to router and call advance until they are finished (bounded by
    timeout_s); their results in order."""
    start = len(router.requests)
    ids = [f"{prefix}-{os.getpid()}-{start + i}" for i in range(len(prompts))]
    for req_id, prompt in zip(ids, prompts, strict=True):
        router.add_request(req_id, prompt, params, eos_token_ids)
    deadline = time.monotonic() + timeout_s
    while not all(router.requests[r].finished for r in ids):
        if time.monotonic() > deadline:
            raise TimeoutError(f"requests unfinished after {timeout_s} s")
        advance()
    return [router.requests[r] for r in ids]


def start_disaggregated(
    config: WorkerConfig,
    max_model_len: int,
    kv_port: int,
    prefill_scheduler: SchedulerConfig | None = None,
    decode_scheduler: SchedulerConfig | None = None,
    enable_prefix_caching: bool = False,
    timeout_s: float = 30.0,
    keys: KVKeys | None = None,
    decode_parallel: ParallelConfig | None = None,
    max_local_prefill_tokens: int | None = None,
) -> DisaggregatedEngine:
    """A prefill instance and a decode instance of config's model on this host, each its
    own workers (MultiprocExecutor), and the router over them. The KV servers of the
    prefill's ranks bind 127.0.0.1:kv_port + rank; keys (a pair made here if None)
    authenticate every KV socket. decode_parallel: the decode instance's layout (None:
    config's), of another tensor parallel size or pipeline stages where the model's KV
    heads and layers map (kv_transfer/head_map.py); its first_local_rank places it on the
    GPUs after the prefill's, and host_ranks (in both layouts) shares the CPU's cores
    between them, as frontend/disaggregated_plan.py does. max_local_prefill_tokens: the
    router's (DisaggregatedEngine)."""
    local_prefill_limit(max_local_prefill_tokens)  # a bad value fails before any start
    env = {KV_CURVE_ENV: (keys or KVKeys.new()).to_env()}

    def start(role: str, scheduler: SchedulerConfig | None) -> EngineCore:
        transfer = KVTransferConfig(role=role, port=kv_port, timeout_s=timeout_s)
        parallel = decode_parallel if role == "consumer" and decode_parallel else None
        instance = msgspec.structs.replace(
            config,
            kv_transfer=transfer,
            scheduler=scheduler or config.scheduler,
            parallel=parallel or config.parallel,
        )
        executor = MultiprocExecutor(instance, env=env)
        try:
            return EngineCore(
                executor,
                max_model_len,
                instance.scheduler,
                enable_prefix_caching=enable_prefix_caching,
                kv_transfer=transfer,
            )
        except BaseException:
            executor.shutdown()
            raise

    # The two instances start side by side: each spends its start-up in its workers.
    with ThreadPoolExecutor(2) as pool:
        starts = [
            pool.submit(start, "producer", prefill_scheduler),
            pool.submit(start, "consumer", decode_scheduler),
        ]
    errors = [f.exception() for f in starts]
    if any(errors):
        for future, error in zip(starts, errors, strict=True):
            if error is None:
                future.result().shutdown()
        raise next(e for e in errors if e is not None)
    return DisaggregatedEngine(starts[0].result(), starts[1].result(), max_local_prefill_tokens)
