"""The CUDA step: our model runner's decode step against its floor and against
transformers' static-cache + torch.compile generate, on real shapes (CUDA only).

Each shape is a Llama-family config.json written here (no weights downloaded): SmolLM2-135M
and Llama-3.2-1B get random weights from transformers, saved and loaded by both sides;
Llama-3-8B and the mixtures of experts (Qwen3-30B-A3B's and Mixtral-8x7B's shapes, asked
for with --shapes) get our load_format="dummy" weights. Prompts of 512 random tokens are
prefilled, then decode steps are timed two ways:
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
shape, as a share of the bf16 matmul peak measured in this run. Writes
bench/results/gpu_decode.json (or --out).

    python -m bench.gpu_decode [--shapes smollm2-135m,llama-3.2-1b,llama-3-8b]
        [--batches 1,8,32,64,128,256] [--hf-batches smollm2-135m:1,32,128;llama-3.2-1b:1,64]
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
from bench.moe_floor import (
    CONFIG_CLASSES,
    MOE_SHAPES,
    active_expert_params,
    eager_steps,
    expected_union,
    experts_chosen,
    moe_blocks,
    unread_expert_bytes,
)
from messages import (
    CacheConfig,
    CachedRequestData,
    ModelConfig,
    NewRequestData,
    SamplingParams,
    SchedulerConfig,
    SchedulerOutput,
    WorkerConfig,
    make_kv_cache_config,
)
from messages.step import HANDLE, NUM_COLUMNS, NUM_COMPUTED, NUM_SCHEDULED
from zmqworker.cdiv import cdiv
from zmqworker.distributed.parallel_state import single_rank_state
from zmqworker.model_runner import ModelRunner

BLOCK_SIZE = 16
PROMPT_LEN = 512
DECODE_STEPS = 160  # room in every request's blocks: warm-up, timed, pipelined, profiled
MAX_BATCHED = 8192
GREEDY = SamplingParams(temperature=0.0)

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
SHAPES = {
    "smollm2-135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    ),
    "llama-3.2-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        tie_word_embeddings=True,
        max_position_embeddings=131072,
        rope_parameters=_LLAMA3_ROPE,
    ),
    "llama-3-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
        max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    ),
}
DENSE_SHAPES = list(SHAPES)
SHAPES.update(MOE_SHAPES)
HF_WEIGHTS = ("smollm2-135m", "llama-3.2-1b")  # the others run dummy weights
PREFILL = (8, 1024)  # requests, tokens each


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


def make_checkpoint(shape: str, folder: Path) -> transformers.PreTrainedModel | None:
    """config.json of the shape in folder; random transformers weights beside it (and the
    model, on the GPU) for the shapes compared with transformers."""
    config_class = getattr(transformers, CONFIG_CLASSES.get(shape, "LlamaConfig"))
    config = config_class(**SHAPES[shape], bos_token_id=1, eos_token_id=2)
    config.save_pretrained(folder)
    if shape not in HF_WEIGHTS:
        return None
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model.save_pretrained(folder)
    return model


def blocks_per_request(prompt_len: int) -> int:
    return cdiv(prompt_len + DECODE_STEPS + BLOCK_SIZE, BLOCK_SIZE)


class Ours:
    """One runner per shape, KV blocks for max_batch requests of PROMPT_LEN + DECODE_STEPS
    (or the prefill row's requests, if more): Mixtral-8x7B's weights leave little room."""

    def __init__(self, folder: Path, dummy: bool, max_batch: int) -> None:
        config = WorkerConfig(
            model=ModelConfig(
                path=str(folder),
                dtype="bfloat16",
                max_model_len=PREFILL[1] + DECODE_STEPS + BLOCK_SIZE,
                load_format="dummy" if dummy else "auto",
            ),
            cache=CacheConfig(block_size=BLOCK_SIZE),
            scheduler=SchedulerConfig(max_num_seqs=max_batch, max_num_batched_tokens=MAX_BATCHED),
        )
        self.runner = ModelRunner(config, single_rank_state(torch.device("cuda")))
        spec = self.runner.get_kv_cache_spec()
        self.num_blocks = max(
            max_batch * blocks_per_request(PROMPT_LEN),
            PREFILL[0] * blocks_per_request(PREFILL[1]),
        )
        self.runner.initialize_kv_cache(make_kv_cache_config([spec], self.num_blocks))
        start = time.perf_counter()
        self.runner.warm_up([size for size in (1, 8) if size <= max_batch])
        torch.cuda.synchronize()
        self.warm_up_s = time.perf_counter() - start
        # As the worker process does once started: the collector stops walking the heap.
        gc.collect()
        gc.freeze()
        self.vocab = self.runner.model.vocab_size
        self.next_handle = 0
        self.live: list[int] = []

    def start(self, batch: int, prompt_len: int, rng: np.random.Generator) -> list[int]:
        """Prefill `batch` new requests (finishing the previous ones in the first step)."""
        handles = list(range(self.next_handle, self.next_handle + batch))
        self.next_handle += batch
        per_req = blocks_per_request(prompt_len)
        assert batch * per_req <= self.num_blocks
        finished, self.live = self.live, handles
        pending = list(enumerate(handles))
        while pending:
            new, budget = [], MAX_BATCHED
            while pending and budget >= prompt_len:
                i, handle = pending.pop(0)
                prompt = rng.integers(0, self.vocab, prompt_len).astype(np.int32)
                blocks = np.arange(i * per_req, (i + 1) * per_req)
                new.append(
                    NewRequestData(
                        f"r{handle}", handle, prompt, GREEDY, blocks.astype(np.int32), prompt_len
                    )
                )
                budget -= prompt_len
            so = SchedulerOutput(new, CachedRequestData.empty(), MAX_BATCHED - budget, finished)
            finished = []
            self.runner.execute_model(so).get_output()
        return handles

    def decode_steps(self, handles: list[int], computed: int, n: int) -> list[SchedulerOutput]:
        columns = np.zeros((NUM_COLUMNS, len(handles)), np.int32)
        columns[HANDLE], columns[NUM_SCHEDULED] = handles, 1
        steps = []
        for k in range(n):
            columns[NUM_COMPUTED] = computed + k
            steps.append(SchedulerOutput([], CachedRequestData(columns.copy()), len(handles)))
        return steps

    def one_at_a_time(self, steps: list[SchedulerOutput]) -> list[float]:
        times = []
        for so in steps:
            start = time.perf_counter()
            self.runner.execute_model(so).get_output()
            times.append(time.perf_counter() - start)
        return times

    def pipelined(self, steps: list[SchedulerOutput]) -> float:
        start = time.perf_counter()
        previous = None
        for so in steps:
            out = self.runner.execute_model(so)
            if previous is not None:
                previous.get_output()
            previous = out
        previous.get_output()
        return (time.perf_counter() - start) / len(steps)


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


def floor_bytes(model: torch.nn.Module, batch: int, context: int, spec) -> int:
    """What a decode step must read: the weights (of the input embedding only the rows it
    looks up, unless the LM head shares them) and every request's KV history."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.model.embed_tokens
    lm_head = model.lm_head
    if embed is not None and not (lm_head is not None and lm_head.shares_embedding):
        weights -= embed.weight.numel() * embed.weight.element_size()
        weights += batch * embed.weight.shape[1] * embed.weight.element_size()
    kv = batch * context * spec.page_size_bytes // BLOCK_SIZE * len(spec.layer_names)
    return weights + kv


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


def prefill_row(ours: Ours, rng: np.random.Generator, peak: float, shape: str) -> dict:
    """PREFILL's requests in one step: median time and the share of peak (a mixture of
    experts' tokens each multiply their top k experts)."""
    runner = ours.runner
    requests, length = PREFILL
    times = []
    for _ in range(4):
        torch.cuda.synchronize()
        start = time.perf_counter()
        ours.start(requests, length, rng)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times[1:])
    cfg = runner.model.hf_config
    tokens = requests * length
    linear = sum(
        p.numel() for n, p in runner.model.named_parameters() if "layers" in n and p.dim() == 2
    )
    linear += active_expert_params(runner.model)
    head_dim = runner.model.head_dim
    # QK^T and PV over the causal half, per request and layer.
    attention = requests * 2 * 2 * (length * length / 2) * head_dim * cfg.num_attention_heads
    flops = 2 * linear * tokens + attention * cfg.num_hidden_layers
    flops += 2 * cfg.vocab_size * cfg.hidden_size * requests  # the LM head of the sampled rows
    return {
        "shape": shape,
        "tokens": tokens,
        "ours_ms": seconds * 1e3,
        "mfu": flops / seconds / peak,
    }


def run_shape(
    shape: str, batches: list[int], hf_batches: list[int], bandwidth: float, args
) -> tuple[list[dict], dict | None]:
    """The shape's decode rows, and its prefill row if it is one of --prefill-shapes."""
    rows = []
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        folder = Path(tmp)
        hf = make_checkpoint(shape, folder)
        ours = Ours(folder, dummy=hf is None, max_batch=max(batches))
        print(f"{shape}: warm-up and graph capture {ours.warm_up_s:.1f} s", flush=True)
        rng = np.random.default_rng(0)
        spec = ours.runner.get_kv_cache_spec()
        for batch in batches:
            handles = ours.start(batch, PROMPT_LEN, rng)
            computed = PROMPT_LEN
            steps = ours.decode_steps(handles, computed, DECODE_STEPS - 8)
            model = ours.runner.model
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
            if args.profile_host and batch == batches[0]:
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
            rows.append(row)
            print(json.dumps(row), flush=True)
        prefill = None
        if shape in args.prefill_shapes.split(","):
            prefill = prefill_row(ours, rng, args.peak, shape)
            print(json.dumps(prefill), flush=True)
        ours.runner.shutdown()
        ours = None
        gc.collect()
        torch.cuda.empty_cache()
        if hf is not None:
            for row in rows:
                if row["batch"] in hf_batches:
                    row["hf_compiled_ms"] = hf_compiled_step(hf, row["batch"], 24) * 1e3
                    hf_ms = row["hf_compiled_ms"]
                    print(f"{shape} batch {row['batch']}: transformers {hf_ms:.2f} ms", flush=True)
            del hf
            gc.collect()
            torch.cuda.empty_cache()
    return rows, prefill


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
    batches = [int(b) for b in args.batches.split(",")]
    hf_batches = {}
    for part in filter(None, args.hf_batches.split(";")):
        shape, _, sizes = part.partition(":")
        hf_batches[shape] = [int(b) for b in sizes.split(",") if b]
    bandwidth = hbm_bandwidth()
    args.peak = matmul_peak()
    torch.cuda.empty_cache()  # the probes' 8 GiB: Mixtral-8x7B's weights need the room
    print(
        f"HBM {bandwidth / 1e12:.2f} TB/s, bf16 matmul {args.peak / 1e12:.0f} TFLOP/s", flush=True
    )
    rows, prefills = [], []
    for shape in args.shapes.split(","):
        shape_rows, shape_prefill = run_shape(
            shape, batches, hf_batches.get(shape, []), bandwidth, args
        )
        rows += shape_rows
        prefills += [shape_prefill] if shape_prefill else []
    table = [
        {
            "shape": r["shape"],
            "batch": r["batch"],
            "ours_ms": r["ours_ms"],
            "pipelined_ms": r["ours_pipelined_ms"],
            "floor_ms": r["floor_ms"],
            "x_floor": r["ours_ms"] / r["floor_ms"],
            "hf_ms": r["hf_compiled_ms"] if r["hf_compiled_ms"] is not None else float("nan"),
            "busy": r["gpu_busy"],
            "busy_pipe": r["gpu_busy_pipelined"],
        }
        for r in rows
    ]
    print(f"\nHBM {bandwidth / 1e12:.2f} TB/s, bf16 matmul {args.peak / 1e12:.0f} TFLOP/s")
    print_table(table, precision=3)
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
    }
    print(f"wrote {write_results('gpu_decode', result, args.out)}")


if __name__ == "__main__":
    main()
