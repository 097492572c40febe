"""What bench.weight_update and bench.sleep share: the model (the embedded one on the
CPU; on CUDA a shape folder of bench.gpu_decode's, Llama-3-8B's by default, on dummy
weights), its LLM, and a full update's tensors by Hugging Face name."""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from collections.abc import Iterator

import torch
import transformers

from bench.gpu_decode import SHAPES
from zmqworker.frontend.llm import LLM
from zmqworker.models.embedded import default_model_path

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--model", default=None, help="checkpoint folder (default: see below)")
    parser.add_argument(
        "--shape", default="llama-3-8b", choices=sorted(SHAPES), help="CUDA without --model"
    )
    parser.add_argument("--load-format", default=None, choices=("auto", "dummy"))
    parser.add_argument("--dtype", default=None, choices=sorted(DTYPES))
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--tmp", default=None, help="folder for a shape's config.json")
    parser.add_argument("--out", default=None, help="result file (default bench/results/)")


@contextlib.contextmanager
def model_folder(args: argparse.Namespace) -> Iterator[str]:
    """--model; else the embedded model on the CPU, a shape's config.json on CUDA."""
    if args.model is not None:
        yield args.model
    elif args.device == "cpu":
        yield default_model_path()
    else:
        with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
            config = transformers.LlamaConfig(**SHAPES[args.shape], bos_token_id=1, eos_token_id=2)
            config.save_pretrained(tmp)
            yield tmp


def settings(args: argparse.Namespace) -> tuple[str, str]:
    """(dtype, load_format): float32 and the checkpoint on the CPU, bfloat16 and dummy
    weights on CUDA, unless given."""
    cuda = args.device == "cuda"
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    load_format = args.load_format or ("dummy" if cuda and args.model is None else "auto")
    return dtype, load_format


def open_llm(args: argparse.Namespace, folder: str) -> LLM:
    dtype, load_format = settings(args)
    return LLM(
        model=folder,
        device=args.device,
        dtype=dtype,
        load_format=load_format,
        max_model_len=1024,
        max_num_seqs=8,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )


def full_update(folder: str, device: str, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """Every weight of the checkpoint's model, random, on device: names and shapes from
    transformers' own model built on the meta device."""
    config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config)
    generator = torch.Generator(device=device).manual_seed(0)
    weights = []
    for name, param in meta.named_parameters():
        t = torch.empty(param.shape, dtype=dtype, device=device)
        weights.append((name, t.normal_(0.0, 0.02, generator=generator)))
    return weights


def nbytes(weights: list[tuple[str, torch.Tensor]]) -> int:
    return sum(t.nbytes for _, t in weights)
