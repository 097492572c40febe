"""The reference engine end to end on the embedded model, against transformers' batched
generate in the same run, same dtype and same total thread count.

16 prompts of mixed lengths, 64 greedy output tokens each. Systems: our engine with
tp=1, pp=1, with async scheduling on and off (three steps in flight, or one), with pp=2
(two worker processes sharing the threads), and transformers. Reports total output tokens
per second, mean time to first token and mean time per output token, and async over sync
scheduling. Writes bench/results/end_to_end.json.

The structured-output row decodes the same batch (async scheduling on) with every request
constrained by a JSON schema whose one string field is longer than the output, so that
every step of every request is masked, against the same decode unconstrained, in one
engine, taking turns; it reports the ratio of their time per output token (target
<= 1.15x). --structured-only runs that row alone (bench/results/end_to_end_structured.json).

    python -m bench.end_to_end [--threads 2] [--device cpu] [--async-scheduling both]
        [--structured-only] [--out FILE]
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers

from bench.common import print_table, write_results
from messages import SamplingParams, StructuredOutputsParams
from zmqworker.frontend.llm import LLM
from zmqworker.models.embedded import default_model_path

OUTPUT_TOKENS = 64
WORDS = (
    "the quick brown fox jumps over the lazy dog while a river runs past an old mill "
    "and the town wakes to bells ringing across the valley in the early light"
).split()


def prompts(tokenizer) -> list[list[int]]:
    """16 prompts of 8 to 248 tokens."""
    out = []
    for i in range(16):
        length = 8 + 16 * i
        text = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(length))
        out.append(tokenizer.encode(text)[:length])
    return out


def run_ours(
    path: str,
    batch: list[list[int]],
    pp: int,
    threads: int,
    device: str,
    async_scheduling: bool = True,
) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    with LLM(
        model=path,
        pipeline_parallel_size=pp,
        device=device,
        num_threads=max(1, threads // pp),
        max_num_seqs=16,
        max_num_batched_tokens=4096,
        async_scheduling=async_scheduling,
    ) as llm:
        llm.generate([batch[0]], SamplingParams(temperature=0.0, max_tokens=4))  # warm
        start = time.perf_counter()
        outs = llm.generate(batch, params)
        elapsed = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    scheduling = "" if pp > 1 else (" async" if async_scheduling else " sync")
    return {
        "system": f"zmqworker tp=1 pp={pp}{scheduling}",
        "tok_s": tokens / elapsed,
        "ttft_ms": 1e3 * sum(o.timings.ttft for o in outs) / len(outs),
        "tpot_ms": 1e3 * sum(o.timings.tpot for o in outs) / len(outs),
    }


# Longer than any output here: the grammar never ends, every step is masked.
LONG_SCHEMA = {
    "type": "object",
    "properties": {"story": {"type": "string", "minLength": 4000}},
    "required": ["story"],
}


def run_structured(path: str, batch: list[list[int]], threads: int, device: str) -> dict:
    """Time per output token of the batch with a JSON schema on every request, over the
    same without; best of two turns each."""
    plain = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    schema = StructuredOutputsParams(json=LONG_SCHEMA)
    constrained = SamplingParams(
        temperature=0.0, max_tokens=OUTPUT_TOKENS, structured_outputs=schema
    )
    best = {"plain": float("inf"), "schema": float("inf")}
    with LLM(
        model=path,
        device=device,
        num_threads=threads,
        max_num_seqs=16,
        max_num_batched_tokens=4096,
    ) as llm:
        llm.generate([batch[0]], SamplingParams(temperature=0.0, max_tokens=4))  # warm
        llm.generate([batch[0]], constrained)  # compiles the schema
        for _ in range(2):
            for name, params in (("plain", plain), ("schema", constrained)):
                outs = llm.generate(batch, params)
                assert all(len(o.token_ids) == OUTPUT_TOKENS for o in outs), name
                tpot = sum(o.timings.tpot for o in outs) / len(outs)
                best[name] = min(best[name], tpot)
    return {
        "tpot_ms_plain": 1e3 * best["plain"],
        "tpot_ms_schema": 1e3 * best["schema"],
        "schema_over_plain_tpot": best["schema"] / best["plain"],
    }


def run_transformers(path: str, batch: list[list[int]], threads: int, device: str) -> dict:
    torch.set_num_threads(threads)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = model.to(device).eval()
    width = max(len(p) for p in batch)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)

    def generate(n: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=pad,
            )
        return time.perf_counter() - start

    generate(2)  # warm
    ttft = generate(1)  # the whole batch's prefill: every request's first token
    total = generate(OUTPUT_TOKENS)
    return {
        "system": "transformers generate",
        "tok_s": len(batch) * OUTPUT_TOKENS / total,
        "ttft_ms": 1e3 * ttft,
        "tpot_ms": 1e3 * (total - ttft) / (OUTPUT_TOKENS - 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="torch threads in total")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--async-scheduling",
        choices=["on", "off", "both"],
        default="both",
        help="tp=1, pp=1 rows: with async scheduling, without, or both (compared)",
    )
    parser.add_argument(
        "--structured-only", action="store_true", help="the structured-output row alone"
    )
    parser.add_argument("--out", default=None, help="result file (default bench/results/)")
    args = parser.parse_args()
    path = default_model_path()
    batch = prompts(transformers.AutoTokenizer.from_pretrained(path))
    structured = run_structured(path, batch, args.threads, args.device)
    print(
        f"decode with a JSON schema on every request: {structured['tpot_ms_schema']:.1f} ms "
        f"per token against {structured['tpot_ms_plain']:.1f} ms without: "
        f"{structured['schema_over_plain_tpot']:.3f}x (target <= 1.15x)"
    )
    if args.structured_only:
        print(f"wrote {write_results('end_to_end_structured', structured, args.out)}")
        return
    modes = {"on": [True], "off": [False], "both": [True, False]}[args.async_scheduling]
    rows = [run_ours(path, batch, 1, args.threads, args.device, mode) for mode in modes]
    rows.append(run_ours(path, batch, 2, args.threads, args.device))
    hf = run_transformers(path, batch, args.threads, args.device)
    rows.append(hf)
    print_table(rows)
    print(f"tp=1,pp=1 over transformers: {rows[0]['tok_s'] / hf['tok_s']:.2f}x tokens/s")
    summary = {"rows": rows, "structured": structured}
    if len(modes) == 2:
        ratio = rows[0]["tok_s"] / rows[1]["tok_s"]
        summary["async_over_sync_tok_s"] = ratio
        print(f"async over sync scheduling: {ratio:.3f}x tokens/s (target >= 1.0)")
    print(f"wrote {write_results('end_to_end', summary, args.out)}")


if __name__ == "__main__":
    main()
