"""Disaggregated prefill and decode against colocated serving, under a mixed workload:
long and short prompts arriving while other requests decode. The same `zmqworker serve`
options run in each mode of one run: colocated (one engine core), disaggregated
(--disaggregate: a prefill and a decode instance on the same hardware), and local (the
same, with --max-local-prefill-tokens: the short prompts, which share nothing cached,
computed on the decode instance); the baseline is the colocated run.

The load (bench/serve_client.py processes, streamed greedy completions, ignore_eos):
--decoders requests of --decode-prompt-len tokens decoding --decode-len tokens each, all
sent at once, and, from --long-delay seconds on, --long-prompts requests of
--long-prompt-len tokens (--long-len output tokens) at --long-rate a second and
--short-prompts of --short-prompt-len tokens (--short-len output tokens) at --short-rate
a second (Poisson); each long prompt, once answered, is followed by its next turn, the
prompt and --next-turn-len tokens more (the answer left out: token ids go, text comes
back; prefix caching on in every mode), which the decode instance holds all but those
tokens of (local: computed there). Reported for each mode: the decoders' inter-token
latency p50 and p99 (the gaps between a stream's tokens), their time per output token,
the long and the short prompts' and the next turns' time to first token, and output
tokens/s over all requests; then each
disaggregated mode over colocated (the issue's target: inter-token p99 <= 0.6x,
throughput within 10%). With --kv-cache-bytes, the
colocated engine core gets it and each disaggregated instance half: one memory budget,
split. Writes bench/results/disaggregated.json (or --out).

    python -m bench.disaggregated                              # CPU, the embedded model
    python -m bench.disaggregated --device cuda --dtype bfloat16 --load-format dummy \\
        --model FOLDER --kv-cache-bytes 40G --decoders 64 --decode-len 512 \\
        --long-prompts 16 --long-prompt-len 8192 --long-rate 4
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from typing import Any

import numpy as np

from bench.common import print_table, write_results
from bench.serve_load import (
    Server,
    add_engine_args,
    cli_flags,
    client_process,
    engine_options,
    served_model,
)
from zmqworker.cli.options import parse_size

MODES = ("colocated", "disaggregated", "local")


def prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Random token-id prompts from the vocabulary's middle (clear of special tokens)."""
    rng = np.random.default_rng(seed)
    low, high = min(1000, vocab // 4), vocab - min(1000, vocab // 4)
    return [rng.integers(low, high, length).tolist() for _ in range(count)]


def records_of(proc: subprocess.Popen) -> list[dict[str, Any]]:
    assert proc.stdout is not None
    records = json.loads(proc.stdout.read())
    if proc.wait() != 0:
        raise RuntimeError(f"a client process exited with status {proc.returncode}")
    failed = [r for r in records if not r["ok"]]
    if failed:
        raise RuntimeError(f"{len(failed)} request(s) failed; the first: {failed[0]['error']}")
    return records


def mixed(
    url: str,
    model: str,
    decoders: list,
    longs: list,
    shorts: list,
    next_turns: list | None,
    args: argparse.Namespace,
) -> dict:
    """The mixed workload once against url: its figures."""
    start_at = time.time() + 2.0  # after the clients have imported
    common = {"seed": args.seed, "start_at": start_at}
    decode_job = {**common, "prompts": decoders, "max_tokens": args.decode_len,
                  "concurrency": len(decoders), "rate": None}  # fmt: skip
    arriving = {"long": (longs, args.long_len, args.long_rate, next_turns),
                "short": (shorts, args.short_len, args.short_rate, None)}  # fmt: skip
    decode = client_process(url, model, decode_job)
    clients = {
        kind: client_process(
            url,
            model,
            {
                **common,
                "prompts": batch,
                "max_tokens": tokens,
                "concurrency": len(batch),
                "rate": rate,
                "start_at": start_at + args.long_delay,
                "next_turns": turns,
            },
        )  # fmt: skip
        for kind, (batch, tokens, rate, turns) in arriving.items()
        if batch
    }
    decoded = records_of(decode)
    arrived = {kind: records_of(proc) for kind, proc in clients.items()}
    if "long" in arrived:  # the next turns apart
        records = arrived.pop("long")
        arrived["long"] = [r for r in records if "turn" not in r]
        arrived["next"] = [r for r in records if "turn" in r]
    every = decoded + [r for records in arrived.values() for r in records]
    duration = max(r["end"] for r in every) - min(r["start"] for r in every)
    itl = np.concatenate([np.diff(r["chunk_times"]) for r in decoded])
    tpot = [(r["chunk_times"][-1] - r["chunk_times"][0]) / (r["output_tokens"] - 1)
            for r in decoded]  # fmt: skip
    row = {
        "itl_p50_ms": 1e3 * float(np.percentile(itl, 50)),
        "itl_p99_ms": 1e3 * float(np.percentile(itl, 99)),
        "itl_max_ms": 1e3 * float(itl.max()),
        "tpot_mean_ms": 1e3 * float(np.mean(tpot)),
    }
    for kind, records in arrived.items():
        if not records:
            continue
        ttft = [r["chunk_times"][0] - r["start"] for r in records]
        row[f"{kind}_ttft_p50_ms"] = 1e3 * float(np.percentile(ttft, 50))
        row[f"{kind}_ttft_p99_ms"] = 1e3 * float(np.percentile(ttft, 99))
    row["output_tok_s"] = sum(r["output_tokens"] for r in every) / duration
    row["duration_s"] = duration
    return row


def serve_options(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    """serve_load's engine options for this workload, the KV cache split between the two
    instances when disaggregated."""
    longest = max(args.decode_prompt_len + args.decode_len, args.long_prompt_len + args.long_len)
    sized = argparse.Namespace(
        **vars(args), max_model_len=longest + 16, gpu_memory_utilization=None
    )
    options = engine_options(sized, args.decoders + args.long_prompts + args.short_prompts)
    if args.kv_cache_bytes is not None:
        options["kv_cache_bytes"] = args.kv_cache_bytes // (1 if mode == "colocated" else 2)
    return options


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(parser)
    parser.add_argument(
        "--kv-cache-bytes", type=parse_size, default=None, help="40G: halved when disaggregated"
    )
    parser.add_argument("--decoders", type=int, default=8)
    parser.add_argument("--decode-prompt-len", type=int, default=32)
    parser.add_argument("--decode-len", type=int, default=160)
    parser.add_argument("--long-prompts", type=int, default=4)
    parser.add_argument("--long-prompt-len", type=int, default=1024)
    parser.add_argument("--long-len", type=int, default=8)
    parser.add_argument("--long-rate", type=float, default=1.0, help="long prompts a second")
    parser.add_argument("--short-prompts", type=int, default=8)
    parser.add_argument("--short-prompt-len", type=int, default=16)
    parser.add_argument("--short-len", type=int, default=8)
    parser.add_argument("--short-rate", type=float, default=4.0, help="short prompts a second")
    parser.add_argument(
        "--long-delay", type=float, default=1.0, help="s before the first long or short one"
    )
    parser.add_argument(
        "--next-turn-len",
        type=int,
        default=16,
        help="new tokens of each long prompt's next turn (0: none, prefix caching off)",
    )
    parser.add_argument(
        "--max-local-prefill-tokens",
        type=int,
        default=24,
        help="the local mode's: prompts of which at most this many tokens are not cached on "
        "the decode side computed there (the short ones only: below --decode-prompt-len)",
    )
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--port", type=int, default=8766)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if "local" in args.modes and not (
        args.short_prompt_len <= args.max_local_prefill_tokens < args.decode_prompt_len
    ):
        parser.error(
            "the local mode moves the short prompts alone: --max-local-prefill-tokens "
            f"{args.max_local_prefill_tokens} must be at least --short-prompt-len "
            f"{args.short_prompt_len} and below --decode-prompt-len {args.decode_prompt_len}"
        )
    from zmqworker.engine.model_folder import ModelFolder

    vocab = ModelFolder.open(args.model).vocab_size or 32000
    # One more of each kind warms each server up: the timed ones find nothing cached.
    decoders = prompts(args.decoders + 2, args.decode_prompt_len, vocab, args.seed)
    longs = prompts(args.long_prompts + 1, args.long_prompt_len, vocab, args.seed + 1)
    shorts = prompts(args.short_prompts + 1, args.short_prompt_len, vocab, args.seed + 2)
    next_turns = None
    if args.next_turn_len:
        next_turns = prompts(args.long_prompts + 1, args.next_turn_len, vocab, args.seed + 3)
    local = ["--max-local-prefill-tokens", str(args.max_local_prefill_tokens)]
    flags = {"colocated": [], "disaggregated": ["--disaggregate"],
             "local": ["--disaggregate", *local]}  # fmt: skip
    modes = args.modes.split(",")
    if not set(modes) <= set(flags):
        parser.error(f"--modes {args.modes}: each is one of {', '.join(MODES)}")
    rows = []
    for mode in modes:
        options = serve_options(args, mode)
        caching = ["--enable-prefix-caching"] if next_turns else []
        served = cli_flags({"api_server_count": 1}) + flags[mode] + caching
        server = Server(options, served, args.port)
        try:
            model = served_model(server.url)
            warm = next_turns[:1] if next_turns else None
            mixed(server.url, model, decoders[:2], longs[:1], shorts[:1], warm, args)
            turns = next_turns[1:] if next_turns else None
            figures = mixed(server.url, model, decoders[2:], longs[1:], shorts[1:], turns, args)
            rows.append({"mode": mode, **figures})
        finally:
            server.stop()
    print_table(rows, precision=2)
    # The host's load: on a shared machine, what the modes' figures were made under.
    result: dict[str, Any] = {"args": vars(args), "rows": rows, "loadavg_after": os.getloadavg()}
    by_mode = {r["mode"]: r for r in rows}
    base = by_mode.get("colocated")
    for mode in ("disaggregated", "local"):
        if base is not None and mode in by_mode:
            ratios = {k: by_mode[mode][k] / base[k] for k in base if k.endswith(("_ms", "_s"))}
            result[f"{mode}_over_colocated"] = ratios
            print(mode, "over colocated:", {k: round(v, 3) for k, v in ratios.items()})
    print(f"wrote {write_results('disaggregated', result, args.out)}")


if __name__ == "__main__":
    main()
