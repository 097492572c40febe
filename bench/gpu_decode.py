"""The CUDA step: our model runner's decode step against its floor and against
transformers' static-cache + torch.compile generate, on real shapes (CUDA only).

Each shape is a Llama-family config.json written here (no weights downloaded,
gpu_runner.py): SmolLM2-135M and Llama-3.2-1B get random weights from transformers,
saved and loaded by both sides; Llama-3-8B and the mixtures of experts (Qwen3-30B-A3B's
and Mixtral-8x7B's shapes) and the other families' (Qwen2.5-1.5B, Qwen2.5-7B, Qwen3-8B,
Mistral-7B), asked for with --shapes, get our load_format="dummy" weights.
Prompts of 512 random tokens are prefilled, then decode steps are timed two ways:
- ours_ms: the median of steps run one at a time, each waiting for its sampled ids (what
  an engine sees when it schedules after every output);
- ours_pipelined_ms: steps issued while the previous one's ids are still on their way
  (what async scheduling gives), wall time over the steps.
gpu_busy is the share of a step's wall time in which a kernel or copy ran (profiler), for
the one-at-a-time steps (gpu_busy_pipelined for the others). The floor is the bytes the step
must read (every weight but the input embedding's unread rows, plus the KV history; of a
mixture of experts' experts only those the step's tokens chose, measured in an eager step
of the run: bench/moe_floor.py) over the device-to-device bandwidth measured in this run.
A prefill row runs 8 new requests of 1024 tokens in one step of each --prefill-shapes
shape, as a share of the bf16 matmul peak measured in this run.

Beyond those rows, each against its floor (gpu_steps.py), on a runner of its own: a
request's first step at --prompts tokens (its prompt and its sample), a mixed step (a
512-token prompt among --mixed-decodes decodes), and with --context, decode steps over
long histories (--context-shape, --context-batches), timed as the rows above. Writes
bench/results/gpu_decode.json (or --out).

    python -m bench.gpu_decode [--shapes smollm2-135m,llama-3.2-1b,llama-3-8b]
        [--batches 1,8,32,64,128,256] [--hf-batches smollm2-135m:1,32,128;llama-3.2-1b:1,64]
        [--prompts 16,128,512,2048] [--mixed-decodes 63] [--context 8192,32768]
    python -m bench.gpu_decode --shapes qwen3-30b-a3b,mixtral-8x7b --batches 1,16,64,256
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import transformers

from bench.common import print_table, write_results
from bench.gpu_runner import (
    DECODE_STEPS,
    DENSE_SHAPES,
    PREFILL,
    PROMPT_LEN,
    SHAPES,
    Ours,
    floor_bytes,
    make_checkpoint,
    model_len,
)
from bench.gpu_steps import first_step_rows, mixed_row, prefill_row
from bench.moe_floor import (
    eager_steps,
    expected_union,
    experts_chosen,
    moe_blocks,
    unread_expert_bytes,
)
from messages import SchedulerOutput


def hbm_bandwidth() -> float:
    """Device-to-device copy, bytes read plus written per second (4 GiB, median of 10)."""
    src = torch.empty(1 << 31, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(True), torch.cuda.Event(True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    bytes_moved = 2 * src.numel() * src.element_size()
    del src, dst
    return bytes_moved / statistics.median(times[2:])


def matmul_peak() -> float:
    """bf16 8192^3 matrix product on random data, FLOP/s (median of 10)."""
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    times = []
    for _ in range(13):
        start, end = torch.cuda.Event(True), torch.cuda.Event(True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * 8192**3 / statistics.median(times[3:])


def profiled_kernels(run) -> tuple[list[tuple[str, int, int]], int, int]:
    """run() under the profiler: its kernels and copies on the GPU as (name, start ns,
    end ns), and the wall-clock window (start ns, end ns) around it."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        with torch.profiler.record_function("zmqworker_window"):
            run()
        torch.cuda.synchronize()
    events = prof.profiler.kineto_results.events()
    cuda = torch.autograd.DeviceType.CUDA
    window = next(e for e in events if e.name() == "zmqworker_window" and e.device_type() != cuda)
    lo, hi = window.start_ns(), window.end_ns()
    # Kernels and copies; the annotation's own GPU-side span is not work.
    spans = [
        (e.name(), e.start_ns(), e.end_ns())
        for e in events
        if e.device_type() == cuda and not e.is_user_annotation() and e.end_ns() > lo
    ]
    return spans, lo, hi


def gpu_busy(run) -> float:
    """The share of run()'s wall time in which a kernel or a copy ran on the GPU."""
    spans, lo, hi = profiled_kernels(run)
    busy, reach = 0, lo
    for start, end in sorted((max(lo, s), min(hi, e)) for _, s, e in spans):
        start = max(start, reach)
        if end > start:
            busy += end - start
            reach = end
    return busy / (hi - lo)


def kernel_census(run, steps: int, top: int = 12) -> list[dict]:
    """The kernels of run()'s steps by total time: launches and microseconds per step.
    With programmatic dependent launch a kernel's span starts at its launch, so it also
    counts the time its programs waited for the kernel before them."""
    spans, _, _ = profiled_kernels(run)
    by_name: dict[str, list[float]] = {}
    for name, start, end in spans:
        by_name.setdefault(name, []).append((end - start) / 1e3)
    rows = [
        {"kernel": name[:60], "per_step": len(us) / steps, "us_per_step": sum(us) / steps}
        for name, us in by_name.items()
    ]
    return sorted(rows, key=lambda r: -r["us_per_step"])[:top]


def hf_compiled_step(model: transformers.PreTrainedModel, batch: int, steps: int) -> float:
    """transformers' generate with a static cache, which compiles its decode forward
    (torch.compile, CUDA graphs): the median decode step, after a compiling first call."""
    times: list[float] = []

    class Clock(transformers.StoppingCriteria):
        def __init__(self) -> None:
            self.last: float | None = None

        def __call__(self, input_ids, scores, **kwargs):
            torch.cuda.synchronize()
            now = time.perf_counter()
            if self.last is not None:
                times.append(now - self.last)
            self.last = now
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    ids = torch.randint(0, model.config.vocab_size, (batch, PROMPT_LEN), device="cuda")
    config = transformers.GenerationConfig(
        do_sample=False,
        max_new_tokens=steps,
        eos_token_id=None,
        pad_token_id=0,
        cache_implementation="static",
    )
    for _ in range(2):  # the first call compiles
        times.clear()
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                generation_config=config,
                stopping_criteria=transformers.StoppingCriteriaList([Clock()]),
            )
    return statistics.median(times[2:])


def profile_host(ours: Ours, steps: list[SchedulerOutput]) -> None:
    """Where the host's time goes in one-at-a-time steps (cProfile, top functions)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    ours.one_at_a_time(steps)
    profiler.disable()
    print(f"host profile of {len(steps)} steps:")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(30)


def decode_row(ours: Ours, shape: str, batch: int, computed: int, bandwidth: float, args) -> dict:
    """Decode steps of the live `batch` requests, each `computed` tokens in: one at a
    time, pipelined, their GPU busy shares (and census) against the step's floor (of a
    mixture of experts, the experts chosen in the first step, run eagerly)."""
    model = ours.runner.model
    spec = ours.runner.get_kv_cache_spec()
    steps = ours.decode_steps(ours.live, computed, DECODE_STEPS - 8)
    with eager_steps(ours.runner), experts_chosen(model) as chosen:
        ours.one_at_a_time(steps[:1])
    ours.one_at_a_time(steps[1:5])
    sync_times = ours.one_at_a_time(steps[5:35])
    busy = gpu_busy(lambda s=steps[35:45], o=ours: o.one_at_a_time(s))
    pipelined = ours.pipelined(steps[45:75])
    busy_pipelined = gpu_busy(lambda s=steps[75:85], o=ours: o.pipelined(s))
    # Steps run in order: each goes on from the tokens the ones before produced.
    census = None
    if args.census:
        census = kernel_census(lambda s=steps[85:90], o=ours: o.pipelined(s), 5)
        print(f"{shape} batch {batch}: kernels of a pipelined step")
        print_table(census, precision=1)
    if args.profile_host and batch == args.first_batch:
        profile_host(ours, steps[90:150])
    context = computed + 40
    floor = floor_bytes(model, batch, context, spec) - unread_expert_bytes(model, chosen)
    row = {
        "shape": shape,
        "batch": batch,
        "ours_ms": statistics.median(sync_times) * 1e3,
        "ours_pipelined_ms": pipelined * 1e3,
        "hf_compiled_ms": None,
        "floor_ms": floor / bandwidth * 1e3,
        "gpu_busy": busy,
        "gpu_busy_pipelined": busy_pipelined,
    }
    if chosen:  # a mixture of experts: the experts read, per layer
        block = moe_blocks(model)[0]
        row["experts_chosen"] = statistics.mean(chosen)
        row["experts_uniform"] = expected_union(block.split.num_experts, block.top_k, batch)
    if census is not None:
        row["census"] = census
    print(json.dumps(row), flush=True)
    return row


def run_shape(
    shape: str, batches: list[int], hf_batches: list[int], bandwidth: float, args
) -> tuple[list[dict], dict | None, list[dict]]:
    """The decode rows, the prefill row if the shape is one of --prefill-shapes, then the
    first-step and mixed rows (on a runner of their own: longer prompts, and the decode
    rows' runner as it was)."""
    rows = []
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        folder = Path(tmp)
        hf = make_checkpoint(shape, folder)
        # KV blocks for the largest batch's requests, or the prefill row's, if more.
        ours = Ours(folder, dummy=hf is None, loads=[(max(batches), PROMPT_LEN), PREFILL])
        print(f"{shape}: warm-up and graph capture {ours.warm_up_s:.1f} s", flush=True)
        rng = np.random.default_rng(0)
        for batch in batches:
            ours.start(batch, PROMPT_LEN, rng)
            rows.append(decode_row(ours, shape, batch, PROMPT_LEN, bandwidth, args))
        prefill = None
        if shape in args.prefill_shapes.split(","):
            prefill = prefill_row(ours, rng, args.peak, shape)
            print(json.dumps(prefill), flush=True)
        ours.close()
        step_rows = []
        if args.prompts or args.mixed_decodes:
            loads = [(1, length) for length in args.prompts + [PROMPT_LEN]]
            loads.append((args.mixed_decodes + 1, PROMPT_LEN))
            ours = Ours(folder, dummy=hf is None, loads=loads)
            print(f"{shape}: first-step runner warm-up {ours.warm_up_s:.1f} s", flush=True)
            step_rows = first_step_rows(ours, shape, args.prompts, bandwidth, args.peak, rng)
            if args.mixed_decodes:
                step_rows.append(
                    mixed_row(
                        ours,
                        shape,
                        args.mixed_decodes,
                        PROMPT_LEN,
                        PROMPT_LEN,
                        bandwidth,
                        args.peak,
                        rng,
                    )  # fmt: skip
                )
            for row in step_rows:
                print(json.dumps(row), flush=True)
            ours.close()
        if hf is not None:
            for row in rows:
                if row["batch"] in hf_batches:
                    row["hf_compiled_ms"] = hf_compiled_step(hf, row["batch"], 24) * 1e3
                    hf_ms = row["hf_compiled_ms"]
                    print(f"{shape} batch {row['batch']}: transformers {hf_ms:.2f} ms", flush=True)
            del hf
            gc.collect()
            torch.cuda.empty_cache()
    return rows, prefill, step_rows


def run_context(
    shape: str, contexts: list[int], batches: list[int], bandwidth: float, args
) -> list[dict]:
    """Decode rows over histories of each context length (dummy weights; a history
    enters as a cached prefix, in one step of a token per request)."""
    rows = []
    load = (max(batches), max(contexts) + 1)
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        folder = Path(tmp)
        make_checkpoint(shape, folder, max_positions=model_len(load[1]))
        ours = Ours(folder, True, loads=[load], max_batched=256)
        print(f"{shape}: long-history runner warm-up {ours.warm_up_s:.1f} s", flush=True)
        rng = np.random.default_rng(0)
        for context in contexts:
            for batch in batches:
                ours.start(batch, context + 1, rng, cached=context)
                row = decode_row(ours, shape, batch, context + 1, bandwidth, args)
                rows.append(row | {"context": context})
        ours.close()
    return rows


def table_of(rows: list[dict]) -> list[dict]:
    """The printed columns of decode rows (pipelined: what async scheduling gives)."""
    return [
        {
            "shape": r["shape"],
            "batch": r["batch"],
            "context": r.get("context", PROMPT_LEN),
            "ours_ms": r["ours_ms"],
            "pipelined_ms": r["ours_pipelined_ms"],
            "floor_ms": r["floor_ms"],
            "x_floor": r["ours_ms"] / r["floor_ms"],
            "x_floor_pipe": r["ours_pipelined_ms"] / r["floor_ms"],
            "hf_ms": r["hf_compiled_ms"] if r["hf_compiled_ms"] is not None else float("nan"),
            "busy": r["gpu_busy"],
            "busy_pipe": r["gpu_busy_pipelined"],
        }
        for r in rows
    ]


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(DENSE_SHAPES), help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--batches", default="1,8,32,64,128,256")
    parser.add_argument(
        "--hf-batches",
        default="smollm2-135m:1,32,128;llama-3.2-1b:1,64",
        help="shape:batches;... measured with transformers too (each compiles: slow)",
    )
    parser.add_argument(
        "--prefill-shapes",
        default="llama-3-8b,qwen3-30b-a3b",
        help="shapes (of those run) measured with a prefill row too ('' for none)",
    )
    parser.add_argument(
        "--prompts", default="16,128,512,2048", help="first-step rows' prompt lengths ('')"
    )
    parser.add_argument(
        "--mixed-decodes", type=int, default=63, help="the mixed row's decodes (0: none)"
    )
    parser.add_argument("--context", default="", help="long-history rows: history lengths")
    parser.add_argument("--context-shape", default="llama-3-8b")
    parser.add_argument("--context-batches", default="1,4")
    parser.add_argument(
        "--profile-host", action="store_true", help="cProfile the first batch's steps"
    )
    parser.add_argument(
        "--census", action="store_true", help="each row's kernels by time (profiler)"
    )
    parser.add_argument("--tmp", default=None, help="folder for the random checkpoints")
    parser.add_argument("--out", default=None, help="result file (default bench/results/)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("bench.gpu_decode needs a CUDA device")
    batches = ints(args.batches)
    args.first_batch = batches[0]
    args.prompts = ints(args.prompts)
    hf_batches = {}
    for part in filter(None, args.hf_batches.split(";")):
        shape, _, sizes = part.partition(":")
        hf_batches[shape] = ints(sizes)
    bandwidth = hbm_bandwidth()
    args.peak = matmul_peak()
    torch.cuda.empty_cache()  # the probes' 8 GiB: Mixtral-8x7B's weights need the room
    print(
        f"HBM {bandwidth / 1e12:.2f} TB/s, bf16 matmul {args.peak / 1e12:.0f} TFLOP/s", flush=True
    )
    rows, prefills, step_rows = [], [], []
    for shape in filter(None, args.shapes.split(",")):
        shape_rows, shape_prefill, shape_steps = run_shape(
            shape, batches, hf_batches.get(shape, []), bandwidth, args
        )
        rows += shape_rows
        prefills += [shape_prefill] if shape_prefill else []
        step_rows += shape_steps
    long_rows = []
    if args.context:
        contexts, context_batches = ints(args.context), ints(args.context_batches)
        long_rows = run_context(args.context_shape, contexts, context_batches, bandwidth, args)
    print(f"\nHBM {bandwidth / 1e12:.2f} TB/s, bf16 matmul {args.peak / 1e12:.0f} TFLOP/s")
    print_table(table_of(rows + long_rows), precision=3)
    if step_rows:
        print()
        print_table(step_rows, precision=3)
    for p in prefills:
        print(
            f"prefill {p['shape']} {p['tokens']} tokens: {p['ours_ms']:.1f} ms, MFU {p['mfu']:.1%}"
        )
    result = {
        "hbm_bytes_per_s": bandwidth,
        "bf16_matmul_flops": args.peak,
        "device": torch.cuda.get_device_name(),
        "rows": rows,
        "prefill": prefills,
        "first_steps": step_rows,
        "long_context": long_rows,
    }
    print(f"wrote {write_results('gpu_decode', result, args.out)}")


if __name__ == "__main__":
    main()
