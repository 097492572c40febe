"""Regenerate the golden fixtures: python -m messages.make_fixtures

Each example of messages/examples.py becomes messages/fixtures/<name>.msgpack. A fixture
file holds one whole wire message as a msgpack array of bin values: the body, then its
data frames in order. Run this after any schema change (and bump messages/version.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from messages.codec import Encoder
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


def main() -> None:
    FIXTURES_DIR.mkdir(exist_ok=True)
    files = encode_examples()
    for stale in FIXTURES_DIR.glob("*.msgpack"):
        if stale.stem not in files:
            stale.unlink()
    for name, data in files.items():
        (FIXTURES_DIR / f"{name}.msgpack").write_bytes(data)
    print(f"wrote {len(files)} fixtures to {FIXTURES_DIR}")


if __name__ == "__main__":
    main()
