"""KV transfer between two workers' caches: the ZeroMQ connector's pull of 16 MiB of
blocks, same host (straight out of the producer's cache: on the CPU from the memfd it
lies in, on CUDA by CUDA IPC; and through a memfd the producer gathers the blocks into)
and over tcp, split over TCP_STREAMS connections as a pull from another host is
(tcp_parts.py) and over one (tcp_one), against the floors of the same run: a memcpy of
16 MiB (same host; on CUDA also a device-to-device copy of as much), and bare pyzmq
moving 16 MiB over the same CURVE tcp, over one connection and over TCP_STREAMS
(pyzmq_curve_streams: each a share, the I/O threads of both sides as many), and without
CURVE, for scale. A transfer is timed from the consumer's load
order to its blocks holding the KV (the copy into the cache included; so is the
producer's gather out of its cache where the pull finds it under way or not begun); the
producer's part after the prefill's step (offering the blocks) is reported apart. Each
load names the producer's blocks, as an engine does, so that an in-place pull is copied
as it goes out (read_ahead.py); each is followed by one that does not (host_cache_asked,
cuda_ipc_asked: the copy waits for the answer). Targets: same host >= 70% of memcpy (in
place), tcp >= 80% of bare pyzmq over as many connections (four, and one).

The host tier's copies of as many blocks (store: cache blocks into scattered host
slots; load: back into other blocks) are timed against the copy of as many bytes in one
piece: a memcpy on the CPU, a pinned device-to-host (host-to-device) copy on CUDA.
Writes bench/results/kv_transfer.json (kv_transfer_cuda.json with --device cuda, where
both caches live on the GPU; the memfds are page-locked). Each side copies with
--threads threads, and so does the memcpy.

    python -m bench.kv_transfer [--device cuda] [--repeats 20] [--threads N]
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing as mp
import os
import socket
import statistics
import threading
import time
from typing import Any

import numpy as np
import torch
import zmq

from bench.common import print_table, write_results
from messages import KVCacheSpec
from messages.kv_transfer import (
    KVConnectorMetadata,
    KVHostCopies,
    KVLoad,
    KVSave,
    KVTransferConfig,
    RemoteKV,
)
from zmqworker.distributed.shared_cache import SharedKVCache
from zmqworker.kv_transfer import tcp_parts
from zmqworker.kv_transfer.host_tier import HostKVConnector
from zmqworker.kv_transfer.tcp_parts import TCP_STREAMS
from zmqworker.kv_transfer.zmq_connector import ZmqKVConnector
from zmqworker.transport.curve import KVKeys, make_server, start_zap

MIB = 1 << 20
# A 7-8B model's layer shape (8 kv heads of 128, float16): 64 KiB a block a layer.
SPEC = KVCacheSpec(16, 8, 128, "float16", [f"layer{i}" for i in range(8)])
BLOCK_BYTES = SPEC.page_size_bytes * len(SPEC.layer_names)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_caches(num_blocks: int, device: str) -> list[torch.Tensor]:
    shape = (2, num_blocks, SPEC.num_kv_heads, SPEC.block_size * SPEC.head_size)
    return [torch.randn(shape).to(torch.float16).to(device) for _ in SPEC.layer_names]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# The producer: its own process ------------------------------------------------------


def producer(
    conn: Any,
    keys: tuple[bytes, bytes],
    ports: dict[str, int],
    blocks: int,
    device: str,
    threads: int,
) -> None:
    """Serves staged KV (the connector) and, for the floor, replies of the bytes asked
    from bare pyzmq ROUTERs, with CURVE and without; stages on each "stage" order."""
    torch.set_num_threads(threads)
    kv_keys = KVKeys(*keys)
    kv, shared = make_caches(blocks * 2, device), None
    sides = {}
    if device == "cpu":  # as a producer worker's host cache: in a memfd
        shared = SharedKVCache(len(kv), tuple(kv[0].shape), kv[0].dtype)
        for mine, layer in zip(shared.layers, kv, strict=True):
            mine.copy_(layer)
        kv = shared.layers
        config = KVTransferConfig(role="producer", port=ports["kv_shared"], timeout_s=60.0)
        sides["host_cache"] = ZmqKVConnector(config, lambda: kv, SPEC, 0, 1, kv_keys,
                                             shared_cache=lambda: shared)  # fmt: skip
    # The memfd and tcp paths' producer: the same cache, not read in place.
    config = KVTransferConfig(role="producer", port=ports["kv"], timeout_s=60.0)
    sides["other"] = ZmqKVConnector(config, lambda: kv, SPEC, 0, 1, kv_keys)
    payload = bytes(blocks * BLOCK_BYTES)
    ctx = zmq.Context(io_threads=TCP_STREAMS)  # as the connector's server
    zap = start_zap(ctx, kv_keys.public)
    servers = []
    for name in ("curve", "plain"):
        sock = ctx.socket(zmq.ROUTER)
        if name == "curve":
            make_server(sock, kv_keys.public, kv_keys.secret)
        sock.bind(f"tcp://127.0.0.1:{ports[name]}")
        servers.append(sock)
    stop = threading.Event()

    def serve() -> None:
        poller = zmq.Poller()
        for sock in servers:
            poller.register(sock, zmq.POLLIN)
        while not stop.is_set():
            for sock, _ in poller.poll(100):
                peer, asked = sock.recv_multipart()
                sock.send_multipart([peer, memoryview(payload)[: int(asked)]], copy=False)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    ids = np.arange(0, 2 * blocks, 2, dtype=np.int32)  # every other block: a real gather
    conn.send("ready")
    while True:
        order = conn.recv()
        if order == "quit":
            break
        side = sides["host_cache" if order.startswith("host_cache") else "other"]
        started = time.perf_counter()
        side.after_step(KVConnectorMetadata(saves=[KVSave(order, ids, blocks * SPEC.block_size)]))
        sync(device)
        side.take_output()
        conn.send(time.perf_counter() - started)
    stop.set()
    thread.join()
    for sock in servers:
        sock.close(linger=0)
    zap.stop()
    ctx.term()
    for side in sides.values():
        side.shutdown()
    if shared is not None:
        shared.close()


# The consumer: this process ---------------------------------------------------------


def pull_seconds(
    conn: Any, side: ZmqKVConnector, address: str, blocks: int, tag: str, repeats: int,
    asked: bool,
) -> tuple[dict[str, list[float]], list[float]]:  # fmt: skip
    """({tag: transfer seconds}, offer seconds) of repeats pulls (after one untimed),
    each load naming the producer's blocks; with asked, each pull followed by one that
    does not name them (tag_asked: its copy waits for the answer)."""
    dest = np.arange(1, 2 * blocks, 2, dtype=np.int32)
    source = np.arange(0, 2 * blocks, 2, dtype=np.int32)  # the producer's, as it stages
    transfers: dict[str, list[float]] = {tag: []}
    if asked:
        transfers[f"{tag}_asked"] = []
    offers = []
    for i in range(repeats + 1):
        for name in transfers:
            req = f"{name}-{i}"
            conn.send(req)
            offer = conn.recv()
            ids = None if name.endswith("_asked") else source
            load = KVLoad(req, dest, RemoteKV(req, blocks * SPEC.block_size, [address], ids))
            started = time.perf_counter()
            side.before_step(KVConnectorMetadata(loads=[load]))
            while True:
                out = side.take_output(wait_s=1.0)
                if out is not None and (out.finished_recving or out.failed_recving):
                    break
            sync(side.kv_caches()[0].device.type)
            elapsed = time.perf_counter() - started
            if out.failed_recving:
                raise RuntimeError(out.failed_recving[0].error)
            if i:
                transfers[name].append(elapsed)
                offers.append(offer)
    return transfers, offers


def memcpy_seconds(nbytes: int, repeats: int) -> list[float]:
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - started)
    return times


def device_copy_seconds(nbytes: int, repeats: int) -> list[float]:
    src = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return timed(functools.partial(dst.copy_, src), "cuda", repeats)


def timed(action: Any, device: str, repeats: int) -> list[float]:
    """Seconds of repeats calls of action (after one untimed), the device's work included."""
    times = []
    for i in range(repeats + 1):
        started = time.perf_counter()
        action()
        sync(device)
        if i:
            times.append(time.perf_counter() - started)
    return times


def host_tier_seconds(kv: list[torch.Tensor], blocks: int, repeats: int) -> dict[str, list[float]]:
    """The host tier's store of blocks (every other block of kv) into scattered slots and
    their load back into the blocks between, and the one-piece copies they compare to."""
    device = kv[0].device.type
    tier = HostKVConnector(blocks, lambda: kv, SPEC)
    ids = np.arange(0, 2 * blocks, 2, dtype=np.int32)
    slots = np.random.default_rng(0).permutation(blocks).astype(np.int32)
    none = np.zeros(0, np.int32)
    store = KVConnectorMetadata(host=KVHostCopies(ids, slots, none, none))
    load = KVConnectorMetadata(host=KVHostCopies(none, none, slots, ids + 1))
    seconds = {
        "host_store": timed(lambda: tier.before_step(store), device, repeats),
        "host_load": timed(lambda: tier.before_step(load), device, repeats),
    }
    tier.shutdown()
    if device == "cuda":
        nbytes = blocks * BLOCK_BYTES
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
        d2h = functools.partial(pinned.copy_, on_device, non_blocking=True)
        h2d = functools.partial(on_device.copy_, pinned, non_blocking=True)
        seconds["pinned_d2h"] = timed(d2h, device, repeats)
        seconds["pinned_h2d"] = timed(h2d, device, repeats)
    return seconds


def bare_zmq_seconds(
    address: str, keys: KVKeys | None, nbytes: int, repeats: int, connections: int = 1
) -> list[float]:
    """nbytes asked of address in equal shares over connections, at once."""
    ctx = zmq.Context(io_threads=connections)
    socks = [ctx.socket(zmq.DEALER) for _ in range(connections)]
    for sock in socks:
        if keys is not None:
            keys.make_client(sock)
        sock.connect(address)
    share = str(nbytes // connections).encode()
    times = []
    for i in range(repeats + 1):
        started = time.perf_counter()
        for sock in socks:
            sock.send(share)
        frames = [sock.recv(copy=False) for sock in socks]
        elapsed = time.perf_counter() - started
        assert sum(len(f.buffer) for f in frames) == nbytes // connections * connections
        if i:
            times.append(elapsed)
    for sock in socks:
        sock.close(linger=0)
    ctx.term()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--mib", type=int, default=16, help="MiB of blocks a transfer moves")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--threads",
        type=int,
        default=min(4, max(1, (os.cpu_count() or 1) // 4)),
        help="torch's threads on each side: the CPU copies' (KV and the memcpy floor alike)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    blocks = args.mib * MIB // BLOCK_BYTES
    nbytes = blocks * BLOCK_BYTES
    keys = KVKeys.new()
    ports = {name: free_port() for name in ("kv", "kv_shared", "curve", "plain")}
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    secrets = (keys.public, keys.secret)
    child = ctx.Process(
        target=producer, args=(child_conn, secrets, ports, blocks, args.device, args.threads)
    )
    child.start()
    try:
        assert conn.recv() == "ready"
        kv = make_caches(blocks * 2, args.device)
        seconds: dict[str, list[float]] = {}
        offer: list[float] = []
        # (path, its producer's port, shared memory, CUDA IPC)
        paths = [("memfd", "kv", True, False), ("tcp", "kv", False, False),
                 ("tcp_one", "kv", False, False)]  # fmt: skip
        if args.device == "cuda":
            paths.insert(0, ("cuda_ipc", "kv", True, True))
        else:
            paths.insert(0, ("host_cache", "kv_shared", True, False))
        for path, port, shared, ipc in paths:
            config = KVTransferConfig(
                role="consumer", timeout_s=60.0, shared_memory=shared, cuda_ipc=ipc
            )
            side = ZmqKVConnector(config, lambda: kv, SPEC, 0, 1, keys)
            in_place = ipc or path == "host_cache"
            split = tcp_parts.MIN_PART_BYTES
            if path == "tcp_one":  # a part larger than the pull: one connection
                tcp_parts.MIN_PART_BYTES = nbytes + 1
            try:
                pulls, stage = pull_seconds(conn, side, f"tcp://127.0.0.1:{ports[port]}",
                                            blocks, path, args.repeats, asked=in_place)  # fmt: skip
                seconds.update(pulls)
                offer += stage
                pulled = side.puller.num_pulled[path.removesuffix("_one")]
                assert pulled == len(pulls) * (args.repeats + 1), side.puller.num_pulled
                if in_place:  # each timed pull naming the blocks copied ahead, and stood
                    assert side.read_ahead.num_stood == args.repeats, side.read_ahead.num_stood
            finally:
                tcp_parts.MIN_PART_BYTES = split
                side.shutdown()
        seconds["memcpy"] = memcpy_seconds(nbytes, args.repeats)
        if args.device == "cuda":
            seconds["device_copy"] = device_copy_seconds(nbytes, args.repeats)
        seconds.update(host_tier_seconds(kv, blocks, args.repeats))
        address = "tcp://127.0.0.1:{}"
        curve, plain = address.format(ports["curve"]), address.format(ports["plain"])
        seconds["pyzmq_curve"] = bare_zmq_seconds(curve, keys, nbytes, args.repeats)
        seconds["pyzmq_curve_streams"] = bare_zmq_seconds(
            curve, keys, nbytes, args.repeats, TCP_STREAMS
        )
        seconds["pyzmq_plain"] = bare_zmq_seconds(plain, None, nbytes, args.repeats)
        conn.send("quit")
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    median = {k: statistics.median(v) for k, v in seconds.items()}
    gib_s = {k: nbytes / v / (1 << 30) for k, v in median.items()}
    rows = [{"path": k, "median_ms": median[k] * 1e3, "GiB/s": gib_s[k]} for k in median]
    rows.append({"path": "offer (producer)", "median_ms": statistics.median(offer) * 1e3,
                 "GiB/s": nbytes / statistics.median(offer) / (1 << 30)})  # fmt: skip
    print_table(rows, precision=2)
    in_place = "cuda_ipc" if args.device == "cuda" else "host_cache"
    ratios = {
        f"{in_place}_vs_memcpy": median["memcpy"] / median[in_place],
        f"{in_place}_asked_vs_memcpy": median["memcpy"] / median[f"{in_place}_asked"],
        "memfd_vs_memcpy": median["memcpy"] / median["memfd"],
        "tcp_vs_pyzmq_curve": median["pyzmq_curve"] / median["tcp"],
        "tcp_vs_pyzmq_curve_streams": median["pyzmq_curve_streams"] / median["tcp"],
        "tcp_one_vs_pyzmq_curve": median["pyzmq_curve"] / median["tcp_one"],
        "tcp_vs_tcp_one": median["tcp_one"] / median["tcp"],
        "tcp_vs_pyzmq_plain": median["pyzmq_plain"] / median["tcp"],
    }
    cuda = args.device == "cuda"
    floors = ("pinned_d2h", "pinned_h2d") if cuda else ("memcpy", "memcpy")
    ratios["host_store_vs_" + floors[0]] = median[floors[0]] / median["host_store"]
    ratios["host_load_vs_" + floors[1]] = median[floors[1]] / median["host_load"]
    if cuda:  # the decode side's part of a same-host pull: one copy into the device
        ratios["memfd_vs_pinned_h2d"] = median["pinned_h2d"] / median["memfd"]
        ratios["cuda_ipc_vs_device_copy"] = median["device_copy"] / median["cuda_ipc"]
    # tcp against bare pyzmq over as many connections, and over one each.
    targets = {f"{in_place}_vs_memcpy": 0.70, "tcp_vs_pyzmq_curve_streams": 0.80,
               "tcp_one_vs_pyzmq_curve": 0.80}  # fmt: skip
    print({k: round(v, 3) for k, v in ratios.items()}, "targets:", targets)
    name = "kv_transfer" if args.device == "cpu" else "kv_transfer_cuda"
    write_results(
        name,
        {
            "device": args.device,
            "bytes": nbytes,
            "blocks": blocks,
            "spec": {
                "layers": len(SPEC.layer_names),
                "block_size": SPEC.block_size,
                "kv_heads": SPEC.num_kv_heads,
                "head_size": SPEC.head_size,
                "dtype": SPEC.dtype,
            },  # fmt: skip
            "repeats": args.repeats,
            "threads": args.threads,
            "rows": rows,
            "ratios": ratios,
            "targets": targets,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
