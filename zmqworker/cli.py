"""The zmqworker command: `generate` (the main job) and `worker` (one worker process).

zmqworker generate "The capital of France is" --pp 2 --max-tokens 16
zmqworker worker --engine ipc:///run/engine.sock --rank 0
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from zmqworker.runtime.main import build_parser as build_worker_parser
from zmqworker.runtime.main import run_worker


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zmqworker",
        description="Worker processes for LLM inference engines, driven over ZeroMQ.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser(
        "generate",
        help="complete prompts with the reference engine",
        description="Complete one or more prompts with the reference engine and its worker "
        "processes, streaming the text; then print time to first token, time per output "
        "token and tokens per second. Without --model, the embedded SmolLM2-135M-Instruct "
        "model is prepared on first use.",
    )
    gen.add_argument("prompts", nargs="+", help="prompt text (several run as one batch)")
    gen.add_argument("--model", default=None, help="Hugging Face checkpoint folder")
    gen.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    gen.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1)")
    gen.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"))
    gen.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    gen.add_argument(
        "--executor",
        default="mp",
        choices=("mp", "ray"),
        help="local processes (mp) or a Ray cluster (ray)",
    )
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None, help="sampling seed per request")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument(
        "--json", action="store_true", help="print token ids and timings as JSON instead of text"
    )
    sub.add_parser(
        "worker",
        help="run one worker process (engines spawn it)",
        parents=[build_worker_parser()],
        add_help=False,
        description=build_worker_parser().description,
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "worker":
        return run_worker(args)
    try:
        return generate(args)
    except KeyboardInterrupt:
        print("zmqworker: interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError, RuntimeError, TimeoutError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"zmqworker: error: {first_line}", file=sys.stderr)
        return 1


def generate(args: argparse.Namespace) -> int:
    from messages import SamplingParams
    from zmqworker.engine.llm import LLM

    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_tokens=args.max_tokens,
    )
    params.validate()
    start = time.perf_counter()
    print(
        f"starting {args.tp * args.pp} worker process(es) and loading weights...",
        file=sys.stderr,
        flush=True,
    )
    with LLM(
        model=args.model,
        tensor_parallel_size=args.tp,
        pipeline_parallel_size=args.pp,
        device=args.device,
        dtype=args.dtype,
        executor=args.executor,
    ) as llm:
        print(f"ready in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
        prompts = [_chat(llm, p) for p in args.prompts] if args.chat else list(args.prompts)
        began = time.perf_counter()
        outputs = asyncio.run(_stream_all(llm, prompts, params, echo=not args.json))
        elapsed = time.perf_counter() - began
    tokens = sum(len(o.token_ids) for o in outputs)
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "prompt": o.prompt,
                        "prompt_token_ids": o.prompt_token_ids,
                        "text": o.text,
                        "token_ids": o.token_ids,
                        "finish_reason": o.finish_reason,
                        "ttft_s": o.timings.ttft,
                        "tpot_s": o.timings.tpot,
                        "total_s": o.timings.total,
                    }
                    for o in outputs
                ],
                indent=2,
            )
        )
    ttft = sum(o.timings.ttft for o in outputs) / len(outputs)
    tpot = sum(o.timings.tpot for o in outputs) / len(outputs)
    print(
        f"time to first token {ttft * 1e3:.1f} ms, time per output token {tpot * 1e3:.1f} ms, "
        f"{tokens / elapsed:.1f} tokens/s ({tokens} tokens in {elapsed:.2f} s)",
        file=sys.stderr,
    )
    return 0


async def _stream_all(llm, prompts: list[str], params, echo: bool) -> list:
    """Run every prompt at once. One prompt streams its text as it comes; several print
    each completion whole, as it finishes, under its prompt."""

    async def one(i: int, prompt: str):
        last = None
        async for out in llm.generate_stream(prompt, params):
            last = out
            if echo and len(prompts) == 1 and out.new_text:
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
        if echo and len(prompts) > 1:
            print(f"--- [{i}] {prompt}\n{last.text}", flush=True)
        return last

    if echo and len(prompts) == 1:
        sys.stdout.write(prompts[0])
        sys.stdout.flush()
    outputs = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    if echo and len(prompts) == 1:
        print(flush=True)
    return list(outputs)


def _chat(llm, prompt: str) -> str:
    if llm.tokenizer is None or not getattr(llm.tokenizer, "chat_template", None):
        raise ValueError("--chat: the model's tokenizer has no chat template")
    return llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
