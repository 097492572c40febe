"""Prompts that share prefixes over data-parallel replicas with prefix caching: placed by
their prefix (frontend/prefix_affinity.py) against by load alone, in the same run.

G groups of prompts, each group a prefix of --prefix tokens and --per-group prompts that
add --suffix tokens of their own. One prompt of each group goes first (every prefix is
computed once somewhere); then the rest of every group, all at once. Reported: the
prompt tokens the replicas computed (EngineStats.num_prefill_tokens) against the floor
of the same workload, each prefix computed once, and the wall time of the second wave.
By load alone the second wave spreads over the replicas, and each replica that was not
sent a group's prefix computes it again. The by-load run switches placement by prefix
off in this process (where the LLM's client is) and runs second: a warmer machine, if
anything, favours it.

    python -m bench.prefix_routing [--model DIR] [--replicas 2] [--groups 8]
"""

from __future__ import annotations

import argparse
import contextlib
import time
from unittest import mock

import numpy as np

from bench.common import print_table, write_results
from messages import SamplingParams
from zmqworker.frontend import prefix_affinity
from zmqworker.frontend.llm import LLM


def workload(args: argparse.Namespace, vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    """(the first prompt of each group, the rest of every group in a shuffled order)."""
    rng = np.random.default_rng(0)
    prefixes = [rng.integers(10, vocab, args.prefix).tolist() for _ in range(args.groups)]

    def prompt(group: int) -> list[int]:
        return prefixes[group] + rng.integers(10, vocab, args.suffix).tolist()

    first = [prompt(g) for g in range(args.groups)]
    rest = [prompt(g) for _ in range(args.per_group - 1) for g in range(args.groups)]
    return first, [rest[i] for i in rng.permutation(len(rest))]


def run(args: argparse.Namespace, by_prefix: bool) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    by_load = mock.patch.object(prefix_affinity.PrefixAffinity, "of", return_value=None)
    with contextlib.nullcontext() if by_prefix else by_load:
        with LLM(
            model=args.model,
            data_parallel_size=args.replicas,
            enable_prefix_caching=True,
            max_model_len=args.prefix + args.suffix + args.max_tokens + 16,
        ) as llm:
            vocab = llm.client.engines[0].ready.vocab_size or 32_000
            first, rest = workload(args, vocab)
            llm.generate(first, params)
            started = time.perf_counter()
            llm.generate(rest, params)
            seconds = time.perf_counter() - started
            computed = llm.stats().num_prefill_tokens
    floor = args.groups * args.prefix + args.groups * args.per_group * args.suffix
    return {
        "placement": "by prefix" if by_prefix else "by load",
        "prompt_tokens_computed": computed,
        "floor_tokens": floor,
        "x_floor": computed / floor,
        "second_wave_s": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint folder (the embedded model)")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--per-group", type=int, default=6)
    parser.add_argument("--prefix", type=int, default=256)
    parser.add_argument("--suffix", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--out", default=None, help="result file (default bench/results/)")
    args = parser.parse_args()
    rows = [run(args, by_prefix=True), run(args, by_prefix=False)]
    print_table(rows, precision=2)
    ratio = rows[1]["second_wave_s"] / rows[0]["second_wave_s"]
    print(f"second wave by prefix: {ratio:.2f}x faster than by load")
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    result = {"settings": settings, "rows": rows, "by_load_over_by_prefix_s": ratio}
    print(f"wrote {write_results('prefix_routing', result, args.out)}")


if __name__ == "__main__":
    main()
