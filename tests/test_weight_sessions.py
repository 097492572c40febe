"""A worker's weight changes that go wrong part-way, on one in-process worker: an update
whose rows do not cover its tensors is never whole, and a reload that fails once some
weights changed leaves the worker refusing steps until a load succeeds."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from messages import SharedWeightRef
from tests.test_worker import generate, started
from zmqworker.distributed.weight_group import describe
from zmqworker.distributed.weight_segment import HEADER_BYTES, WeightSegment
from zmqworker.models import loader
from zmqworker.models.checkpoint_files import CheckpointError

NAME = "model.embed_tokens.weight"


@pytest.fixture
def worker():
    w = started()
    yield w
    w.shutdown()


def embedding(w) -> torch.Tensor:
    return dict(w.model_runner.model.named_parameters())[NAME]


def test_rows_sent_twice_are_refused_and_never_make_a_tensor_whole(worker):
    """Half the rows twice used to count as every row: the update ended "whole", the
    other half of the tensor old."""
    new = torch.full_like(embedding(worker), 0.5)
    half = new.shape[0] // 2
    worker.start_weight_update(describe([(NAME, new)]))
    segment = WeightSegment(new[:half].nbytes + 64)
    try:
        segment.write(HEADER_BYTES, new[:half])
        chunk = segment.descriptor([SharedWeightRef(NAME, HEADER_BYTES, 0, half)])
        worker.load_weight_chunk(chunk)
        # Refused, once weights had changed: a PartialLoadError, which an engine keeps.
        twice = f"ValueError: tensor {NAME}: row 0 came twice in this update"
        with pytest.raises(loader.PartialLoadError, match=twice):
            worker.load_weight_chunk(chunk)
    finally:
        segment.close()
    with pytest.raises(loader.PartialLoadError, match=f"without all of 1 .*: {NAME}"):
        worker.finish_weight_update()  # its second half never came
    with pytest.raises(RuntimeError, match="send a complete update or reload"):
        generate(worker, 1)
    worker.reload_weights()
    assert len(generate(worker, 1)) == 6


def split_checkpoint(source: str, folder, shift: float) -> list[str]:
    """source's tensors over two files, the first file's shifted by shift; their names."""
    state = load_file(os.path.join(source, "model.safetensors"))
    names = sorted(state)
    first = {n: (state[n] + shift).contiguous() for n in names[: len(names) // 2]}
    save_file(first, folder / "a.safetensors")
    save_file(
        {n: state[n].contiguous() for n in names[len(names) // 2 :]}, folder / "b.safetensors"
    )
    index = {n: "a.safetensors" if n in first else "b.safetensors" for n in names}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    shutil.copy(os.path.join(source, "config.json"), folder / "config.json")
    return list(first)


def test_a_shard_cut_short_is_refused_before_any_weight_changes(worker, tmp_path):
    before = generate(worker, 1)
    weights = embedding(worker).detach().clone()
    split_checkpoint(worker.config.model.path, tmp_path, 1.0)
    with open(tmp_path / "b.safetensors", "r+b") as f:
        f.truncate(os.path.getsize(tmp_path / "b.safetensors") - 16)
    with pytest.raises(CheckpointError, match="b.safetensors is cut short: its header names"):
        worker.reload_weights(str(tmp_path))
    assert torch.equal(embedding(worker), weights) and generate(worker, 2) == before


def test_a_reload_that_fails_after_some_weights_changed_stops_steps(worker, tmp_path, monkeypatch):
    """It used to leave the worker serving on half-new weights."""
    before = generate(worker, 1)
    split_checkpoint(worker.config.model.path, tmp_path, 1.0)
    cut, copied = loader.cut, []

    def failing(whole, s):
        if copied:
            raise OSError(5, "Input/output error")
        copied.append(s.name)
        return cut(whole, s)

    monkeypatch.setattr(loader, "cut", failing)
    with pytest.raises(loader.PartialLoadError, match="failed after 1 tensor"):
        worker.reload_weights(str(tmp_path))
    with pytest.raises(RuntimeError, match="OSError.*reload the weights before a step"):
        generate(worker, 2)
    monkeypatch.setattr(loader, "cut", cut)
    worker.reload_weights()  # the start-up checkpoint: served as before
    assert generate(worker, 3) == before
