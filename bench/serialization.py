"""Encode + decode time of the per-step messages: our codec against pickle of vLLM's shapes.

    python -m bench.serialization [--seconds S]

Each message is timed as it travels: the SchedulerOutput inside the execute_model
RpcRequest, the ModelRunnerOutput inside the RpcReply. The baseline pickles (protocol 5)
an equivalent graph of dataclasses shaped like vLLM v1's, wrapped the way vLLM's
MultiprocExecutor wraps them: (method, args, kwargs, output_rank) and (status, result).
One sample is one encode followed by one decode. The two codecs run in alternating
rounds, so load from other processes weighs on both alike. The garbage collector is
disabled during the timed rounds, for both codecs alike (which spares pickle's many
small objects the collections they would trigger in a real process).
"""

from __future__ import annotations

import argparse
import gc
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench.common import p50_p99_us, print_table, time_calls, write_results
from messages import Decoder, Encoder, ModelRunnerOutput, SchedulerOutput
from messages.compare import assert_same
from messages.examples import (
    decode_step,
    execute_model_reply,
    execute_model_request,
    model_runner_output,
    prefill_step,
    req_id,
)


# vLLM v1's shapes (vllm/v1/core/sched/output.py, vllm/v1/outputs.py, SamplingParams).
@dataclass
class VllmSamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int = 256
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    output_kind: int = 0


@dataclass
class VllmNewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: VllmSamplingParams
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    mm_features: list = field(default_factory=list)
    pooling_params: None = None
    lora_request: None = None
    prompt_embeds: None = None


@dataclass
class VllmCachedRequestData:
    req_ids: list[str]
    resumed_from_preemption: list[bool]
    new_token_ids: list[list[int]]
    resumed_req_token_ids: list[list[int] | None]
    new_block_ids: list[tuple[list[int], ...] | None]
    num_computed_tokens: list[int]
    num_output_tokens: list[int]


@dataclass
class VllmSchedulerOutput:
    scheduled_new_reqs: list[VllmNewRequestData]
    scheduled_cached_reqs: VllmCachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    scheduled_spec_decode_tokens: dict[str, list[int]]
    scheduled_encoder_inputs: dict[str, list[int]]
    num_common_prefix_blocks: list[int]
    finished_req_ids: set[str]
    free_encoder_mm_hashes: list[str]


@dataclass
class VllmModelRunnerOutput:
    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]]
    logprobs: None = None
    prompt_logprobs_dict: dict = field(default_factory=dict)
    pooler_output: list = field(default_factory=list)


def vllm_scheduler_output(step: SchedulerOutput) -> VllmSchedulerOutput:
    """The same step in vLLM's shape: the same ids, tokens, blocks and counts."""
    new = [
        VllmNewRequestData(
            req_id=r.req_id,
            prompt_token_ids=r.prompt_token_ids.tolist(),
            sampling_params=VllmSamplingParams(),
            block_ids=(r.block_ids.tolist(),),
            num_computed_tokens=r.num_computed_tokens,
        )
        for r in step.scheduled_new_reqs
    ]
    cached = step.scheduled_cached_reqs
    ids = [req_id(int(h)) for h in cached.req_handles]
    blocks = [] if cached.new_block_ids is None else cached.new_block_ids.tolist()
    new_block_ids: list[tuple[list[int], ...] | None] = []
    for count in cached.num_new_blocks.tolist():
        new_block_ids.append((blocks[:count],) if count else None)
        blocks = blocks[count:]
    scheduled = {r.req_id: r.num_scheduled_tokens for r in step.scheduled_new_reqs}
    scheduled.update(zip(ids, cached.num_scheduled_tokens.tolist(), strict=True))
    return VllmSchedulerOutput(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=VllmCachedRequestData(
            req_ids=ids,
            resumed_from_preemption=[False] * len(ids),
            new_token_ids=[[] for _ in ids],
            resumed_req_token_ids=[None] * len(ids),
            new_block_ids=new_block_ids,
            num_computed_tokens=cached.num_computed_tokens.tolist(),
            num_output_tokens=[n % 500 for n in cached.num_computed_tokens.tolist()],
        ),
        num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=step.total_num_scheduled_tokens,
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        num_common_prefix_blocks=[0],
        finished_req_ids=set(),
        free_encoder_mm_hashes=[],
    )


def vllm_model_runner_output(output: ModelRunnerOutput) -> VllmModelRunnerOutput:
    ids = [req_id(int(h)) for h in output.req_handles]
    return VllmModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[t] for t in output.sampled_token_ids.tolist()],
    )


def msgspec_round_trip(msg: Any) -> tuple[Callable[[], Any], int]:
    """(encode + decode of msg, its size on the wire), after checking it round-trips."""
    encoder, decoder = Encoder(), Decoder()
    frames = encoder.encode(msg)
    assert_same(msg, decoder.decode(frames))
    return (lambda: decoder.decode(encoder.encode(msg))), sum(memoryview(f).nbytes for f in frames)


def pickle_round_trip(obj: Any) -> tuple[Callable[[], Any], int]:
    data = pickle.dumps(obj, protocol=5)
    assert pickle.loads(data) == obj
    return (lambda: pickle.loads(pickle.dumps(obj, protocol=5))), len(data)


def measure_alternating(fns: list[Callable[[], Any]], seconds: float) -> list[tuple[float, float]]:
    """p50 and p99 (us) of each of fns, run in alternating rounds of about 20 ms for about
    seconds each, so that a noisy neighbour slows both alike."""
    per_call = []
    for fn in fns:
        start = time.perf_counter()
        time_calls(fn, 50, warmup=20)
        per_call.append((time.perf_counter() - start) / 50)
    rounds = max(1, int(seconds / 0.02))
    samples: list[list[float]] = [[] for _ in fns]
    gc.collect()
    gc.disable()
    try:
        for _ in range(rounds):
            for fn, cost, out in zip(fns, per_call, samples, strict=True):
                out.extend(time_calls(fn, max(1, int(0.02 / cost)), warmup=1))
    finally:
        gc.enable()
    return [p50_p99_us(s) for s in samples]


def cases() -> list[tuple[str, Any, Any]]:
    """(name, our message as it travels, vLLM's graph as it travels)."""
    decode, prefill = decode_step(num_reqs=256), prefill_step(num_reqs=8, prompt_len=2048)
    decode_out, prefill_out = model_runner_output(256), model_runner_output(8)

    def vllm_call(step: SchedulerOutput) -> tuple:
        return ("execute_model", (vllm_scheduler_output(step),), {}, 1)

    def vllm_reply(output: ModelRunnerOutput) -> tuple:
        return ("SUCCESS", vllm_model_runner_output(output))

    return [
        ("SchedulerOutput decode 256", execute_model_request(decode), vllm_call(decode)),
        ("SchedulerOutput prefill 8x2048", execute_model_request(prefill), vllm_call(prefill)),
        ("ModelRunnerOutput decode 256", execute_model_reply(decode_out), vllm_reply(decode_out)),
        ("ModelRunnerOutput prefill 8", execute_model_reply(prefill_out), vllm_reply(prefill_out)),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=1.0, help="timing per message and codec")
    args = parser.parse_args()
    rows, ratios = [], {}
    for name, ours, theirs in cases():
        measured = {"msgspec": msgspec_round_trip(ours), "pickle": pickle_round_trip(theirs)}
        timings = measure_alternating([fn for fn, _ in measured.values()], args.seconds)
        for (codec, (_, size)), (p50, p99) in zip(measured.items(), timings, strict=True):
            rows.append(
                {"message": name, "codec": codec, "p50_us": p50, "p99_us": p99, "bytes": size}
            )
        ratios[name] = rows[-1]["p50_us"] / rows[-2]["p50_us"]
    print_table(rows)
    print()
    for name, ratio in ratios.items():
        print(f"p50 pickle / msgspec, {name}: {ratio:.1f}x")
    result = {
        "rows": rows,
        "p50_ratio_pickle_over_msgspec": ratios,
        "gc": "disabled during the timed rounds, both codecs",
    }
    path = write_results("serialization", result)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
