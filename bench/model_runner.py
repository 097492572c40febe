"""Decode throughput of the model runner against transformers `generate`, side by side.

Both run the embedded SmolLM2 checkpoint in the same process, with the same dtype, device
and torch thread count, on the same random 512-token prompts. Only decoding is timed, and
the two take turns step by step, so that both meet the same load on a shared machine:
our runner prefills first, then transformers' generate runs, and after each of its steps
a stopping criterion (which never stops) notes the time and runs one of our decode steps.
Throughput is batch / the median step time. With --repeats N each batch is measured N
times (a fresh runner and generate call each time) and the row holds the medians: the
machine may be shared, and one run can meet a burst of someone else's work. Prints a table
and writes bench/results/model_runner.json (model_runner_cuda.json for --device cuda).

    python -m bench.model_runner [--device cuda --dtype bfloat16] [--batches 1,8,32]
        [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import transformers

from bench.common import pin_threads, print_table, write_results
from messages import (
    CacheConfig,
    CachedRequestData,
    ModelConfig,
    ModelRunnerOutput,
    NewRequestData,
    SamplingParams,
    SchedulerConfig,
    SchedulerOutput,
    WorkerConfig,
    make_kv_cache_config,
)
from zmqworker.cdiv import cdiv
from zmqworker.distributed.parallel_state import single_rank_state
from zmqworker.model_runner.model_runner import ModelRunner
from zmqworker.models.embedded import default_model_path

BLOCK_SIZE = 16
PREFILL_CHUNK = 2048  # max_num_batched_tokens: the prompts are prefilled in chunks this big
GREEDY = SamplingParams(temperature=0.0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_runner(
    path: str, dtype: str, device: torch.device, batch: int, max_len: int
) -> tuple[ModelRunner, int]:
    """A runner with KV blocks for batch requests of max_len tokens; (runner, blocks per
    request)."""
    config = WorkerConfig(
        model=ModelConfig(path=path, dtype=dtype, max_model_len=max_len),
        cache=CacheConfig(block_size=BLOCK_SIZE),
        scheduler=SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=PREFILL_CHUNK),
    )
    runner = ModelRunner(config, single_rank_state(device))
    blocks_per_req = cdiv(max_len, BLOCK_SIZE)
    spec = runner.get_kv_cache_spec()
    runner.initialize_kv_cache(make_kv_cache_config([spec], batch * blocks_per_req))
    return runner, blocks_per_req


class OurDecoder:
    """Our runner on a batch of prompts: prefill() in chunks, then one timed decode step()
    at a time; tokens[i] collects request i's greedy tokens."""

    def __init__(
        self, path: str, dtype: str, prompts: np.ndarray, steps: int, device: torch.device
    ) -> None:
        self.prompts = prompts
        self.device = device
        batch, prompt_len = prompts.shape
        self.runner, blocks_per_req = make_runner(
            path, dtype, device, batch, prompt_len + steps + 1
        )
        self.tables = np.arange(batch * blocks_per_req, dtype=np.int32).reshape(batch, -1)
        self.tokens: list[list[int]] = [[] for _ in range(batch)]
        self.step_times: list[float] = []
        self._columns = np.zeros((5, batch), np.int32)  # HANDLE, NUM_COMPUTED, NUM_SCHEDULED
        self._columns[0] = np.arange(batch)
        self._columns[2] = 1

    def prefill(self) -> None:
        """New requests first, then the rest of their prompts, PREFILL_CHUNK tokens a step."""
        batch, prompt_len = self.prompts.shape
        computed = np.zeros(batch, np.int32)
        while (computed < prompt_len).any():
            budget, new, cached = PREFILL_CHUNK, [], ([], [], [])
            for i in np.flatnonzero(computed < prompt_len).tolist():
                s = min(prompt_len - int(computed[i]), budget)
                if computed[i] == 0:
                    prompt = self.prompts[i]
                    new.append(NewRequestData(f"r{i}", i, prompt, GREEDY, self.tables[i], s))
                else:
                    cached[0].append(i)
                    cached[1].append(int(computed[i]))
                    cached[2].append(s)
                computed[i] += s
                budget -= s
                if budget == 0:
                    break
            so = SchedulerOutput(new, CachedRequestData.build(*cached), PREFILL_CHUNK - budget)
            self._collect(self.runner.execute_model(so).get_output())
        _sync(self.device)

    def step(self) -> None:
        start = time.perf_counter()
        self._columns[1] = self.prompts.shape[1] + len(self.step_times)
        so = SchedulerOutput([], CachedRequestData(self._columns.copy()), self.prompts.shape[0])
        out = self.runner.execute_model(so).get_output()
        self.step_times.append(time.perf_counter() - start)
        self._collect(out)

    def _collect(self, out: ModelRunnerOutput) -> None:
        for h, t in zip(out.req_handles.tolist(), out.sampled_token_ids.tolist(), strict=True):
            if t >= 0:
                self.tokens[h].append(t)


class _TakeTurns(transformers.StoppingCriteria):
    """Called by generate after each of its steps: notes how long the step took, then runs
    one of our decode steps (outside generate's timing). Never stops generation."""

    def __init__(self, ours: OurDecoder, steps: int) -> None:
        self.ours = ours
        self.steps = steps
        self.hf_step_times: list[float] = []
        self._resumed_at: float | None = None  # when generate got the machine back

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        _sync(input_ids.device)
        now = time.perf_counter()
        if self._resumed_at is not None:  # the first call ends the prefill: not timed
            self.hf_step_times.append(now - self._resumed_at)
        if len(self.ours.step_times) < self.steps:
            self.ours.step()
        self._resumed_at = time.perf_counter()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def measure(
    hf: transformers.PreTrainedModel,
    path: str,
    dtype: str,
    prompts: np.ndarray,
    steps: int,
    device: torch.device,
) -> tuple[dict, int]:
    """One result row (decode tokens/s of ours and of generate, their ratio) and how many
    requests got the same greedy tokens from both."""
    ours = OurDecoder(path, dtype, prompts, steps, device)
    ours.prefill()
    turns = _TakeTurns(ours, steps)
    ids = torch.from_numpy(prompts.astype(np.int64)).to(device)
    config = transformers.GenerationConfig(
        do_sample=False, max_new_tokens=steps + 1, eos_token_id=None, pad_token_id=0
    )
    with torch.inference_mode():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            generation_config=config,
            stopping_criteria=transformers.StoppingCriteriaList([turns]),
        )
    ours.runner.shutdown()
    batch = prompts.shape[0]
    ours_tok_s = batch / float(np.median(ours.step_times))
    hf_tok_s = batch / float(np.median(turns.hf_step_times))
    hf_tokens = out[:, prompts.shape[1] :].cpu().tolist()
    same = sum(o[: steps + 1] == h for o, h in zip(ours.tokens, hf_tokens, strict=True))
    row = {"batch": batch, "ours_tok_s": ours_tok_s, "hf_tok_s": hf_tok_s}
    return row | {"ratio": ours_tok_s / hf_tok_s}, same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument(
        "--steps", type=int, default=None, help="decode steps (default: 32 on cpu, 128 on cuda)"
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads for both (default: torch's)"
    )
    parser.add_argument("--model", default=None, help="checkpoint folder (default: embedded)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per batch; rows are medians")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")

    device = torch.device(args.device)
    steps = args.steps or (32 if device.type == "cpu" else 128)
    threads = args.threads or torch.get_num_threads()
    pin_threads(threads)
    path = args.model or default_model_path()
    dtype = getattr(torch, args.dtype)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        rng = np.random.default_rng(batch)
        prompts = rng.integers(0, hf.config.vocab_size, (batch, args.prompt_len), np.int32)
        runs = []
        for _ in range(args.repeats):
            row, same = measure(hf, path, args.dtype, prompts, steps, device)
            runs.append(row)
            # greedy decoding: the same tokens, up to rare near-ties in reduced precision
            print(
                f"batch {batch}: ours {row['ours_tok_s']:.1f} tok/s, transformers "
                f"{row['hf_tok_s']:.1f} tok/s, ratio {row['ratio']:.2f}, identical token "
                f"sequences {same}/{batch}",
                flush=True,
            )
        rows.append({key: type(runs[0][key])(np.median([r[key] for r in runs])) for key in runs[0]})
    print(
        f"\ndecode tokens/s, {args.device} {args.dtype}, {threads} threads, "
        f"{args.prompt_len}-token prompts, {steps} decode steps (median step, median of "
        f"{args.repeats} runs)"
    )
    print_table(rows)
    name = "model_runner" if device.type == "cpu" else f"model_runner_{device.type}"
    print(f"wrote {write_results(name, {'rows': rows})}")


if __name__ == "__main__":
    main()
