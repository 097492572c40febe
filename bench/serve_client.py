"""One load-generating client process of bench.serve_load: streamed completions over
HTTP/1.1 keep-alive connections (h11 on asyncio streams), timed per chunk.

Its own process, so that parsing tens of thousands of server-sent events a second does
not share a GIL with the server or with the other clients. It reads one job as JSON on
stdin and writes one JSON list of request records on stdout; nothing else crosses.

    python -m bench.serve_client < job.json > records.json
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from typing import Any

import h11

READ_BYTES = 1 << 16
# A connection idle this long is opened afresh: the server closes one idle for its
# keep-alive timeout (uvicorn's default: 5 s), and a request sent as it does so would
# meet a closed connection.
IDLE_REOPEN_S = 4.0


class Connection:
    """One keep-alive HTTP/1.1 connection, one request at a time."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.conn = h11.Connection(h11.CLIENT)
        self.idle_since = time.monotonic()

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        self.conn = h11.Connection(h11.CLIENT)

    async def post_stream(self, path: str, body: bytes, headers: list[tuple[str, str]]):
        """POST body; yield (arrival time, event data bytes) for each server-sent event,
        then the response status as an int."""
        idle = time.monotonic() - self.idle_since
        if self.writer is None or self.conn.our_state is not h11.IDLE or idle > IDLE_REOPEN_S:
            await self.close()
            await self.open()
        assert self.reader is not None and self.writer is not None
        request = h11.Request(
            method="POST",
            target=path,
            headers=[
                ("Host", f"{self.host}:{self.port}"),
                ("Content-Type", "application/json"),
                ("Content-Length", str(len(body))),
                *headers,
            ],
        )
        self.writer.write(self.conn.send(request) + self.conn.send(h11.Data(data=body)))
        self.writer.write(self.conn.send(h11.EndOfMessage()))
        await self.writer.drain()
        status = 0
        pending = b""
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                self.conn.receive_data(await self.reader.read(READ_BYTES))
                continue
            if isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                now = time.perf_counter()
                pending += bytes(event.data)
                *events, pending = pending.split(b"\n\n")
                for raw in events:
                    if raw.startswith(b"data: "):
                        yield now, raw[6:]
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                if pending.strip():
                    yield time.perf_counter(), pending
                break
        if self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE:
            self.conn.start_next_cycle()
        self.idle_since = time.monotonic()
        yield status

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except OSError:
                pass
        self.reader = self.writer = None


async def one_request(conn: Connection, job: dict[str, Any], prompt: Any) -> dict[str, Any]:
    """Stream one completion; its record: start, ttft, chunk gaps, tokens, latency."""
    body = json.dumps(
        {
            "model": job["model"],
            "prompt": prompt,
            "max_tokens": job["max_tokens"],
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            **({"structured_outputs": {"json": job["schema"]}} if job.get("schema") else {}),
        }
    ).encode()
    headers = [("Authorization", f"Bearer {job['api_key']}")] if job.get("api_key") else []
    record: dict[str, Any] = {"ok": False, "error": None, "chunk_times": [], "output_tokens": 0}
    started = time.perf_counter()
    record["start"] = started
    try:
        async for item in conn.post_stream(job["path"], body, headers):
            if isinstance(item, int):
                if item != 200:
                    record["error"] = f"HTTP {item}"
                continue
            when, data = item
            if data == b"[DONE]":
                continue
            event = json.loads(data)
            if "error" in event:
                record["error"] = event["error"].get("message", "error")
            elif event.get("usage"):
                record["output_tokens"] = event["usage"]["completion_tokens"]
            elif any(c.get("text") for c in event.get("choices", ())):
                record["chunk_times"].append(when)
    except (OSError, h11.ProtocolError, json.JSONDecodeError) as exc:
        record["error"] = f"{type(exc).__name__}: {exc}"
        await conn.close()
    record["end"] = time.perf_counter()
    record["ok"] = record["error"] is None and record["output_tokens"] > 0
    return record


async def run_job(job: dict[str, Any]) -> list[dict[str, Any]]:
    """Send job's prompts with at most job["concurrency"] in flight, at job["rate"]
    requests a second (Poisson arrivals; null: all at once). With job["next_turns"]
    (token ids, one list a prompt), each answered prompt of token ids is followed on its
    connection by its next turn, the prompt and those tokens (its record's "turn": 2)."""
    prompts = job["prompts"]
    next_turns = job.get("next_turns") or [None] * len(prompts)
    slots = asyncio.Semaphore(job["concurrency"])
    idle = [Connection(job["host"], job["port"]) for _ in range(job["concurrency"])]
    rng = random.Random(job["seed"])
    records: list[dict[str, Any]] = []
    # All client processes start at the same wall-clock moment.
    await asyncio.sleep(max(0.0, job["start_at"] - time.time()))

    async def send(prompt: Any, next_turn: list[int] | None) -> None:
        async with slots:
            conn = idle.pop()
            try:
                records.append(await one_request(conn, job, prompt))
                if next_turn is not None:
                    record = await one_request(conn, job, [*prompt, *next_turn])
                    records.append({**record, "turn": 2})
            finally:
                idle.append(conn)

    tasks = []
    for prompt, next_turn in zip(prompts, next_turns, strict=True):
        tasks.append(asyncio.create_task(send(prompt, next_turn)))
        if job["rate"]:
            await asyncio.sleep(rng.expovariate(job["rate"]))
    await asyncio.gather(*tasks)
    for conn in idle:
        await conn.close()
    return records


def main() -> None:
    job = json.load(sys.stdin)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    records = asyncio.run(run_job(job))
    json.dump(records, sys.stdout)


if __name__ == "__main__":
    main()
