"""A worker's model config: what AutoConfig gives, kept in the cache folder and read back
without transformers; the same values, attributes and aliases, for every family; a
config changed or refused is read (and refused) by transformers again."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import transformers

from tests.tiny import FAMILIES, MOE_CHECKPOINTS, cached_tiny_checkpoint
from zmqworker.models.embedded import CACHE_DIR_ENV, default_model_path
from zmqworker.models.hf_config import CheckpointConfig, load_hf_config
from zmqworker.models.layers.rotary import rope_parameters_of

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINTS = {
    **{family: dict(family=family) for family in FAMILIES},
    **{f"{name}-experts": kwargs for name, kwargs in MOE_CHECKPOINTS.items()},
    "llama-rope-linear": dict(family="llama", rope_scaling={"rope_type": "linear", "factor": 2.0}),
    # transformers' model takes a top-level original_max_position_embeddings for yarn.
    "llama-rope-yarn-top-level": dict(
        family="llama",
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
        config_json={"original_max_position_embeddings": 32},
    ),
}


@pytest.fixture(scope="module")
def embedded() -> str:
    """The embedded checkpoint from the default cache, found before `cache` moves the cache
    folder: converting it again into a test's folder would only repeat the conversion."""
    return default_model_path()


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    return tmp_path


def same_as_transformers(path: str) -> None:
    first = load_hf_config(path)
    assert isinstance(first, transformers.PretrainedConfig)  # read by transformers, kept
    kept = load_hf_config(path)
    assert isinstance(kept, CheckpointConfig)
    theirs = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    assert kept.to_dict() == theirs.to_dict()
    names = [*theirs.to_dict(), *type(theirs).attribute_map]
    for name in names:
        if name == "transformers_version":
            # to_dict() stamps the running transformers' version, and the kept values are
            # its to_dict(); the attribute is the version that wrote config.json.
            continue
        theirs_value = getattr(theirs, name)
        if name == "dtype" and theirs_value is not None:  # to_dict() gives its name
            theirs_value = str(theirs_value).removeprefix("torch.")
        assert getattr(kept, name) == theirs_value, name
    assert not hasattr(kept, "no_such_key") and not hasattr(theirs, "no_such_key")


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_a_kept_config_reads_as_autoconfig_does(name, cache):
    same_as_transformers(cached_tiny_checkpoint(**CHECKPOINTS[name]))


@pytest.mark.parametrize("name", ["llama-rope-linear", "llama-rope-yarn-top-level"])
def test_rope_parameters_are_those_the_transformers_model_uses(name, cache):
    """Building the model standardizes the rope settings again (a top-level
    original_max_position_embeddings wins then): ours are those, read or kept."""
    path = cached_tiny_checkpoint(**CHECKPOINTS[name])
    theirs = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    theirs.standardize_rope_params()
    for _ in range(2):  # read by transformers, then kept
        assert rope_parameters_of(load_hf_config(path)) == theirs.rope_parameters


def test_the_embedded_model_and_a_worker_without_transformers(embedded, cache):
    path = embedded
    same_as_transformers(path)
    code = (
        "import sys; from zmqworker.models.hf_config import load_hf_config;"
        f"cfg = load_hf_config({path!r});"
        "print(type(cfg).__name__, cfg.hidden_size, 'transformers' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.split() == ["CheckpointConfig", "576", "False"]


def test_a_changed_config_is_read_again(cache, tmp_path_factory):
    folder = tmp_path_factory.mktemp("model")
    config = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4}
    (folder / "config.json").write_text(json.dumps(config))
    load_hf_config(str(folder))
    assert load_hf_config(str(folder)).hidden_size == 64
    (folder / "config.json").write_text(json.dumps({**config, "hidden_size": 128}))
    assert isinstance(load_hf_config(str(folder)), transformers.PretrainedConfig)
    assert load_hf_config(str(folder)).hidden_size == 128


def test_a_refused_config_is_refused_every_time_and_not_kept(cache, tmp_path_factory):
    folder = tmp_path_factory.mktemp("model")
    bad = {"model_type": "llama", "hidden_size": 65, "num_attention_heads": 4}
    (folder / "config.json").write_text(json.dumps(bad))
    for _ in range(2):
        with pytest.raises(Exception, match="not a multiple of the number of attention heads"):
            load_hf_config(str(folder))
    assert not list(cache.rglob("*.json"))
    with pytest.raises(FileNotFoundError, match="no config.json in checkpoint folder"):
        load_hf_config(str(tmp_path_factory.mktemp("empty")))
