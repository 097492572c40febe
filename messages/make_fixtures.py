"""Regenerate the golden fixtures: python -m messages.make_fixtures

Each example of messages/examples.py becomes messages/fixtures/<name>.msgpack. A fixture
file holds one whole wire message as a msgpack array of bin values: the body, then its
data frames in order. Beside it, <name>.json holds what decoding it gives, in plain JSON
(messages/conformance.py), for readers in other languages to test theirs against. Run
this after any schema change (and bump messages/version.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from messages.codec import Decoder, Encoder
from messages.conformance import conformance_json
from messages.examples import EXAMPLES

FIXTURES_DIR = Path(__file__).resolve().parent / "fixtures"


def pack_frames(frames: Sequence[Any]) -> bytes:
    """The fixture container: a msgpack array of the frames as bin values."""
    return msgspec.msgpack.encode([bytes(f) for f in frames])


def unpack_frames(data: bytes) -> list[bytes]:
    """The frames of a fixture file, body first."""
    return msgspec.msgpack.decode(data, type=list[bytes])


def encode_examples() -> dict[str, bytes]:
    """name -> fixture file contents, for every example."""
    encoder = Encoder()
    return {name: pack_frames(encoder.encode(build())) for name, build in EXAMPLES.items()}


def decoded_json(fixture: bytes) -> str:
    """The conformance JSON of a fixture file's contents: what decoding it gives."""
    frames = unpack_frames(fixture)
    return conformance_json(Decoder().decode(frames), len(frames) - 1)


def main() -> None:
    FIXTURES_DIR.mkdir(exist_ok=True)
    files = encode_examples()
    for stale in [*FIXTURES_DIR.glob("*.msgpack"), *FIXTURES_DIR.glob("*.json")]:
        if stale.stem not in files:
            stale.unlink()
    for name, data in files.items():
        (FIXTURES_DIR / f"{name}.msgpack").write_bytes(data)
        (FIXTURES_DIR / f"{name}.json").write_text(decoded_json(data))
    print(f"wrote {len(files)} fixtures and their JSON to {FIXTURES_DIR}")


if __name__ == "__main__":
    main()
