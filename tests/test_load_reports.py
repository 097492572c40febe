"""An engine core tells every client its load (load_reports.py), not only those whose
requests it runs: an API server with no request on a data-parallel replica still sees
the load the others put there, and balances by it."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pytest

from messages import (
    PROTOCOL_VERSION,
    Decoder,
    EngineCoreHello,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreStats,
    SamplingParams,
)
from tests.test_engine_core import fake_llm, fake_model, second_client  # noqa: F401 (fixtures)
from zmqworker.engine.core_clients import Client, Clients
from zmqworker.engine.load_reports import LoadReports, load_of
from zmqworker.frontend.core_client import EngineCoreClient

LONG = SamplingParams(max_tokens=5000, ignore_eos=True)  # ten seconds or more: aborted


def stats(running: int, waiting: int = 0) -> EngineCoreStats:
    return EngineCoreStats(running, waiting, 64, 64, 0, 0)


def now(report: EngineCoreStats) -> tuple[int, Callable[[], EngineCoreStats]]:
    """LoadReports.send's load and stats for an engine core whose stats are report."""
    return load_of(report), lambda: report


def test_a_client_hears_each_change_at_most_once_per_interval() -> None:
    reports = LoadReports(3, every_s=0.2)
    a, b = Client(b"a", 1, 0), Client(b"b", 2, 1)
    sent: list[tuple[bytes, EngineCoreOutputs]] = []

    def send(client: Client, frames: list) -> None:
        sent.append((client.identity, Decoder().decode(frames)))

    reports.send(*now(stats(0)), [a, b], send)
    assert sent == [] and reports.next_in(time.monotonic()) is None  # both heard 0
    reports.told(a, stats(2, 1))  # with a's outputs
    reports.send(*now(stats(2, 1)), [a, b], send)
    [(to, msg)] = sent
    assert to == b"b" and msg.engine_index == 3 and msg.request_ids == []
    assert len(msg.new_token_ids) == 0 and msg.stats == stats(2, 1)
    reports.send(*now(stats(1)), [a, b], send)  # a is due; b heard one just now
    assert [to for to, _ in sent] == [b"b", b"a"]
    wait = reports.next_in(time.monotonic())
    assert wait is not None and 0.1 < wait <= 0.2
    time.sleep(wait)
    reports.send(*now(stats(1)), [a, b], send)  # b's last change, held back, goes now
    assert [to for to, _ in sent] == [b"b", b"a", b"b"] and sent[-1][1].stats == stats(1)
    assert reports.next_in(time.monotonic()) is None


def test_a_client_silent_past_the_active_window_hears_nothing_until_it_sends() -> None:
    """A client that does not read (an LLM between calls) would hold every report."""
    reports = LoadReports(0, every_s=0.0, active_s=0.1)
    clients = Clients("token")
    hello = EngineCoreHello(PROTOCOL_VERSION, "token", 1)
    quiet = clients.admit(b"q", hello)
    assert quiet is not None
    sent: list[bytes] = []
    time.sleep(0.15)
    reports.send(*now(stats(4)), [quiet], lambda client, frames: sent.append(client.identity))
    assert sent == [] and reports.next_in(time.monotonic()) is None
    assert clients.heard_from(b"q") is quiet  # it sent something: it hears the load again
    reports.send(*now(stats(4)), [quiet], lambda client, frames: sent.append(client.identity))
    assert sent == [b"q"] and quiet.told_load == 4


def wait_for_load(client: EngineCoreClient, load: int, timeout: float = 10.0) -> None:
    """Until client's view of engine core 0's load is load; it gets no event meanwhile."""
    deadline = time.monotonic() + timeout
    while client.engines[0].load != load:
        assert time.monotonic() < deadline, f"load {client.engines[0].load}, not {load}"
        assert client.receive(0.05) == []


@pytest.mark.parametrize("ends", ["aborted", "finished"])
def test_a_client_without_requests_sees_another_s_load_come_and_go(fake_llm, ends) -> None:  # noqa: F811
    a, b = second_client(fake_llm), second_client(fake_llm)
    try:
        a.wait_ready(30)
        b.wait_ready(30)
        params = LONG if ends == "aborted" else SamplingParams(max_tokens=200, ignore_eos=True)
        ids = [f"{ends}-{i}" for i in range(3)]
        for request_id in ids:
            a.add_request(EngineCoreRequest(request_id, np.array([5, 6, 7], np.int32), params))
        started = time.monotonic()
        wait_for_load(b, 3)
        received = b._received
        if ends == "aborted":
            a.abort(ids)
        wait_for_load(b, 0)
        took = time.monotonic() - started
        # No more than one report each REPORT_EVERY_S, and the last one.
        assert b._received - received <= took / 0.05 + 2
        assert not b.engines[0].requests and b.drain() == []
    finally:
        a.close()
        b.close()
