"""The GPU side of a KV transfer's copies (zmqworker/kv_transfer/device_copies.py), their
data movement checked on the CPU: groups of layers (several, with the two buffers taken
in turn), a staging cut along blocks (after a decode-side prefix hit), a piece of heads.
CUDA's streams and events are stand-ins here, which keep no order: bench/run_on_gpu.sh
runs the connector's tests with the caches on the device for that."""

from __future__ import annotations

import contextlib

import pytest
import torch

from zmqworker.kv_transfer import device_copies

LAYERS, HEADS, SLOTS = 5, 4, 8
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's stand-ins")


class StandIn:
    """A CUDA stream or event that does nothing: on the CPU every copy is done at once."""

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: None


@pytest.fixture(autouse=True)
def cpu_streams(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: StandIn())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", StandIn)
    monkeypatch.setattr(device_copies, "_copy_stream", lambda device: StandIn())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    # Two layers a group: three groups of five layers, the buffers reused.
    layer_bytes = 2 * 3 * HEADS * SLOTS * 4
    monkeypatch.setattr(device_copies, "GROUP_BYTES", 2 * layer_bytes)


def caches(num_blocks: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, num_blocks, HEADS, SLOTS, generator=g) for _ in range(LAYERS)]


def test_gather_takes_the_blocks_of_every_layer_group_by_group() -> None:
    kv = caches(8, seed=0)
    ids = torch.tensor([6, 1, 3])
    out = torch.empty(LAYERS, 2, 3, HEADS, SLOTS)
    device_copies.gather(kv, ids, out)
    for layer in range(LAYERS):
        assert torch.equal(out[layer], kv[layer][:, ids])


@pytest.mark.parametrize("start", [0, 1], ids=["whole", "cut-along-blocks"])
def test_scatter_lands_every_layer_in_its_blocks(start: int) -> None:
    staged = torch.randn(LAYERS, 2, 3, HEADS, SLOTS)[:, :, start:]
    kv = caches(8, seed=1)
    before = [c.clone() for c in kv]
    ids = torch.tensor([5, 0, 2][start:])
    device_copies.scatter(kv, ids, staged)
    for layer in range(LAYERS):
        assert torch.equal(kv[layer][:, ids], staged[layer])
        others = [b for b in range(8) if b not in ids.tolist()]
        assert torch.equal(kv[layer][:, others], before[layer][:, others])


def test_scatter_of_a_piece_of_heads_writes_those_heads_only() -> None:
    staged = torch.randn(LAYERS, 2, 2, HEADS, SLOTS)
    kv = caches(4, seed=2)
    before = [c.clone() for c in kv]
    ids = torch.tensor([3, 1])
    device_copies.scatter(kv, ids, staged, heads=(1, 2, 2))  # staged heads 1-2 -> 2-3
    for layer in range(LAYERS):
        assert torch.equal(kv[layer][:, ids, 2:4], staged[layer][:, :, 1:3])
        assert torch.equal(kv[layer][:, ids, :2], before[layer][:, ids, :2])
