"""LLM.generate end to end on a GPU, with async scheduling on and off, against the floor
of the worker's own decode step rate measured in the same run.

SmolLM2-135M's shape with dummy weights (bf16), 256 requests of 128 random prompt tokens,
256 greedy output tokens each. The floor: the model runner alone, in this process, at
the same batch over the same contexts (128 to 383 tokens), its steps pipelined as a
worker runs them (bench.gpu_decode's harness). Decode throughput is the batch over the
mean time per output token. Targets: async decode throughput >= 0.95x the runner's, and
>= 1.3x the throughput with async scheduling off. Writes
bench/results/end_to_end_cuda.json (or --out).

    python -m bench.end_to_end_cuda [--requests 256] [--prompt-len 128] [--output-len 256]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import transformers

from bench.common import print_table, write_results
from bench.gpu_runner import SHAPES, Ours
from messages import SamplingParams
from zmqworker.frontend.llm import LLM

SHAPE = "smollm2-135m"


def runner_step_s(folder: Path, requests: int, prompt_len: int, output_len: int) -> float:
    """Seconds per decode step of the model runner alone, pipelined, at batch requests."""
    ours = Ours(folder, dummy=True, loads=[(requests, prompt_len)], decodes=output_len)
    rng = np.random.default_rng(0)
    handles = ours.start(requests, prompt_len, rng)
    steps = ours.decode_steps(handles, prompt_len, output_len - 1)
    ours.pipelined(steps[:16])  # the graphs' first replays
    handles = ours.start(requests, prompt_len, rng)
    step_s = ours.pipelined(ours.decode_steps(handles, prompt_len, output_len - 1))
    ours.close()
    return step_s


def run_llm(
    folder: Path, prompts: list[list[int]], output_len: int, async_scheduling: bool
) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    started = time.perf_counter()
    with LLM(
        model=str(folder),
        device="cuda",
        dtype="bfloat16",
        load_format="dummy",
        max_num_seqs=len(prompts),
        max_num_batched_tokens=8192,
        max_model_len=len(prompts[0]) + output_len + 16,
        gpu_memory_utilization=0.5,
        async_scheduling=async_scheduling,
    ) as llm:
        ready_s = time.perf_counter() - started
        llm.generate(prompts[:8], SamplingParams(temperature=0.0, max_tokens=8))  # warm
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    assert tokens == len(prompts) * output_len, tokens
    tpot = sum(o.timings.tpot for o in outs) / len(outs)
    return {
        "system": f"LLM.generate async_scheduling={'on' if async_scheduling else 'off'}",
        "decode_tok_s": len(prompts) / tpot,
        "tpot_ms": 1e3 * tpot,
        "total_tok_s": tokens / elapsed,
        "ttft_ms": 1e3 * sum(o.timings.ttft for o in outs) / len(outs),
        "ready_s": ready_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--tmp", default=None, help="folder for the checkpoint's config")
    parser.add_argument("--out", default=None, help="result file (default bench/results/)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        folder = Path(tmp)
        transformers.LlamaConfig(**SHAPES[SHAPE], bos_token_id=1, eos_token_id=2).save_pretrained(
            folder
        )
        step_s = runner_step_s(folder, args.requests, args.prompt_len, args.output_len)
        rng = np.random.default_rng(1)
        vocab = SHAPES[SHAPE]["vocab_size"]
        prompts = [rng.integers(0, vocab, args.prompt_len).tolist() for _ in range(args.requests)]
        rows = [
            {
                "system": "model runner alone (floor)",
                "decode_tok_s": args.requests / step_s,
                "tpot_ms": 1e3 * step_s,
            },
            run_llm(folder, prompts, args.output_len, True),
            run_llm(folder, prompts, args.output_len, False),
        ]
    floor, on, off = rows
    summary = {
        "shape": SHAPE,
        "device": torch.cuda.get_device_name(),
        "requests": args.requests,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "rows": rows,
        "async_over_floor": on["decode_tok_s"] / floor["decode_tok_s"],
        "async_over_sync": on["decode_tok_s"] / off["decode_tok_s"],
        "sync_over_floor": off["decode_tok_s"] / floor["decode_tok_s"],
    }
    print_table(rows)
    print(
        f"async decode over the runner alone: {summary['async_over_floor']:.3f}x "
        f"(target >= 0.95); over sync: {summary['async_over_sync']:.3f}x (target >= 1.3)"
    )
    print(f"wrote {write_results('end_to_end_cuda', summary, args.out)}")


if __name__ == "__main__":
    main()
