"""Structured outputs through `zmqworker serve` (async scheduling on, its default), called
with the official openai client as vLLM's users call it: response_format json_schema and
json_object, vLLM's structured_outputs and guided_* fields, streaming, and bad
constraints refused with a 400 that names the field."""

from __future__ import annotations

import asyncio
import json
import math
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from tests.test_serve import MODEL, Server

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "address", "tags"],
    "additionalProperties": False,
}
JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
NUM_REQUESTS = 50


@pytest.fixture(scope="module")
def server():
    server = Server("--max-num-seqs", str(NUM_REQUESTS))
    try:
        yield server
    finally:
        server.stop()


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


@pytest.mark.timeout(1200)  # fifty requests at once on a shared 2-core machine
def test_fifty_schema_requests_all_validate(server):
    # No retries: a slow machine must not turn one request into several.
    client = openai.AsyncOpenAI(
        base_url=f"{server.base}/v1", api_key="unused", timeout=1200, max_retries=0
    )

    async def one(i: int):
        return await client.chat.completions.create(
            model=MODEL,
            messages=chat(f"Invent person number {i} and give them as JSON."),
            response_format=JSON_SCHEMA_FORMAT,
            max_tokens=160,
            temperature=0.8,
            seed=i,
        )

    async def all_of_them():
        try:
            return await asyncio.gather(*(one(i) for i in range(NUM_REQUESTS)))
        finally:
            await client.close()

    replies = asyncio.run(all_of_them())
    for reply in replies:
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_vllm_fields_regex_choice_grammar_and_json_object(server):
    client = server.client()

    def complete(extra: dict) -> openai.types.Completion:
        return client.completions.create(
            model=MODEL, prompt="Answer:", max_tokens=40, temperature=0.7, seed=3, extra_body=extra
        )

    def json_object() -> openai.types.chat.ChatCompletion:
        return client.chat.completions.create(
            model=MODEL,
            messages=chat("Give any JSON object."),
            response_format={"type": "json_object"},
            max_tokens=60,
            seed=4,
        )

    # Sent at once (each seeded, each checked for its own constraint): one batch.
    extras = [
        {"structured_outputs": {"regex": r"20[0-9]{2}-0[1-9]-[0-2][0-9]"}},
        {"structured_outputs": {"choice": ["left", "right"]}},
        {"structured_outputs": {"grammar": 'root ::= "It is " ("on" | "off") "."'}},
        {"guided_choice": ["up", "down"]},
    ]
    with ThreadPoolExecutor(len(extras) + 1) as pool:
        replied = pool.submit(json_object)
        date, pick, said, old = pool.map(complete, extras)
        reply = replied.result()
    assert len(date.choices[0].text) == 10 and date.choices[0].finish_reason == "stop"
    assert pick.choices[0].text in ("left", "right")
    assert said.choices[0].text in ("It is on.", "It is off.")
    assert old.choices[0].text in ("up", "down")
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    else:  # cut by max_tokens: what came is a prefix of an object
        assert reply.choices[0].message.content.startswith("{")


def test_a_streamed_schema_output_validates(server):
    stream = server.client().chat.completions.create(
        model=MODEL,
        messages=chat("A person as JSON:"),
        extra_body={"guided_json": PERSON},
        max_tokens=160,
        seed=7,
        stream=True,
    )
    pieces, reasons = [], []
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            reasons.append(chunk.choices[0].finish_reason)
    assert reasons[-1] == "stop" and len(pieces) > 3
    jsonschema.validate(json.loads("".join(pieces)), PERSON)


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}},
            "response_format",
            "json",
        ),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "regex is invalid"),
        ({"guided_grammar": 'start ::= "a"'}, "guided_grammar", "root"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "one"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, None, "not several"),
        ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
    ],
)
def test_a_bad_constraint_is_a_400_naming_it(server, extra, param, words):
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().chat.completions.create(
            model=MODEL, messages=chat("hi"), max_tokens=5, extra_body=extra
        )
    error = caught.value.body
    assert words in error["message"] and error["param"] == param, error
    assert server.wait_idle()["num_requests_running"] == 0


def test_logprobs_of_tokens_a_constraint_rules_out_are_json_numbers(server):
    """Under a constraint the tokens it rules out have a logprob of -inf, which JSON
    cannot hold: the answer, whole or streamed, gives OpenAI's floor of -9999.0 instead."""
    body = {"model": MODEL, "prompt": "Pick:", "max_tokens": 4, "logprobs": 5,
            "structured_outputs": {"choice": ["left", "right"]}}  # fmt: skip
    logprobs = _strict_json(_post(server, "/v1/completions", body))["choices"][0]["logprobs"]
    tops = [value for top in logprobs["top_logprobs"] for value in top.values()]
    assert min(tops) == -9999.0 and all(math.isfinite(v) for v in logprobs["token_logprobs"])
    chat_body = {"model": MODEL, "messages": chat("Pick one."), "max_tokens": 4, "stream": True,
                 "logprobs": True, "top_logprobs": 5, "guided_choice": ["up", "down"]}  # fmt: skip
    events = _post(server, "/v1/chat/completions", chat_body).split("\n\n")
    entries = [
        entry
        for event in events
        if event.startswith("data: {")
        for choice in _strict_json(event[6:])["choices"]
        for entry in (choice.get("logprobs") or {}).get("content") or []
    ]
    assert entries and min(t["logprob"] for e in entries for t in e["top_logprobs"]) == -9999.0


def _post(server: Server, path: str, body: dict) -> str:
    request = urllib.request.Request(
        server.base + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.status == 200
        return response.read().decode()


def _strict_json(text: str) -> dict:
    """text as JSON, refusing what only Python's json takes (Infinity, NaN)."""

    def refuse(constant: str) -> float:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)
