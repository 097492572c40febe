"""`zmqworker serve` under load, in the manner of `vllm bench serve`, against its floor:
`LLM.generate` offline on the same prompts, same engine options, in the same run.

Prompts are random token ids of --prompt-len (or the prompts of a JSONL file, each line
{"prompt": ...}), sent as streamed completions (greedy, ignore_eos, --output-len tokens)
by client processes of their own (bench/serve_client.py), at most --concurrency in flight
(a comma-separated list runs each) and at --request-rate a second (Poisson; default: all
at once). Reported per concurrency: output tokens/s, time to first token, time per output
token and inter-token latency percentiles, and the ratios to the offline floor (output
tokens/s; inter-token p50 over the offline mean TPOT). Writes bench/results/serve_load.json
(or --out).

--json-schema FILE sends that JSON schema with every request (vLLM's structured_outputs);
"long" is bench/end_to_end.py's schema, whose string outlasts any --output-len, so that
every step of every request is masked and outputs keep their length. The offline floor
runs without it: the ratios then hold the schema's cost.

    python -m bench.serve_load                              # CPU, the embedded model
    python -m bench.serve_load --device cuda --dtype bfloat16 --load-format dummy \\
        --model FOLDER --concurrency 256 --prompt-len 130 --output-len 256
    python -m bench.serve_load --url http://HOST:PORT --model FOLDER   # a running server
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import print_table, write_results

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 600


def engine_options(args: argparse.Namespace, max_num_seqs: int) -> dict[str, Any]:
    """The LLM's keyword arguments, shared by the offline floor and the server."""
    options = {
        "model": args.model,
        "device": args.device,
        "dtype": args.dtype,
        "load_format": args.load_format,
        "tensor_parallel_size": args.tp,
        "pipeline_parallel_size": args.pp,
        "max_num_seqs": max_num_seqs,
        "max_model_len": args.max_model_len,
        "max_num_batched_tokens": args.max_num_batched_tokens,
    }
    if args.gpu_memory_utilization is not None:
        options["gpu_memory_utilization"] = args.gpu_memory_utilization
    return {k: v for k, v in options.items() if v is not None}


def cli_flags(options: dict[str, Any]) -> list[str]:
    flags = {"tensor_parallel_size": "--tp", "pipeline_parallel_size": "--pp"}
    out = []
    for name, value in options.items():
        out += [flags.get(name, "--" + name.replace("_", "-")), str(value)]
    return out


def make_prompts(args: argparse.Namespace) -> list[Any]:
    """Token-id prompts of exactly --prompt-len (ids below the vocabulary's size), or
    the prompts of --dataset."""
    if args.dataset:
        lines = Path(args.dataset).read_text().splitlines()
        prompts = [json.loads(line)["prompt"] for line in lines if line.strip()]
        return prompts[: args.num_prompts] if args.num_prompts else prompts
    from zmqworker.engine.model_folder import ModelFolder

    vocab = ModelFolder.open(args.model).vocab_size or 32000
    rng = np.random.default_rng(args.seed)
    # Ids from the vocabulary's middle: clear of the special tokens at either end.
    low, high = min(1000, vocab // 4), vocab - min(1000, vocab // 4)
    count = args.num_prompts or max(args.concurrency)
    return [rng.integers(low, high, args.prompt_len).tolist() for _ in range(count)]


def offline(options: dict[str, Any], prompts: list[Any], output_len: int) -> dict[str, Any]:
    """LLM.generate on every prompt at once: output tokens/s and mean TPOT."""
    from messages import SamplingParams
    from zmqworker.frontend.llm import LLM

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    with LLM(**options) as llm:
        llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4))  # warm
        started = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - started
    tokens = sum(len(o.token_ids) for o in outs)
    return {
        "output_tok_s": tokens / elapsed,
        "tpot_ms": 1e3 * float(np.mean([o.timings.tpot for o in outs])),
        "ttft_ms": 1e3 * float(np.mean([o.timings.ttft for o in outs])),
        "duration_s": elapsed,
    }


class Server:
    """`zmqworker serve` started by the bench, stopped with SIGTERM."""

    def __init__(self, options: dict[str, Any], extra: list[str], port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (closed by stop())
        argv = [sys.executable, "-m", "zmqworker", "serve", "--port", str(port)]
        argv += ["--served-model-name", "bench", *cli_flags(options), *extra]
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not healthy(self.url):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                self.log.seek(0)
                tail = self.log.read().decode(errors="replace")[-3000:]
                raise RuntimeError(f"the server did not start:\n{tail}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def served_model(url: str) -> str:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as response:
        return json.loads(response.read())["data"][0]["id"]


def schema_of(option: str | None) -> dict[str, Any] | None:
    """--json-schema's schema: a file's, or "long" (bench/end_to_end.py's)."""
    if option is None:
        return None
    if option == "long":
        from bench.end_to_end import LONG_SCHEMA

        return LONG_SCHEMA
    return json.loads(Path(option).read_text())


def client_process(url: str, model: str, job: dict[str, Any]) -> subprocess.Popen:
    """A bench/serve_client.py process running job (prompts, max_tokens, concurrency,
    rate, seed, start_at; api_key and schema optional) against url's completions."""
    host, port = url.removeprefix("http://").rstrip("/").rsplit(":", 1)
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.serve_client"],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    job = {"host": host, "port": int(port), "path": "/v1/completions", "model": model,
           "api_key": None, "schema": None, **job}  # fmt: skip
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(job).encode())
    proc.stdin.close()
    return proc


def load(url: str, model: str, prompts: list[Any], args: argparse.Namespace, concurrency: int):
    """Every prompt through the server from --clients processes; their records."""
    clients = max(1, min(args.clients, concurrency))
    start_at = time.time() + 1.0 + 0.2 * clients  # after every client has imported
    procs = []
    for i in range(clients):
        job = {
            "api_key": args.api_key,
            "prompts": prompts[i::clients],
            "max_tokens": args.output_len,
            "concurrency": concurrency // clients + (i < concurrency % clients),
            "rate": args.request_rate / clients if args.request_rate else None,
            "seed": args.seed + i,
            "start_at": start_at,
            "schema": args.schema,
        }
        procs.append(client_process(url, model, job))
    records = []
    for proc in procs:
        assert proc.stdout is not None
        records += json.loads(proc.stdout.read())
        if proc.wait() != 0:
            raise RuntimeError(f"a client process exited with status {proc.returncode}")
    return records


def summarize(records: list[dict[str, Any]], concurrency: int) -> dict[str, Any]:
    failed = [r for r in records if not r["ok"]]
    done = [r for r in records if r["ok"]]
    if not done:
        raise RuntimeError(f"every request failed; first error: {failed[0]['error']}")
    duration = max(r["end"] for r in done) - min(r["start"] for r in records)
    tokens = sum(r["output_tokens"] for r in done)
    ttft = [r["chunk_times"][0] - r["start"] for r in done]
    itl = np.concatenate([np.diff(r["chunk_times"]) for r in done])
    tpot = [
        (r["chunk_times"][-1] - r["chunk_times"][0]) / (r["output_tokens"] - 1)
        for r in done
        if r["output_tokens"] > 1
    ]

    def ms(values: Any, q: float) -> float:
        return 1e3 * float(np.percentile(values, q)) if len(values) else float("nan")

    return {
        "concurrency": concurrency,
        "requests": len(records),
        "failed": len(failed),
        "first_error": failed[0]["error"] if failed else None,
        "duration_s": duration,
        "output_tok_s": tokens / duration,
        "ttft_p50_ms": ms(ttft, 50),
        "ttft_p99_ms": ms(ttft, 99),
        "tpot_mean_ms": 1e3 * float(np.mean(tpot)) if tpot else float("nan"),
        "itl_p50_ms": ms(itl, 50),
        "itl_p99_ms": ms(itl, 99),
    }


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine's options engine_options reads (all but max_model_len and sizing)."""
    parser.add_argument("--model", default=None, help="checkpoint folder (default: embedded)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--load-format", default=None)
    parser.add_argument("--tp", type=int, default=None)
    parser.add_argument("--pp", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(parser)
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    parser.add_argument("--concurrency", default="32", help="in flight; a list runs each")
    parser.add_argument("--num-prompts", type=int, default=None, help="default: concurrency")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--dataset", default=None, help='JSONL of {"prompt": ...} lines')
    parser.add_argument("--request-rate", type=float, default=None, help="default: at once")
    parser.add_argument("--clients", type=int, default=max(1, (os.cpu_count() or 2) // 4))
    parser.add_argument("--url", default=None, help="a running server (no floor is run)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--serve-args", default="", help="more `zmqworker serve` options")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-floor", action="store_true", help="skip LLM.generate offline")
    parser.add_argument("--json-schema", default=None, help='FILE, or "long": every request')
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    args.schema = schema_of(args.json_schema)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.max_model_len = None if args.dataset else args.prompt_len + args.output_len + 16
    prompts = make_prompts(args)
    rows, floors = [], {}
    server = None
    if args.url is None:
        server = Server(
            engine_options(args, max(args.concurrency)),
            shlex.split(args.serve_args),
            args.port,
        )
    url = args.url or server.url  # type: ignore[union-attr]
    try:
        model = served_model(url)
        load(url, model, prompts[:2], args, 2)  # warm
        for concurrency in args.concurrency:
            rows.append(summarize(load(url, model, prompts, args, concurrency), concurrency))
    finally:
        if server is not None:
            server.stop()
    if args.url is None and not args.no_floor:
        for concurrency in sorted(set(args.concurrency)):
            floors[concurrency] = offline(
                engine_options(args, concurrency), prompts, args.output_len
            )
    for row in rows:
        floor = floors.get(row["concurrency"])
        if floor is not None:
            row["offline_tok_s"] = floor["output_tok_s"]
            row["offline_tpot_ms"] = floor["tpot_ms"]
            row["tok_s_over_offline"] = row["output_tok_s"] / floor["output_tok_s"]
            row["itl_p50_over_offline_tpot"] = row["itl_p50_ms"] / floor["tpot_ms"]
    shown = [{k: v for k, v in r.items() if k != "first_error"} for r in rows]
    print_table(shown, precision=2)
    result = {
        "args": {k: v for k, v in vars(args).items() if k not in ("api_key", "schema")},
        "rows": rows,
        "offline": {str(c): f for c, f in floors.items()},
    }
    print(f"wrote {write_results('serve_load', result, args.out)}")


if __name__ == "__main__":
    main()
