"""The router of disaggregated serving, in the client: a client of prefill instances and
decode instances (engine cores whose workers move KV between them: docs/kv_transfer.md),
each told from the others by its Ready (EngineCoreReady.kv_role).

Each request goes to a prefill instance with do_remote_decode: the one its prompt's
prefix went to before, or the least loaded (prefix_affinity.py). The output that ends it
there carries its first token and where its prompt's KV waits
(FinishedOutput.kv_transfer): that end is taken out of the output here, so that the
caller sees the first token as any other, and the same request goes to a decode
instance, chosen alike, with the KV's whereabouts and the token, from where it streams
on. A decode instance of the prefill's host (EngineCoreReady.host_id) goes first, where
one is within SLACK requests of the least loaded: there the KV can move through shared
memory, elsewhere it goes over tcp. A request whose first token ends it never leaves its
prefill instance. With max_local_prefill_tokens, a prompt of which at most that many
tokens are not cached on a decode instance goes straight there, which computes it as a
colocated engine core would (engine/local_prefill.py): cached as far as the decode
instances' prefix records tell, kept whole for it (prefix_affinity.py), each request's
prompt when it is sent and its prompt and answer when it ends there (decoded_tokens.py):
a conversation's next turn counts its new message as not cached. The records are a
guess (the decode instance may have evicted blocks since); the decode instance checks
its own cache as it first schedules such a request (KVTransferParams.max_uncached_tokens)
and fails it unrun where more is missing (PROMPT_NOT_CACHED): the router then forgets
that prompt's blocks past what could be cached in the instance's record and sends the
request to a prefill instance, so that a decode instance never starts a prompt of which
more than the limit is uncached. A prompt that asks for prompt logprobs counts whole
(every position is computed for them). The caller's code
(Frontend, the API servers) is the same as over replicas: aborts go to the instance that
runs the request (and, for one handed on whose KV is not known pulled, to its prefill
instance, which withdraws the KV), failures come back by id.

Failures: a request fails with an error naming the instance that failed it. A prefill
instance gone: its own requests fail at once, and so do those a decode instance has not
yet answered that pull from it (their pull would wait for a prefill that is gone: they
are aborted there, which frees their blocks once any pull under way is over). A pull
that fails on a decode instance (timed out, refused) fails its request there, naming the
prefill's address. Nothing is recomputed: the caller may send the request again, under a
new id (an id is refused while a transfer of its holds blocks).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence

import msgspec
import numpy as np

from messages import (
    PROMPT_NOT_CACHED,
    AbortRequests,
    EngineCoreFailure,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequest,
    KVTransferParams,
    RemoteKV,
)
from zmqworker.engine.local_prefill import computes_locally, local_prefill_limit
from zmqworker.frontend.core_client import EngineCoreClient
from zmqworker.frontend.core_process import EngineCoreHandle
from zmqworker.frontend.decoded_tokens import DecodedTokens
from zmqworker.frontend.engine_connection import EngineConnection, Event, Failed
from zmqworker.frontend.prefix_affinity import MAX_BLOCKS, SLACK, place, prompt_hashes

ROLES = {"producer": "prefill", "consumer": "decode"}  # by the workers' KV transfer role


class InstanceLostError(RuntimeError):
    """An instance of a disaggregated deployment is gone: which, and how (error)."""

    def __init__(self, role: str, error: Exception) -> None:
        self.role = role
        self.cause = error
        super().__init__(f"the {role} instance: {error}")


def instance_roles(readies: Sequence[EngineCoreReady], names: Sequence[str]) -> list[str]:
    """Each engine core's role, "prefill" or "decode", from its Ready (names: how errors
    name each); ValueError naming an engine core that is neither, or a deployment
    without both."""
    roles = []
    for ready, name in zip(readies, names, strict=True):
        role = ROLES.get(ready.kv_role)
        if role is None:
            what = f"KV transfer role {ready.kv_role!r}" if ready.kv_role else "no KV transfer"
            raise ValueError(
                f"{name} has {what}: disaggregated serving takes prefill instances "
                "(producer) and decode instances (consumer)"
            )
        roles.append(role)
    for role in ROLES.values():
        if role not in roles:
            raise ValueError(
                f"disaggregated serving needs a {role} instance among its {len(roles)} engine "
                f"core(s), whose roles are {roles}"
            )
    return roles


class DisaggregatedClient(EngineCoreClient):
    """An EngineCoreClient whose engine cores are prefill and decode instances, each known
    by its Ready."""

    def __init__(
        self,
        addresses: Sequence[str],
        handles: Sequence[EngineCoreHandle],
        token: str,
        client_index: int = 0,
        max_output_bytes: int = -1,
        max_local_prefill_tokens: int | None = None,
    ) -> None:
        """max_local_prefill_tokens: a prompt of which at most this many tokens are not
        cached on a decode instance is computed there (None: every prompt on a prefill
        instance)."""
        if len(addresses) < 2:
            raise ValueError(
                f"disaggregated serving runs prefill and decode instances, got "
                f"{len(addresses)} engine core(s)"
            )
        self._local_limit = local_prefill_limit(max_local_prefill_tokens)
        super().__init__(addresses, handles, token, client_index, max_output_bytes)
        # Requests on a prefill instance, as the caller sent them: what goes on to decode.
        self._prefilling: dict[str, EngineCoreRequest] = {}
        # Requests handed to a decode instance that it has not answered yet, and the
        # prefill instance whose KV they pull.
        self._awaiting_kv: dict[str, EngineConnection] = {}
        # Requests sent to a decode instance to compute there, as the caller sent them, until
        # they run there (or fail there unrun, and go to a prefill instance).
        self._local: dict[str, EngineCoreRequest] = {}
        # With the local rule: the tokens of the requests on decode instances.
        self._decoded = DecodedTokens() if self._local_limit else None

    def wait_ready(self, timeout: float) -> list[EngineCoreReady]:
        """As EngineCoreClient's; ValueError where the engine cores are not prefill and
        decode instances."""
        readies = super().wait_ready(timeout)
        names = [f"engine core {e.index} {e.handle.label}" for e in self.engines]
        instance_roles(readies, names)
        return readies

    def _role(self, engine: EngineConnection) -> str | None:
        """Its role as its Ready says ("prefill" or "decode"); None before it."""
        return None if engine.ready is None else ROLES.get(engine.ready.kv_role)

    def _instances(self, role: str) -> list[EngineConnection]:
        return [engine for engine in self.engines if self._role(engine) == role]

    def _route(self, request: EngineCoreRequest) -> int:
        if request.kv_transfer_params is not None:
            raise ValueError(
                f"request {request.request_id!r}: the router sets kv_transfer_params itself"
            )
        prefills, decodes = self._instances("prefill"), self._instances("decode")
        if not prefills or not decodes:
            raise RuntimeError("no prefill or no decode instance is ready (wait_ready first)")
        # A sibling (n > 1) goes where its prompt is computed: it shares its blocks there.
        sibling = self._owner.get(request.shares_prompt_with or "")
        prompt = request.prompt_token_ids
        whole = request.sampling_params.prompt_logprobs is not None  # computed whole
        decode = self._local_decode(prompt, decodes, sibling, whole)
        if decode is None:
            return self._to_prefill(request, prefills, sibling)
        # Computed where it decodes (local_prefill.py), if the decode instance finds that
        # little uncached; else it fails there unrun, and goes to a prefill instance.
        local = KVTransferParams(max_uncached_tokens=self._local_limit)
        sent = msgspec.structs.replace(request, kv_transfer_params=local)
        index = self._send_request(decode, sent)
        self._local[request.request_id] = request
        self._track(request.request_id, prompt, [])
        return index

    def _to_prefill(
        self,
        request: EngineCoreRequest,
        prefills: list[EngineConnection],
        sibling: EngineConnection | None,
    ) -> int:
        """Send request (as the caller sent it) to a prefill instance: its sibling's, or
        as its prompt's prefix and the load choose."""
        if sibling in prefills and sibling.dead is None:
            prefill = sibling
        else:
            prefill = place(request.prompt_token_ids, prefills, self._affinity)
        sent = msgspec.structs.replace(
            request, kv_transfer_params=KVTransferParams(do_remote_decode=True)
        )
        index = self._send_request(prefill, sent)
        self._prefilling[request.request_id] = request
        return index

    def _on_outputs(
        self, engine: EngineConnection, msg: EngineCoreOutputs, events: list[Event]
    ) -> None:
        if self._role(engine) == "decode":
            for request_id in msg.request_ids:
                self._awaiting_kv.pop(request_id, None)
                self._local.pop(request_id, None)  # it ran there
            if self._decoded is not None:
                self._record_ended(engine, msg, self._decoded)
            super()._on_outputs(engine, msg, events)
            return
        handed = [(f.index, f.kv_transfer) for f in msg.finished if f.kv_transfer is not None]
        if handed:  # they go on: not finished for the caller
            msg.finished = [f for f in msg.finished if f.kv_transfer is None]
        lost = [self._hand_on(engine, msg, index, kv) for index, kv in handed]
        super()._on_outputs(engine, msg, events)
        lost_ids = [request_id for request_id in lost if request_id is not None]
        if lost_ids:  # every decode instance is gone
            decode = self._instances("decode")[0]
            events.append(Failed(decode.index, lost_ids, decode.dead, fatal=True))  # type: ignore[arg-type]

    def _on_failure(
        self, engine: EngineConnection, msg: EngineCoreFailure, events: list[Event]
    ) -> None:
        """As EngineCoreClient's, but for requests a decode instance did not run, too
        little of their prompt cached there: they go to a prefill instance."""
        declined = msg.exc_type == PROMPT_NOT_CACHED and not msg.fatal
        local = [i for i in msg.request_ids if declined and i in self._local]
        others = [i for i in msg.request_ids if i not in local]
        if others or not local:
            super()._on_failure(engine, msgspec.structs.replace(msg, request_ids=others), events)
        for request_id in local:
            request = self._local[request_id]
            if self._affinity is not None:  # its record was wrong: forget what is not there
                prompt, size = request.prompt_token_ids, self._affinity.block_size
                # More than the limit uncached: no more than this many full blocks cached.
                cached = (len(prompt) - self._local_limit - 1) // size
                self._affinity.forget(engine.index, prompt_hashes(prompt, size, None)[cached:])
            self._forget(request_id)
            prefills = [e for e in self._instances("prefill") if e.dead is None]
            if not prefills:  # every one is gone
                lost = self._instances("prefill")[0].dead
                events.append(Failed(engine.index, [request_id], lost, fatal=False))  # type: ignore[arg-type]
                continue
            sibling = self._owner.get(request.shares_prompt_with or "")
            self._to_prefill(request, prefills, sibling)

    def _hand_on(
        self, prefill: EngineConnection, msg: EngineCoreOutputs, index: int, kv: RemoteKV
    ) -> str | None:
        """The prefill of msg's request index is done: on to a decode instance. Its id
        if every decode instance is gone (it fails), else None."""
        request_id = msg.request_ids[index]
        request = self._prefilling.pop(request_id, None)
        self._forget(request_id)
        if request is None:
            return None  # aborted by its caller meanwhile: the abort withdraws its KV there
        live = [e for e in self._instances("decode") if e.dead is None]
        if not live:
            return request_id
        at = index if msg.token_offsets is None else int(msg.token_offsets[index])
        params = KVTransferParams(remote=kv, first_token=int(msg.new_token_ids[at]))
        # Prompt logprobs came with the prefill's first output: the decode side never
        # computes the prompt, and refuses a request that asks for them.
        sampling = msgspec.structs.replace(request.sampling_params, prompt_logprobs=None)
        decode = msgspec.structs.replace(
            request, sampling_params=sampling, kv_transfer_params=params, shares_prompt_with=None
        )
        near = _near(prefill, live)
        chosen = place(decode.prompt_token_ids, near, self._affinity, self._decode_blocks)
        self._send_request(chosen, decode)
        self._awaiting_kv[request_id] = prefill
        self._track(request_id, decode.prompt_token_ids, [params.first_token])
        return None

    def _track(self, request_id: str, prompt: np.ndarray, first: list[int]) -> None:
        """Follow the tokens of a request sent to a decode instance, where the local rule
        counts on its record."""
        if self._decoded is not None and self._affinity is not None:
            self._decoded.start(request_id, prompt, first)

    def _record_ended(
        self, engine: EngineConnection, msg: EngineCoreOutputs, decoded: DecodedTokens
    ) -> None:
        """A decode instance's step: its tokens followed, and what its requests that ended
        leave in its cache recorded there."""
        decoded.add(msg)
        for finished in msg.finished:
            self._record(engine, msg.request_ids[finished.index], decoded)

    def _record(self, engine: EngineConnection, request_id: str, decoded: DecodedTokens) -> None:
        """What request_id, ending on decode instance engine, leaves in its cache: recorded
        as sent there."""
        held, affinity = decoded.end(request_id), self._affinity
        if held is not None and affinity is not None:
            affinity.sent(engine.index, prompt_hashes(held, affinity.block_size, None))

    def abort(self, request_ids: Iterable[str], reason: str = "abort") -> None:
        ids = list(request_ids)
        if reason == "stop" and self._decoded is not None:  # ended by a stop string:
            for request_id in ids:  # what it decoded stays cached where it ran
                engine = self._owner.get(request_id)
                if engine is not None and self._role(engine) == "decode":
                    self._record(engine, request_id, self._decoded)
        # Its KV may not be pulled yet: the prefill instance withdraws it, rather than hold
        # its blocks until the KV timeout.
        staged: dict[EngineConnection, list[str]] = {}
        for request_id in ids:
            prefill = self._awaiting_kv.get(request_id)
            if prefill is not None and prefill.dead is None:
                staged.setdefault(prefill, []).append(request_id)
        super().abort(ids, reason)
        for prefill, held in staged.items():
            self._send(prefill, AbortRequests(held, reason))  # type: ignore[arg-type]

    @property
    def _decode_blocks(self) -> int | None:
        """How many of a prompt's blocks the decode instances' prefix records keep: all
        where the local rule counts on them."""
        return None if self._local_limit else MAX_BLOCKS

    def _local_decode(
        self,
        prompt: np.ndarray,
        decodes: list[EngineConnection],
        sibling: EngineConnection | None,
        whole: bool,
    ) -> EngineConnection | None:
        """The decode instance that computes this prompt itself (local_prefill.py), or
        None: its sibling's where that one is on a decode instance, else the one that was
        sent the most of it (prefix_affinity.py). whole: every position is computed
        (prompt logprobs), so the prompt counts as uncached."""
        limit, affinity = self._local_limit, self._affinity
        if limit == 0:
            return None
        shared = sibling if sibling in decodes and sibling.dead is None else None
        if len(prompt) <= limit:  # whatever is cached
            return shared or place(prompt, decodes, affinity, self._decode_blocks)
        live = [e for e in decodes if e.dead is None]
        if affinity is None or not live or whole:  # none cached, known or counted; none live
            return None
        size = affinity.block_size
        hashes = prompt_hashes(prompt, size)  # the first MAX_BLOCKS: where most miss
        decode = shared or affinity.choose(hashes, live)
        if affinity.matched(hashes, decode.index) == MAX_BLOCKS:  # then the rest
            hashes = prompt_hashes(prompt, size, None)
        # Full blocks, a token short of the prompt at most (the engine core computes it).
        matched = min(affinity.matched(hashes, decode.index), (len(prompt) - 1) // size)
        if not computes_locally(len(prompt), matched * size, limit):
            return None
        if len(hashes) < len(prompt) // size:  # recorded whole (_decode_blocks)
            hashes = prompt_hashes(prompt, size, None)
        affinity.sent(decode.index, hashes)
        return decode

    def _forget(self, request_id: str) -> EngineConnection | None:
        if self._decoded is not None:
            self._decoded.drop(request_id)
        self._prefilling.pop(request_id, None)
        self._awaiting_kv.pop(request_id, None)
        self._local.pop(request_id, None)
        return super()._forget(request_id)

    def _lose(self, engine: EngineConnection, error: Exception, events: list[Event]) -> None:
        role = self._role(engine)
        if role is None:  # before its Ready: nothing was routed there
            super()._lose(engine, error, events)
            return
        lost = InstanceLostError(role, error)
        waiting = sorted(r for r, prefill in self._awaiting_kv.items() if prefill is engine)
        by_decode: dict[EngineConnection, list[str]] = {}
        for request_id in waiting:
            decode = self._forget(request_id)
            if decode is not None and decode.dead is None:
                by_decode.setdefault(decode, []).append(request_id)
        super()._lose(engine, lost, events)
        for decode, ids in by_decode.items():
            self._send(decode, AbortRequests(ids))  # type: ignore[arg-type]
        if waiting:
            events.append(Failed(engine.index, waiting, lost, fatal=True))


def _near(prefill: EngineConnection, decodes: list[EngineConnection]) -> list[EngineConnection]:
    """The decode instances of decodes (live) on prefill's host that are within SLACK
    requests of the least loaded of decodes, where there are any; else decodes."""
    host = prefill.ready.host_id if prefill.ready is not None else ""
    if not host:
        return decodes
    least = min(e.load for e in decodes)
    near = [
        e
        for e in decodes
        if e.ready is not None and e.ready.host_id == host and e.load <= least + SLACK
    ]
    return near or decodes


def client_maker(
    disaggregate: bool, max_local_prefill_tokens: int | None = None
) -> Callable[..., EngineCoreClient]:
    """What makes a deployment's client (EngineCoreClient's arguments): of replicas, or
    with disaggregate the router over prefill and decode instances (the options checked
    where they were given: check_pair_options, RemotePlan.from_options)."""
    if not disaggregate:
        return EngineCoreClient
    return functools.partial(DisaggregatedClient, max_local_prefill_tokens=max_local_prefill_tokens)
