"""`zmqworker generate`: complete prompts with the reference engine, streaming the text.

The engine's and the sampling's options come from their definitions (options.py); the
KV cache is sized for the prompts given (max_num_seqs defaults to their number).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

import msgspec

from zmqworker.cli.options import add_options, given, llm_options, sampling_options
from zmqworker.cli.prompts import PromptItem, read_prompts

LLM_OPTIONS = llm_options()
SAMPLING_OPTIONS = sampling_options()


def add_parser(sub: Any) -> argparse.ArgumentParser:
    gen = sub.add_parser(
        "generate",
        help="complete prompts with the reference engine",
        description="Complete prompts with the reference engine and its worker processes, "
        "streaming the text; then print time to first token, time per output token and "
        "tokens per second on stderr. Without --model, the embedded SmolLM2-135M-Instruct "
        "model is prepared on first use. Sampling options default to the model's "
        "generation_config.json, else to SamplingParams' defaults.",
    )
    gen.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompt text; - reads stdin")
    gen.add_argument(
        "--prompts-file",
        metavar="PATH",
        help="one prompt per line, or JSONL with a prompt or messages per line; - is stdin",
    )
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--system", help="with --chat: the system message")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    add_options(gen.add_argument_group("sampling"), SAMPLING_OPTIONS)
    add_options(
        gen.add_argument_group("engine"),
        LLM_OPTIONS,
        defaults={"max_num_seqs": "the number of prompts, at most 64"},
    )
    return gen


def run(args: argparse.Namespace) -> int:
    from zmqworker.engine.llm import LLM

    items = read_prompts(args.prompts, args.prompts_file)
    if args.system is not None and not args.chat:
        raise ValueError("--system needs --chat")
    engine = given(args, LLM_OPTIONS)
    engine.setdefault("max_num_seqs", min(len(items), _default("max_num_seqs")))
    with LLM(**engine) as llm:
        params = msgspec.structs.replace(
            llm.default_sampling_params(), **given(args, SAMPLING_OPTIONS)
        )
        prompts = [_prompt(llm, item, args) for item in items]
        began = time.perf_counter()
        outputs = asyncio.run(_run_all(llm, items, prompts, params, args))
        elapsed = time.perf_counter() - began
    tokens = sum(len(o.token_ids) for o in outputs)
    ttft = sum(o.timings.ttft for o in outputs) / len(outputs)
    tpot = sum(o.timings.tpot for o in outputs) / len(outputs)
    print(
        f"time to first token {ttft * 1e3:.1f} ms, time per output token {tpot * 1e3:.1f} ms, "
        f"{tokens / elapsed:.1f} tokens/s ({tokens} tokens in {elapsed:.2f} s)",
        file=sys.stderr,
    )
    return 0


def _default(name: str) -> Any:
    return next(o.default for o in LLM_OPTIONS if o.name == name)


def _prompt(llm: Any, item: PromptItem, args: argparse.Namespace) -> str | list[int]:
    """Text or token ids for the engine: chats go through the chat template."""
    if item.messages is None and not args.chat:
        assert item.prompt is not None
        return item.prompt
    if item.messages is None and not isinstance(item.prompt, str):
        raise ValueError("--chat needs text prompts, not token ids")
    messages = item.messages or [{"role": "user", "content": item.prompt}]
    if args.system is not None and messages[0].get("role") != "system":
        messages = [{"role": "system", "content": args.system}, *messages]
    return llm.chat_prompt(messages)


async def _run_all(llm: Any, items: list[PromptItem], prompts: list, params, args) -> list:
    """Run every prompt at once. One prompt streams its text as it comes; several print
    each completion whole, as it finishes; --json prints a line per prompt, in order."""
    single = len(prompts) == 1 and not args.json
    results: dict[int, Any] = {}
    printed = 0

    async def one(i: int, prompt: str | list[int]) -> Any:
        nonlocal printed
        last = None
        async for out in llm.generate_stream(prompt, params):
            last = out
            if single and out.new_text:
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
        if args.json:
            results[i] = last
            while printed in results:
                print(json.dumps(_record(printed, items[printed], results[printed])), flush=True)
                printed += 1
        elif not single:
            print(f"--- [{i}] {items[i].label()}\n{last.text}", flush=True)
        return last

    if single and isinstance(prompts[0], str):
        sys.stdout.write(prompts[0])  # a completion continues its prompt
    outputs = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    if single:
        print(flush=True)
    return list(outputs)


def _record(index: int, item: PromptItem, out: Any) -> dict[str, Any]:
    record: dict[str, Any] = {
        "index": index,
        "prompt": item.prompt if item.messages is None else None,
        "text": out.text,
        "token_ids": out.token_ids,
        "finish_reason": out.finish_reason,
        "stop_reason": out.stop_reason,
        "num_prompt_tokens": len(out.prompt_token_ids),
        "ttft_s": round(out.timings.ttft, 6),
        "tpot_s": round(out.timings.tpot, 6),
        "total_s": round(out.timings.total, 6),
    }
    if item.messages is not None:
        record["messages"] = item.messages
    if out.logprobs is not None:
        record["logprobs"] = [
            {
                "token_id": p.sampled.token_id,
                "token": p.sampled.text,
                "logprob": p.sampled.logprob,
                "rank": p.rank,
                "top": [
                    {"token_id": t.token_id, "token": t.text, "logprob": t.logprob} for t in p.top
                ],
            }
            for p in out.logprobs
        ]
    return record
