"""Engine cores served on their own (`zmqworker engine-core` over CURVE tcp) and clients
that connect to them (LLM(engine_core_addresses=...)): real processes on this host
standing for other hosts."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from messages import SamplingParams
from tests.test_engine_e2e import PROMPTS, checkpoint_with_tokenizer, hf_greedy
from tests.test_executor import alive, wait_gone
from tests.test_serve import Server
from tests.test_serve_disaggregated import colocated, complete_all  # noqa: F401 (a fixture)
from zmqworker.frontend import engine_connection
from zmqworker.frontend.disaggregated_plan import free_ports
from zmqworker.frontend.errors import EngineCoreDiedError, EngineCoreStartupError
from zmqworker.frontend.llm import LLM
from zmqworker.transport.curve import CoreKeys, KVKeys

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
ENGINE = [
    "--device", "cpu", "--dtype", "float32", "--block-size", "4", "--max-model-len", "96",
    "--max-num-batched-tokens", "24", "--kv-cache-bytes", "1MiB",
]  # fmt: skip


@pytest.fixture
def keys(monkeypatch: pytest.MonkeyPatch) -> tuple[CoreKeys, KVKeys]:
    """The deployment's pairs, in this process's environment (the clients') and so in the
    engine cores' this test starts."""
    pairs = CoreKeys.new(), KVKeys.new()
    for pair in pairs:
        monkeypatch.setenv(pair.ENV, pair.to_env())
    return pairs


@contextmanager
def engine_core(*options: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """`zmqworker engine-core` on a free port of this host, listening: (its process, its
    address); SIGTERM at the end. Clients connect once it listens, as operators start the
    engine cores first (a client gives up on an address nothing answers at)."""
    port = free_ports(1)
    address = f"tcp://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "zmqworker", "engine-core", "--listen", address, *options]
    proc = subprocess.Popen(argv)
    try:
        deadline = time.monotonic() + 240
        while not listening(port):
            assert proc.poll() is None and time.monotonic() < deadline, "it did not listen"
            time.sleep(0.1)
        yield proc, address
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def tiny_core(*options: str):
    return engine_core("--model", checkpoint_with_tokenizer(), *ENGINE, *options)


def connect(*addresses: str, **kw) -> LLM:
    return LLM(model=checkpoint_with_tokenizer(), engine_core_addresses=list(addresses), **kw)


def test_clients_come_and_go_and_the_engine_core_serves_on(keys) -> None:
    """Greedy tokens equal transformers'; a client's shutdown leaves the engine core
    serving the next; a client without the pair is refused at the handshake; the engine
    core stopped, its client's next request fails naming its address, and its workers
    leave with it."""
    with tiny_core() as (proc, address):
        with connect(address) as llm:
            assert llm.engine_core_pids == [proc.pid]
            outs = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == [hf_greedy(tuple(p), 6) for p in PROMPTS]
        assert proc.poll() is None
        cli = [sys.executable, "-m", "zmqworker", "generate", "Hello", "--model"]
        cli += [checkpoint_with_tokenizer(), "--engine-core-address", address]
        run = subprocess.run(
            [*cli, "--max-tokens", "3", "--temperature", "0", "--json"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode == 0 and len(json.loads(run.stdout)["token_ids"]) == 3, run.stderr
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(CoreKeys.ENV, CoreKeys.new().to_env())
            started = time.monotonic()
            with pytest.raises(EngineCoreStartupError, match="CURVE handshake failed"):
                connect(address)
            assert time.monotonic() - started < 10
        llm = connect(address)
        workers = llm.worker_pids
        assert workers and all(alive(p) for p in workers)
        proc.send_signal(signal.SIGTERM)
        with pytest.raises(EngineCoreDiedError, match=f"at {address}"):
            llm.generate(PROMPTS[:1], GREEDY)
        llm.shutdown()
        assert proc.wait(10) == 128 + signal.SIGTERM
        assert wait_gone(workers, 10.0)


def test_a_disaggregated_pair_on_two_engine_cores(keys) -> None:
    """A prefill engine core and a decode one, each started on its own with the KV pair
    and given to the client in either order (each Ready says its role): every prompt
    prefilled on one, its KV pulled to the other over CURVE tcp (a prompt of at most
    --max-local-prefill-tokens computed on the decode one), gives transformers' greedy
    tokens."""
    kv = ("--kv-host", "127.0.0.1", "--kv-port", str(free_ports(1)))
    with (
        tiny_core("--disaggregate-role", "prefill", *kv) as (_, prefill),
        tiny_core("--disaggregate-role", "decode") as (_, decode),
        connect(decode, prefill, disaggregate=True, max_local_prefill_tokens=4) as llm,
    ):
        sent: list[tuple[int, str]] = []  # (prompt length, the role it went to)
        send = llm.client._send_request

        def recorded(engine, request):
            sent.append((len(request.prompt_token_ids), engine.ready.kv_role))
            return send(engine, request)

        llm.client._send_request = recorded
        outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [hf_greedy(tuple(p), 6) for p in PROMPTS]
    assert sorted(sent) == sorted(
        [(len(p), "consumer") for p in PROMPTS]
        + [(len(p), "producer") for p in PROMPTS if len(p) > 4]
    )


def test_two_names_of_one_engine_core_are_refused(keys) -> None:
    """Not two replicas: one engine core counted twice (its load, its stats)."""
    with tiny_core() as (_, address):
        alias = address.replace("127.0.0.1", "localhost")
        with pytest.raises(ValueError, match=f"{address} and {alias} name one engine core"):
            connect(address, alias)


def test_nothing_at_the_address_fails_within_the_reach_timeout(keys, monkeypatch) -> None:
    monkeypatch.setattr(engine_connection, "REACH_TIMEOUT_S", 1.0)
    address = f"tcp://127.0.0.1:{free_ports(1)}"
    with pytest.raises(EngineCoreStartupError, match=f"at {address}: nothing answered"):
        connect(address)


def test_what_engine_core_addresses_cannot_take(keys, monkeypatch) -> None:
    """Each refused with a ValueError that names it, before any socket opens."""
    address = "tcp://127.0.0.1:7100"
    for kw, match in [
        ({"engine_core_addresses": ["ipc:///tmp/x.sock"]}, "must be tcp://HOST:PORT"),
        ({"engine_core_addresses": ["tcp://127.0.0.1:0"]}, "must be tcp://HOST:PORT"),
        ({"engine_core_addresses": [address, address]}, "names one engine core twice"),
        ({"engine_core_addresses": [address], "disaggregate": True}, "at least two"),
        ({"engine_core_addresses": [address], "data_parallel_size": 2}, "data_parallel_size"),
        ({"engine_core_addresses": [address], "kv_port": 9000}, "kv_port"),
        (
            {"engine_core_addresses": [address], "max_local_prefill_tokens": 4},
            "max_local_prefill_tokens=4 needs disaggregate=True",
        ),
        ({"engine_core_addresses": [address], "max_num_seqs": 4}, "the engine cores' to take"),
        ({"engine_core_addresses": ["tcp://*:7100"]}, "not a wildcard"),
    ]:
        with pytest.raises(ValueError, match=match):
            LLM(model=checkpoint_with_tokenizer(), **kw)
    monkeypatch.delenv(CoreKeys.ENV)
    with pytest.raises(ValueError, match=CoreKeys.ENV):
        connect(address)


def test_the_engine_core_command_refuses_before_it_starts(keys) -> None:
    """Exit status 1 and a line naming what is wrong, with no worker started."""
    model = ["--model", checkpoint_with_tokenizer(), *ENGINE]
    cases = [
        (["--listen", "ipc:///tmp/core.sock"], {}, "must be tcp://HOST:PORT"),
        (["--listen", "tcp://127.0.0.1:7101"], {CoreKeys.ENV: ""}, CoreKeys.ENV),
        (
            ["--listen", "tcp://127.0.0.1:7101", "--disaggregate-role", "prefill"],
            {},
            "needs --kv-host and --kv-port",
        ),
        (
            ["--listen", "tcp://127.0.0.1:7101", "--disaggregate-role", "decode"],
            {KVKeys.ENV: ""},
            KVKeys.ENV,
        ),
        (["--listen", "tcp://127.0.0.1:7101", "--kv-port", "9000"], {}, "are a prefill's"),
        (
            ["--listen", "tcp://127.0.0.1:7101", "--disaggregate-role", "decode", "--kv-port", "1"],
            {},
            "are a prefill's",
        ),
        (
            ["--listen", "tcp://127.0.0.1:7101", "--kv-transfer-timeout", "5"],
            {},
            "needs --disaggregate-role",
        ),
        (
            [
                "--listen",
                "tcp://127.0.0.1:7101",
                "--disaggregate-role",
                "prefill",
                "--kv-host",
                "0.0.0.0",
                "--kv-port",
                "9000",
            ],
            {},
            "not a wildcard",
        ),  # fmt: skip
    ]
    for argv, env, message in cases:
        run = subprocess.run(
            [sys.executable, "-m", "zmqworker", "engine-core", *argv, *model],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert run.returncode == 1, (argv, run.stderr)
        assert message in run.stderr, (argv, run.stderr)


def test_first_gpu_places_the_ranks_on_the_gpus_from_there(keys, monkeypatch) -> None:
    """--first-gpu sets where the engine core's ranks start on the host's GPUs, refused
    by name where they would not fit, or on the CPU."""
    from zmqworker.cli import engine_core
    from zmqworker.frontend import devices

    sub = argparse.ArgumentParser().add_subparsers()
    parser = engine_core.add_parsers(sub)["engine-core"]
    model = ["--listen", "tcp://127.0.0.1:7101", "--model", checkpoint_with_tokenizer()]

    def config(*argv: str):
        return engine_core.engine_core_config(parser.parse_args([*model, *argv]))

    with pytest.raises(ValueError, match="--first-gpu places ranks on GPUs: the device is cpu"):
        config("--device", "cpu", "--first-gpu", "1")
    monkeypatch.setenv("ZMQWORKER_SHARE_GPUS", "1")  # a plan for CUDA on a host without one
    monkeypatch.setattr(devices, "visible_gpu_count", lambda: 4)
    placed = config("--device", "cuda", "--tp", "2", "--first-gpu", "2").worker.parallel
    assert placed.first_local_rank == 2 and placed.tensor_parallel_size == 2
    with pytest.raises(ValueError, match=r"needs GPUs 3 \.\. 4, but 4 GPU\(s\) are visible"):
        config("--device", "cuda", "--tp", "2", "--first-gpu", "3")


def test_keys_prints_both_pairs_for_a_shell() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "zmqworker", "keys"], capture_output=True, text=True, timeout=60
    )
    lines = run.stdout.splitlines()
    assert [line.split("=")[0] for line in lines] == [
        f"export {CoreKeys.ENV}",
        f"export {KVKeys.ENV}",
    ]
    assert all(len(line.split("=", 1)[1].strip("'")) == 81 for line in lines)


def test_serve_over_an_engine_core_served_on_its_own(keys, colocated) -> None:  # noqa: F811
    """`zmqworker serve --engine-core-address` on the embedded model: greedy completions
    equal the colocated server's, and the server's SIGTERM leaves the engine core
    serving (it is not the server's to stop)."""
    with engine_core("--max-model-len", "512", "--max-num-seqs", "8") as (core, address):
        srv = Server("--engine-core-address", address, "--api-server-count", "1", engine=False)
        try:
            expected = complete_all(colocated, stream=False)
            assert complete_all(srv, stream=False) == expected
            assert complete_all(srv, stream=True) == expected
        finally:
            assert srv.stop() == 0, srv.output()[-3000:]
        assert core.poll() is None


def test_serve_a_disaggregated_pair_of_engine_cores_served_on_their_own(keys, colocated) -> None:  # noqa: F811
    """`zmqworker serve --disaggregate` over a prefill and a decode engine core, each
    started on its own: greedy completions equal the colocated server's."""
    sizes = ("--max-model-len", "512", "--max-num-seqs", "8")
    kv = ("--kv-host", "127.0.0.1", "--kv-port", str(free_ports(1)))
    with (
        engine_core("--disaggregate-role", "prefill", *kv, *sizes) as (_, prefill),
        engine_core("--disaggregate-role", "decode", *sizes) as (_, decode),
    ):
        addresses = ("--engine-core-address", prefill, "--engine-core-address", decode)
        local = ("--max-local-prefill-tokens", "4")  # the router's: taken by this client
        srv = Server("--disaggregate", *addresses, *local, "--api-server-count", "1", engine=False)
        try:
            assert complete_all(srv, stream=False) == complete_all(colocated, stream=False)
        finally:
            assert srv.stop() == 0, srv.output()[-3000:]
