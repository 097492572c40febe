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

from zmqworker.cli.options import add_options, given, llm_options, sampling_options
from zmqworker.cli.preflight import Job, check_run, engine_prompts
from zmqworker.cli.prompts import read_prompts
from zmqworker.cli.structured import add_structured_options, structured_option
from zmqworker.frontend.outputs import PositionLogprobs, json_logprob

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
        help="one prompt per line; or JSONL (the first line starts with {): a prompt or "
        "messages, and any sampling fields, per line; - is stdin",
    )
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--system", help="with --chat: the system message")
    gen.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object per sample (n per prompt with --n)",
    )
    add_options(gen.add_argument_group("sampling"), SAMPLING_OPTIONS)
    add_structured_options(gen)
    add_options(
        gen.add_argument_group("engine"),
        LLM_OPTIONS,
        defaults={"max_num_seqs": "the number of samples (prompts times n), at most 64"},
    )
    return gen


def run(args: argparse.Namespace) -> int:
    from zmqworker.frontend.llm import LLM

    if args.system is not None and not args.chat:
        raise ValueError("--system needs --chat")
    items = read_prompts(args.prompts, args.prompts_file)
    engine = given(args, LLM_OPTIONS)
    # Everything is checked before the workers start, then again with the engine's own
    # tokenizer before anything runs.
    jobs = check_run(
        items,
        given(args, SAMPLING_OPTIONS) | structured_option(args),
        model=engine.get("model"),
        max_model_len=engine.get("max_model_len"),
        max_logprobs=engine.get("max_logprobs", _default("max_logprobs")),
        chat=args.chat,
        system=args.system,
    )
    num_samples = sum(job.params.n for job in jobs)
    if not engine.get("engine_core_addresses"):  # else the engine cores were sized apart
        engine.setdefault("max_num_seqs", min(num_samples, _default("max_num_seqs")))
    with LLM(**engine) as llm:
        prompts = engine_prompts(llm, jobs)
        began = time.perf_counter()
        outputs = asyncio.run(_run_all(llm, jobs, prompts, args.json))
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


async def _run_all(llm: Any, jobs: list[Job], prompts: list[list[int]], as_json: bool) -> list:
    """Run every prompt at once. One prompt of one sample streams its text as it comes,
    after its own text once the first token is out; otherwise each completion prints
    whole as it finishes (a prompt's n samples as [prompt.sample]); --json prints a line
    per completion, in order."""
    single = len(prompts) == 1 and not as_json and jobs[0].params.n == 1
    results: dict[int, list[Any]] = {}
    printed = 0

    async def one(i: int, job: Job, prompt: list[int]) -> list[Any]:
        nonlocal printed
        finals: dict[int, Any] = {}
        echo = isinstance(job.item.prompt, str)
        async for out in llm.generate_stream(prompt, job.params):
            if single and out.token_ids == out.new_token_ids and out.new_token_ids:
                if job.conversation is None and echo:
                    sys.stdout.write(job.item.prompt)  # a completion continues its prompt
            if single and out.new_text:
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
            if out.finished:
                finals[out.index] = out
                if not single and not as_json:
                    name = f"{i}.{out.index}" if job.params.n > 1 else str(i)
                    print(f"--- [{name}] {job.item.label()}\n{out.text}", flush=True)
        samples = [finals[k] for k in sorted(finals)]
        if as_json:
            results[i] = samples
            while printed in results:
                for out in results[printed]:
                    print(json.dumps(_record(printed, jobs[printed], out)), flush=True)
                printed += 1
        return samples

    outputs = await asyncio.gather(
        *(one(i, job, prompt) for i, (job, prompt) in enumerate(zip(jobs, prompts, strict=True)))
    )
    if single:
        print(flush=True)
    return [out for samples in outputs for out in samples]


def _record(index: int, job: Job, out: Any) -> dict[str, Any]:
    item = job.item
    record: dict[str, Any] = {
        "index": index,
        "sample": out.index,
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
        record["logprobs"] = [_position(p) for p in out.logprobs]
    if out.prompt_logprobs is not None:  # null for the first prompt position
        record["prompt_logprobs"] = [p and _position(p) for p in out.prompt_logprobs]
    return record


def _position(p: PositionLogprobs) -> dict[str, Any]:
    """A position's token (sampled, or the prompt's), its logprob and rank, and the top."""
    return {
        "token_id": p.sampled.token_id,
        "token": p.sampled.text,
        "logprob": json_logprob(p.sampled.logprob),  # -inf is no JSON number
        "rank": p.rank,
        "top": [
            {"token_id": t.token_id, "token": t.text, "logprob": json_logprob(t.logprob)}
            for t in p.top
        ],
    }
