"""The router of disaggregated serving, in the client: a client of two engine cores, a
prefill instance (engine core 0) and a decode instance (engine core 1), whose workers
move KV between them (docs/kv_transfer.md).

Each request goes to the prefill instance with do_remote_decode. The output that ends it
there carries its first token and where its prompt's KV waits (FinishedOutput.kv_transfer):
that end is taken out of the output here, so that the caller sees the first token as any
other, and the same request goes to the decode instance with the KV's whereabouts and the
token, from where it streams on. A request whose first token ends it never leaves the
prefill instance. The caller's code (Frontend, the API servers) is the same as over
replicas: aborts go to the instance that runs the request, failures come back by id.

Failures: a request fails with an error naming the instance that failed it. The prefill
instance gone: its own requests fail at once, and so do those the decode instance has
not yet answered (their pull would wait for a prefill that is gone: they are aborted
there, which frees their blocks once any pull under way is over). A pull that fails on
the decode instance (timed out, refused) fails its request there, naming the prefill's
address. Nothing is recomputed: the caller may send the request again.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from messages import (
    AbortRequests,
    EngineCoreOutputs,
    EngineCoreRequest,
    KVTransferParams,
    RemoteKV,
)
from zmqworker.frontend.core_client import EngineCoreClient
from zmqworker.frontend.core_process import EngineCoreHandle
from zmqworker.frontend.engine_connection import EngineConnection, Event, Failed

PREFILL, DECODE = 0, 1
ROLES = ("prefill", "decode")


class InstanceLostError(RuntimeError):
    """A side of a disaggregated pair is gone: which, and how (error)."""

    def __init__(self, role: str, error: Exception) -> None:
        self.role = role
        self.cause = error
        super().__init__(f"the {role} instance: {error}")


class DisaggregatedClient(EngineCoreClient):
    """An EngineCoreClient whose two engine cores are a prefill and a decode instance."""

    def __init__(
        self,
        addresses: Sequence[str],
        handles: Sequence[EngineCoreHandle],
        token: str,
        client_index: int = 0,
        max_output_bytes: int = -1,
    ) -> None:
        if len(addresses) != 2:
            raise ValueError(
                f"disaggregated serving runs two engine cores (prefill, decode), got "
                f"{len(addresses)}"
            )
        super().__init__(addresses, handles, token, client_index, max_output_bytes)
        # Requests on the prefill instance, as the caller sent them: what goes on to decode.
        self._prefilling: dict[str, EngineCoreRequest] = {}
        # Requests handed to the decode instance that it has not answered yet.
        self._awaiting_kv: set[str] = set()

    def add_request(self, request: EngineCoreRequest) -> int:
        if request.kv_transfer_params is not None:
            raise ValueError(
                f"request {request.request_id!r}: the router sets kv_transfer_params itself"
            )
        prefill = self.engines[PREFILL]
        if prefill.dead is not None:
            raise prefill.dead.with_traceback(None)
        sent = msgspec.structs.replace(
            request, kv_transfer_params=KVTransferParams(do_remote_decode=True)
        )
        index = self._send_request(prefill, sent)
        self._prefilling[request.request_id] = request
        return index

    def _on_outputs(
        self, engine: EngineConnection, msg: EngineCoreOutputs, events: list[Event]
    ) -> None:
        if engine.index == DECODE:
            self._awaiting_kv.difference_update(msg.request_ids)
            super()._on_outputs(engine, msg, events)
            return
        handed = [(f.index, f.kv_transfer) for f in msg.finished if f.kv_transfer is not None]
        if handed:  # they go on: not finished for the caller
            msg.finished = [f for f in msg.finished if f.kv_transfer is None]
        lost = [self._hand_on(msg, index, kv) for index, kv in handed]
        super()._on_outputs(engine, msg, events)
        decode = self.engines[DECODE]
        lost_ids = [request_id for request_id in lost if request_id is not None]
        if lost_ids and decode.dead is not None:
            events.append(Failed(DECODE, lost_ids, decode.dead, fatal=True))

    def _hand_on(self, msg: EngineCoreOutputs, index: int, kv: RemoteKV) -> str | None:
        """The prefill of msg's request index is done: on to the decode instance. Its id
        if the decode instance is gone (it fails), else None."""
        request_id = msg.request_ids[index]
        request = self._prefilling.pop(request_id, None)
        self._forget(request_id)
        if request is None:
            return None  # aborted by its caller meanwhile: its staged KV expires there
        if self.engines[DECODE].dead is not None:
            return request_id
        at = index if msg.token_offsets is None else int(msg.token_offsets[index])
        params = KVTransferParams(remote=kv, first_token=int(msg.new_token_ids[at]))
        # Prompt logprobs came with the prefill's first output: the decode side never
        # computes the prompt, and refuses a request that asks for them.
        sampling = msgspec.structs.replace(request.sampling_params, prompt_logprobs=None)
        decode = msgspec.structs.replace(
            request, sampling_params=sampling, kv_transfer_params=params, shares_prompt_with=None
        )
        self._send_request(self.engines[DECODE], decode)
        self._awaiting_kv.add(request_id)
        return None

    def _forget(self, request_id: str) -> EngineConnection | None:
        self._prefilling.pop(request_id, None)
        self._awaiting_kv.discard(request_id)
        return super()._forget(request_id)

    def _lose(self, engine: EngineConnection, error: Exception, events: list[Event]) -> None:
        lost = InstanceLostError(ROLES[engine.index], error)
        waiting = sorted(self._awaiting_kv) if engine.index == PREFILL else []
        super()._lose(engine, lost, events)
        if waiting:
            for request_id in waiting:
                self._forget(request_id)
            decode = self.engines[DECODE]
            if decode.dead is None:
                self._send(decode, AbortRequests(waiting))  # type: ignore[arg-type]
            events.append(Failed(engine.index, waiting, lost, fatal=True))
