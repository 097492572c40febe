"""A checkpoint's model config as transformers reads it (AutoConfig), for the workers.

Importing transformers' config classes costs a worker more CPU than importing torch (their
validators pull in much of transformers, torch.distributed and sympy), and every worker of
every start would pay it to read the same few values. So the values AutoConfig gives are
kept, as JSON, in the cache folder (models/embedded.py's), under a key made of
config.json's bytes and transformers' version: a worker whose checkpoint was read before
takes them from there without importing transformers. What is kept is exactly what
AutoConfig made (its to_dict() and its aliases), never a reading of our own; a config
transformers refuses is never kept, so it is refused the same way every time.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

from zmqworker.models.embedded import cache_root

FORMAT = 1  # of the kept files: a change makes new keys


class CheckpointConfig:
    """AutoConfig's values read back: its attributes (with transformers' aliases of them,
    such as Mixtral's num_experts) as its to_dict() gives them (dtype by its name), and
    to_dict()."""

    def __init__(self, values: dict[str, Any], aliases: dict[str, str]) -> None:
        self._values = values
        self._aliases = aliases

    def __getattr__(self, name: str) -> Any:
        # Only reached for names the object itself lacks: the config's own.
        values, aliases = self.__dict__["_values"], self.__dict__["_aliases"]
        key = aliases.get(name, name)
        if key not in values:
            raise AttributeError(f"the checkpoint's config has no {name!r}")
        return values[key]

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self._values)


def load_hf_config(path: str) -> Any:
    """The checkpoint's config.json as AutoConfig reads it, locally (never from a hub):
    from the cache folder when this config was read before with this transformers."""
    config_json = Path(path) / "config.json"
    if not config_json.is_file():
        raise FileNotFoundError(f"no config.json in checkpoint folder {path}")
    kept = _kept_path(config_json.read_bytes())
    try:
        record = _read(kept.read_bytes())
        return CheckpointConfig(record["values"], record["aliases"])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # not kept yet, or unreadable: read it with transformers (and keep it)
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    _keep(kept, cfg)
    return cfg


def _kept_path(config_bytes: bytes) -> Path:
    key = hashlib.sha256(config_bytes)
    key.update(f"\0{metadata.version('transformers')}\0{FORMAT}".encode())
    return cache_root() / "hf-configs" / f"{key.hexdigest()}.json"


def _read(data: bytes) -> dict[str, Any]:
    """A kept record; id2label's keys are ints again, as PretrainedConfig makes them."""
    record = json.loads(data)
    labels = record["values"].get("id2label")
    if isinstance(labels, dict):
        record["values"]["id2label"] = {int(k): v for k, v in labels.items()}
    return record


def _keep(kept: Path, cfg: Any) -> None:
    """Write cfg's values to kept (atomically: workers may write it at once); a config
    whose values are not JSON, or a cache folder that cannot be written, is not kept."""
    try:
        record = {"values": cfg.to_dict(), "aliases": dict(type(cfg).attribute_map)}
        data = json.dumps(record, allow_nan=False).encode()
        if _read(data) != record:  # values JSON would not give back as they are
            return
        kept.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=kept.parent, prefix=".tmp-")
    except (OSError, TypeError, ValueError):
        return
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, kept)
    except OSError:
        Path(tmp).unlink(missing_ok=True)
