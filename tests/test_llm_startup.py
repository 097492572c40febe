"""LLM start-up that fails: it says so at once, without waiting for the tokenizer that
loads meanwhile (its thread finishes on its own)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from zmqworker.engine.model_folder import ModelFolder
from zmqworker.frontend import llm as llm_module
from zmqworker.frontend.llm import LLM


def test_a_start_that_fails_does_not_wait_for_the_tokenizer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = {"model_type": "llama", "vocab_size": 64, "max_position_embeddings": 64,
              "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
              "hidden_size": 8}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    loading, release = threading.Event(), threading.Event()
    failed_at: list[float] = []

    def slow_load(self: ModelFolder) -> None:
        loading.set()
        release.wait(10.0)

    def no_engine(*args: object) -> None:
        assert loading.wait(10.0)  # the tokenizer is loading by now
        failed_at.append(time.monotonic())
        raise RuntimeError("no engine core today")

    monkeypatch.setattr(ModelFolder, "load_text_side", slow_load)
    monkeypatch.setattr(llm_module, "start_engine_cores", no_engine)
    try:
        with pytest.raises(RuntimeError, match="no engine core today"):
            LLM(str(tmp_path), block_size=4, max_model_len=64)
        assert time.monotonic() - failed_at[0] < 2.0, "the failure waited for the tokenizer"
        assert not release.is_set()
    finally:
        release.set()
