"""A pull over tcp split by layers over several connections (kv_transfer/tcp_parts.py):
the parts a pull takes, the server's answer to a part (its layers alone, without heads
or blocks it was not asked), the parts of a real producer landing byte for byte, a part
that fails failing its load once, with one KVDone to the server, and a pull that times out
saying one KVDone when its first late answer comes, whatever its late parts, so the
staging goes then, not at its expiry."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
import zmq

from messages.kv_peer import KVBlocks, KVDone, KVPull
from messages.kv_transfer import KVConnectorMetadata, KVLoad, KVSave, RemoteKV
from tests.test_kv_connector import (
    SPEC,
    caches,
    connector,
    free_port,
    names,
    peer,
    until,
)
from zmqworker.kv_transfer import tcp_parts, wire
from zmqworker.kv_transfer.blocks import layout_of
from zmqworker.kv_transfer.tcp_parts import TCP_STREAMS, layer_parts

MIB = 1 << 20
pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")


def test_a_pull_is_split_into_runs_of_whole_layers() -> None:
    assert TCP_STREAMS == 4
    assert layer_parts(32, 16 * MIB) == [(0, 8), (8, 8), (16, 8), (24, 8)]
    assert layer_parts(30, 16 * MIB) == [(0, 7), (7, 8), (15, 7), (22, 8)]
    assert layer_parts(32, 2 * MIB + 1) == [(0, 16), (16, 16)]  # parts of 1 MiB at least
    assert layer_parts(3, 16 * MIB) == [(0, 1), (1, 1), (2, 1)]  # a layer a part at most
    assert layer_parts(32, MIB - 1) == [(0, 32)]  # one pull


def test_the_server_answers_a_part_with_its_layers_alone() -> None:
    """A part names its layers (and may name heads and a first block, as any pull): the
    frame holds those layers' bytes alone; layers past the staging are refused by name."""
    port = free_port()
    kv = caches(8, seed=7)
    side = connector("producer", kv, port)
    ctx = zmq.Context()
    try:
        side.after_step(KVConnectorMetadata(saves=[KVSave("p", np.array([6, 2, 4], np.int32), 12)]))
        sock = peer(ctx, zmq.DEALER, f"tcp://127.0.0.1:{port}")
        asked = [KVPull("p", 0, layers=(1, 1)),
                 KVPull("p", 0, heads=(1, 1), first_block=1, layers=(0, 1)),
                 KVPull("p", 0, host_id="anything", layers=(1, 2))]  # fmt: skip
        answers = []
        for pull in asked:
            sock.send(wire.encode(pull))
            assert sock.poll(5000), "no answer"
            answers.append(sock.recv_multipart())
        sock.send(wire.encode(KVDone("p")))
        assert "p" in names(until(side, bool), "finished_sending")
    finally:
        ctx.destroy(linger=0)
        side.shutdown()
    whole, part, refused = (wire.decode(a[0]) for a in answers)
    assert (whole.layers, whole.error, whole.shared) == ((1, 1), None, None)
    data = np.frombuffer(answers[0][1], np.float32).reshape(2, 3, 2, -1)
    assert np.array_equal(data, kv[1][:, [6, 2, 4]].cpu().numpy())
    assert (part.layers, part.first_block) == ((0, 1), 1)
    data = np.frombuffer(answers[1][1], np.float32).reshape(2, 2, 1, -1)
    assert np.array_equal(data, kv[0][:, [2, 4], 1:].cpu().numpy())
    assert len(answers[2]) == 1 and refused.layers == (1, 2)  # the part it refuses
    assert refused.error == "layers (1, 2) asked of rank 0's 2"


@pytest.mark.parametrize("num_cached", [0, 1], ids=["all", "after-hits"])
def test_a_split_pull_lands_byte_for_byte(monkeypatch, num_cached: int) -> None:
    """Over tcp, with parts as small as one layer: a part a layer over a connection of
    its own, put together and copied in as one answer; the producer hears KVDone once
    and lets the staging go."""
    monkeypatch.setattr(tcp_parts, "MIN_PART_BYTES", 1)
    port = free_port()
    kv = caches(8, seed=8)
    side = connector("producer", kv, port)
    target = caches(8, seed=9)
    before = [t.clone() for t in target]
    consumer = connector("consumer", target, 0, shared_memory=False)
    source, dest = [5, 1, 7], [0, 6, 3]
    try:
        side.after_step(KVConnectorMetadata(saves=[KVSave("s", np.array(source, np.int32), 12)]))
        remote = RemoteKV("s", 12, [f"tcp://127.0.0.1:{port}"])
        load = KVLoad("s", np.array(dest, np.int32), remote, num_cached_blocks=num_cached)
        consumer.before_step(KVConnectorMetadata(loads=[load]))
        until(consumer, lambda outs: names(outs, "finished_recving") == ["s"])
        assert consumer.puller.num_pulled["tcp"] == 1
        block_bytes = 2 * 2 * SPEC.num_kv_heads * SPEC.block_size * SPEC.head_size * 4
        assert consumer.puller.num_bytes["tcp"] == (3 - num_cached) * block_bytes
        assert consumer.puller._sockets.num_sockets == len(SPEC.layer_names)  # connections
        assert "s" in names(until(side, bool), "finished_sending")
    finally:
        consumer.shutdown()
        side.shutdown()
    for layer in range(len(SPEC.layer_names)):
        assert torch.equal(target[layer][:, dest[num_cached:]], kv[layer][:, source[num_cached:]])
        assert torch.equal(target[layer][:, dest[:num_cached]], before[layer][:, dest[:num_cached]])


@pytest.mark.parametrize("second", ["refused", "twice"])
def test_a_failed_part_fails_its_load_once(monkeypatch, second: str) -> None:
    """Of a pull's two parts, one lands and the other is refused (or the first part is
    answered again before the second lands): the load fails once, naming why, nothing is
    copied in, and the server hears one KVDone."""
    monkeypatch.setattr(tcp_parts, "MIN_PART_BYTES", 1)
    address = f"tcp://127.0.0.1:{free_port()}"
    target = caches(6, seed=10)
    before = [t.clone() for t in target]
    ctx = zmq.Context()
    consumer = connector("consumer", target, 0, shared_memory=False)
    try:
        server = peer(ctx, zmq.ROUTER, address)
        remote = RemoteKV("f", 8, [address])
        consumer.before_step(
            KVConnectorMetadata(loads=[KVLoad("f", np.array([4, 1], np.int32), remote)])
        )
        pulls = []
        for _ in range(2):
            assert server.poll(5000), "no pull"
            who, body = server.recv_multipart()
            pulls.append((who, wire.decode(body)))
        assert pulls[0][0] != pulls[1][0]  # two connections
        assert sorted(p.layers for _, p in pulls) == [(0, 1), (1, 1)]
        assert all(p.host_id == "" and p.gpus == [] for _, p in pulls)
        staged = torch.randn(2, 2, SPEC.num_kv_heads, 32).numpy()  # a layer of 2 blocks
        first = next((who, p) for who, p in pulls if p.layers == (0, 1))
        layout = layout_of(SPEC)
        server.send_multipart([first[0], wire.encode(KVBlocks("f", layout, 2, layers=(0, 1))),
                               staged])  # fmt: skip
        other = next(who for who, p in pulls if p.layers == (1, 1))
        if second == "refused":
            refusal = KVBlocks("f", error="layer 1: gone", layers=(1, 1))
            server.send_multipart([other, wire.encode(refusal)])
        else:
            for who, layers in ((first[0], (0, 1)), (other, (1, 1))):
                reply = KVBlocks("f", layout, 2, layers=layers)
                server.send_multipart([who, wire.encode(reply), staged])
        [failure] = names(until(consumer, bool), "failed_recving")
        assert server.poll(5000), "no KVDone"
        assert wire.decode(server.recv_multipart()[1]) == KVDone("f")
        assert not server.poll(300), "a second KVDone"
    finally:
        consumer.shutdown()
        ctx.destroy(linger=0)
    assert failure.req_id == "f" and f"from {address}" in failure.error
    expected = "layer 1: gone" if second == "refused" else "not a part asked, or one answered"
    assert expected in failure.error
    for layer in range(len(SPEC.layer_names)):
        assert torch.equal(target[layer], before[layer])


def test_a_producer_is_split_pulled_once_it_answered_over_tcp(monkeypatch) -> None:
    """With shared memory on, a producer's host is known from its first answer: the first
    pull goes whole (here over tcp: the producer says another host), the next ones from
    it in parts, a connection each."""
    monkeypatch.setattr(tcp_parts, "MIN_PART_BYTES", 1)
    port = free_port()
    kv = caches(8, seed=11)
    side = connector("producer", kv, port)
    side.server._host_id = "another-host"
    target = caches(8, seed=12)
    consumer = connector("consumer", target, 0, shared_memory=True)
    try:
        for i, dest in enumerate(([0, 1], [2, 3])):
            req = f"h{i}"
            side.after_step(KVConnectorMetadata(saves=[KVSave(req, np.array([4, 5], np.int32), 8)]))
            remote = RemoteKV(req, 8, [f"tcp://127.0.0.1:{port}"])
            load = KVLoad(req, np.array(dest, np.int32), remote)
            consumer.before_step(KVConnectorMetadata(loads=[load]))
            until(consumer, lambda outs, req=req: names(outs, "finished_recving") == [req])
            connections = consumer.puller._sockets.num_sockets
            assert connections == (1 if i == 0 else len(SPEC.layer_names))
        assert consumer.puller.num_pulled["tcp"] == 2
    finally:
        consumer.shutdown()
        side.shutdown()
    for layer in range(len(SPEC.layer_names)):
        assert torch.equal(target[layer][:, [0, 1]], kv[layer][:, [4, 5]])
        assert torch.equal(target[layer][:, [2, 3]], kv[layer][:, [4, 5]])


def test_a_split_pull_timed_out_drops_its_late_parts_and_the_puller_goes_on(monkeypatch) -> None:
    """One part answered, the other not within the timeout: the load fails naming the
    address; the late answers are dropped, the first saying KVDone (the server counts
    KVDones by request, not by part; before an answer the KV may not be staged yet), and
    the next pull from the same server lands."""
    monkeypatch.setattr(tcp_parts, "MIN_PART_BYTES", 1)
    address = f"tcp://127.0.0.1:{free_port()}"
    target = caches(6, seed=13)
    ctx = zmq.Context()
    consumer = connector("consumer", target, 0, shared_memory=False, timeout_s=0.5)
    layout = layout_of(SPEC)
    staged = torch.randn(2, 2, SPEC.num_kv_heads, 32).numpy()  # a layer of 2 blocks
    try:
        server = peer(ctx, zmq.ROUTER, address)
        for req in ("late", "next"):
            load = KVLoad(req, np.array([4, 1], np.int32), RemoteKV(req, 8, [address]))
            consumer.before_step(KVConnectorMetadata(loads=[load]))
            pulls = []
            for _ in range(2):
                assert server.poll(5000), "no pull"
                who, body = server.recv_multipart()
                pulls.append((who, wire.decode(body).layers))
            answered = pulls if req == "next" else pulls[:1]
            for who, layers in answered:
                reply = KVBlocks(req, layout, 2, layers=layers)
                server.send_multipart([who, wire.encode(reply), staged])
            outputs = until(consumer, bool)
            if req == "late":
                [failure] = names(outputs, "failed_recving")
                assert f"no answer from {address} within 0.5 s" in failure.error
                assert not server.poll(300), "a KVDone before any answer came late"
                who, layers = pulls[1]
                late = wire.encode(KVBlocks(req, layout, 2, layers=layers))
                for _ in range(2):  # the late part, and the same again
                    server.send_multipart([who, late, staged])
                assert server.poll(5000), "no KVDone once the late part came"
                assert wire.decode(server.recv_multipart()[1]) == KVDone(req)
                assert not server.poll(300), "a second KVDone for one pull"
            else:
                assert names(outputs, "finished_recving") == ["next"]
                assert server.poll(5000), "no KVDone"
                assert wire.decode(server.recv_multipart()[1]) == KVDone("next")
    finally:
        consumer.shutdown()
        ctx.destroy(linger=0)
    for layer in range(len(SPEC.layer_names)):
        assert torch.equal(
            target[layer][:, [4, 1]], torch.from_numpy(staged[:, :2]).to(target[layer])
        )


@pytest.mark.parametrize("num_parts", [2, 1], ids=["split", "whole"])
def test_a_pull_timed_out_lets_the_staging_go_with_one_kvdone(monkeypatch, num_parts) -> None:
    """A real producer answers a pull only once the consumer has given up on it (its
    timeout): the first late answer makes the consumer say KVDone, so the producer lets
    the staging go long before its own expiry, and hears that KVDone alone, however many
    late parts go back with their bytes; the next pull from it lands."""
    if num_parts > 1:
        monkeypatch.setattr(tcp_parts, "MIN_PART_BYTES", 1)
    port = free_port()
    side = connector("producer", caches(8, seed=14), port, timeout_s=30.0)  # expires late
    consumer = connector("consumer", caches(8, seed=15), 0, shared_memory=False, timeout_s=0.5)
    server = side.server
    answer, reader_done, send = server._answer, server._reader_done, server._send
    held, gave_up, dones, late = [], threading.Event(), [], []

    def held_answer(peer, pull) -> None:  # the server's thread: "late" once given up on
        if pull.req_id != "late":
            return answer(peer, pull)
        held.append((peer, pull))
        if len(held) == num_parts:  # every part read: the KVDone comes after them
            gave_up.wait(10.0)
            for args in held:
                answer(*args)

    def counted_done(req_id: str) -> None:
        dones.append(req_id)
        reader_done(req_id)

    def sent(peer, reply, data=None) -> bool:
        if reply.req_id == "late":
            late.append((reply.layers, reply.error))
        return send(peer, reply, data)

    server._answer, server._reader_done, server._send = held_answer, counted_done, sent
    address = f"tcp://127.0.0.1:{port}"
    try:
        for req, done in (("late", "failed_recving"), ("next", "finished_recving")):
            side.after_step(KVConnectorMetadata(saves=[KVSave(req, np.array([5, 1], np.int32), 8)]))
            load = KVLoad(req, np.array([0, 3], np.int32), RemoteKV(req, 8, [address]))
            consumer.before_step(KVConnectorMetadata(loads=[load]))
            [reported] = names(until(consumer, bool), done)
            gave_up.set()
            # Let go on the KVDone, long before the staging's expiry (30 s).
            assert names(until(side, bool, timeout=5.0), "finished_sending") == [req]
            if req == "late":
                failure = reported
    finally:
        consumer.shutdown()
        side.shutdown()
    assert f"no answer from {address} within 0.5 s" in failure.error
    expected = [((0, 1), None), ((1, 1), None)] if num_parts > 1 else [(None, None)]
    assert sorted(late, key=str) == expected  # answered late, with their bytes
    # One KVDone each: the late parts came before "next"'s answers on their connections.
    assert dones == ["late", "next"]


def test_a_pull_timed_out_and_refused_late_says_one_kvdone() -> None:
    """A whole pull not answered within the timeout, then refused: the refusal, like one
    in time, says KVDone (the server counted this reader when it refused), once."""
    address = f"tcp://127.0.0.1:{free_port()}"
    ctx = zmq.Context()
    consumer = connector("consumer", caches(6, seed=16), 0, shared_memory=False, timeout_s=0.5)
    try:
        server = peer(ctx, zmq.ROUTER, address)
        load = KVLoad("late", np.array([4, 1], np.int32), RemoteKV("late", 8, [address]))
        consumer.before_step(KVConnectorMetadata(loads=[load]))
        assert server.poll(5000), "no pull"
        who, body = server.recv_multipart()
        assert wire.decode(body).layers is None  # one pull, not parts
        [failure] = names(until(consumer, bool), "failed_recving")
        assert f"no answer from {address} within 0.5 s" in failure.error
        refusal = wire.encode(KVBlocks("late", layout_of(SPEC), 0, error="no KV staged"))
        for _ in range(2):
            server.send_multipart([who, refusal])
        assert server.poll(5000), "no KVDone once the refusal came"
        assert wire.decode(server.recv_multipart()[1]) == KVDone("late")
        assert not server.poll(300), "a second KVDone for one pull"
    finally:
        consumer.shutdown()
        ctx.destroy(linger=0)
