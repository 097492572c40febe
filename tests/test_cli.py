"""The CLI: options derived from LLM and SamplingParams, parse-time checks, prompts from
files and stdin, and the real command on the embedded model (JSONL, chat, layouts)."""

from __future__ import annotations

import inspect
import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import msgspec
import psutil
import pytest

import zmqworker
from messages import SamplingParams
from tests.test_readme import require_embedded_model
from zmqworker.cli import build_parser, main
from zmqworker.cli.generate import LLM_OPTIONS, SAMPLING_OPTIONS
from zmqworker.cli.options import given, parse_size
from zmqworker.cli.prompts import PromptItem, read_prompts
from zmqworker.frontend.llm import LLM

ROOT = Path(__file__).resolve().parent.parent


def generate_parser():
    return build_parser()[1]["generate"]


def test_every_llm_argument_and_sampling_field_is_an_option_with_its_default():
    parser = generate_parser()
    actions = {a.dest: a for a in parser._actions}
    # Not **vllm_args: vLLM's arguments, taken for compatibility only
    parameters = inspect.signature(LLM).parameters
    names = [n for n, p in parameters.items() if p.kind is not p.VAR_KEYWORD]
    fields = msgspec.structs.fields(SamplingParams)
    options = {o.name: o for o in LLM_OPTIONS}
    # structured_outputs has options of its own (--json-schema, --regex, ...).
    assert set(names) == set(options) and {f.name for f in fields} - {"structured_outputs"} == {
        o.name for o in SAMPLING_OPTIONS
    }
    assert {"json_schema", "regex", "choice", "grammar"} <= set(actions)
    assert {o.dest for o in [*LLM_OPTIONS, *SAMPLING_OPTIONS]} <= set(actions)
    for name in names:
        default = parameters[name].default
        if default not in (None, "") and name != "max_num_seqs":
            assert f"(default: {default})" in actions[options[name].dest].help, name
    assert f"(default: {SamplingParams().temperature})" in actions["temperature"].help
    assert f"(default: {SamplingParams().max_tokens})" in actions["max_tokens"].help
    # What was not given stays unset: the definitions' defaults apply.
    args = parser.parse_args(["a prompt"])
    assert not any(hasattr(args, o.dest) for o in [*LLM_OPTIONS, *SAMPLING_OPTIONS])
    assert not hasattr(args, "temperature") and not hasattr(args, "max_tokens")


def test_options_parse_as_their_definitions_say():
    args = generate_parser().parse_args(
        ["x", "--tp", "3", "--kv-cache-bytes", "256MiB", "--stop", ".", "--stop", "\n",
         "--ignore-eos", "--executor", "ray", "--engine-seed", "5", "--seed", "7"]
    )  # fmt: skip
    assert args.tensor_parallel_size == 3 and args.kv_cache_bytes == 256 << 20
    assert args.stop == [".", "\n"] and args.ignore_eos is True and args.executor == "ray"
    # SamplingParams.seed is --seed; LLM's seed is --engine-seed: each reaches its own.
    assert given(args, SAMPLING_OPTIONS)["seed"] == 7 and given(args, LLM_OPTIONS)["seed"] == 5
    assert parse_size("1.5G") == 3 << 29 and parse_size("4096") == 4096


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["generate", "x", "--temperature", "-1"], "argument --temperature: Expected `float` >= 0"),
        (["generate", "x", "--logprobs", "-1"], "argument --logprobs: Expected `int` >= 0"),
        (["generate", "x", "--tp", "0"], "--tensor-parallel-size/--tp: Expected `int` >= 1"),
        (["generate", "x", "--kv-cache-bytes", "lots"], "not a size: 'lots'"),
        (["generate", "x", "--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
        (["generate", "x", "--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_options_are_errors_of_the_subcommand(argv, expected, capsys):
    with pytest.raises(SystemExit) as caught:
        main(argv)
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert expected in err and "usage: zmqworker generate" in err


def test_version(capsys):
    with pytest.raises(SystemExit) as caught:
        main(["--version"])
    assert caught.value.code == 0
    assert capsys.readouterr().out.strip() == f"zmqworker {zmqworker.__version__}"
    assert zmqworker.LLM is LLM and zmqworker.SamplingParams is SamplingParams


def test_prompts_from_lines_jsonl_and_stdin(tmp_path, monkeypatch):
    lines = tmp_path / "prompts.txt"
    lines.write_text("first prompt\r\n\n{not json}\nlast \u2028 line\n")
    prompts = [p.prompt for p in read_prompts([], str(lines))]
    assert prompts == ["first prompt", "{not json}", "last \u2028 line"]
    jsonl = tmp_path / "prompts.jsonl"
    chat = [{"role": "user", "content": "Hi"}]
    jsonl.write_text(
        json.dumps({"prompt": "text", "max_tokens": 3}) + "\n" + json.dumps({"prompt": [1, 2]})
        + "\n\n" + json.dumps({"messages": chat, "stop": ["."]}) + "\n"
    )  # fmt: skip
    where = f"{jsonl} line"
    assert read_prompts(["cli"], str(jsonl)) == [
        PromptItem(prompt="cli"),
        PromptItem(prompt="text", sampling={"max_tokens": 3}, source=f"{where} 1"),
        PromptItem(prompt=[1, 2], source=f"{where} 2"),
        PromptItem(messages=chat, sampling={"stop": ["."]}, source=f"{where} 4"),
    ]  # fmt: skip
    monkeypatch.setattr(sys, "stdin", open(lines))  # noqa: SIM115
    [first, *_] = read_prompts(["x", "-"], None)[1:]
    assert first == PromptItem(prompt="first prompt", source="stdin line 1")
    assert first.where(1) == "prompt 1 (stdin line 1)"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"prompt": "a"}\n{"text": "b"}\n', 'prompt 1 (P line 2): unknown key "text"'),
        ('{"prompt": "a", "messages": []}\n', 'prompt 0 (P line 1): give either "prompt" or'),
        ('{"prompt": 3}\n', 'prompt 0 (P line 1): "prompt" must be text or a non-empty list'),
        ('{"messages": []}\n', 'prompt 0 (P line 1): "messages" must be a non-empty list'),
        ('{"prompt": "a", "stop": "."}\n', 'prompt 0 (P line 1): "stop": Expected `array`'),
        ("\n\n", "P holds no prompts"),
    ],
)
def test_bad_prompt_files_name_the_prompt_and_line(tmp_path, content, message):
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError) as caught:
        read_prompts([], str(path))
    assert str(caught.value).replace(str(path), "P").startswith(message)
    with pytest.raises(ValueError, match="cannot read prompts from"):
        read_prompts([], str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="no prompts"):
        read_prompts([], None)


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "zmqworker", *args],
        input=stdin, capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        (["--tp", "2"], "tensor_parallel_size=2 must divide the model's 9 attention heads"),
        (["--pp", "31"], "pipeline_parallel_size=31 is more than the model's 30 layers"),
    ],
)
def test_a_bad_layout_is_refused_before_any_process_starts(layout, message):
    require_embedded_model()
    out = run_cli("generate", "x", *layout)
    assert out.returncode == 1 and message in out.stderr
    assert "starting" not in out.stderr and "Traceback" not in out.stderr


def test_json_lines_from_stdin_and_a_jsonl_file_with_its_own_settings(tmp_path):
    require_embedded_model()
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(
        json.dumps({"prompt": "The capital of France is", "max_tokens": 2, "logprobs": 2})
        + "\n" + json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})
    )  # fmt: skip
    out = run_cli(
        "generate", "-", "--prompts-file", str(jsonl), "--json", "--max-tokens", "3",
        "--temperature", "0", "--logprobs", "1", "--max-model-len", "512",
        "--prompt-logprobs", "0", stdin="The capital of France is\nOnce upon a time\n",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    records = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["index"] for r in records] == [0, 1, 2, 3]
    assert records[0]["prompt"] == "The capital of France is"
    assert records[0]["text"].startswith(" Paris")
    # The JSONL lines' own max_tokens and logprobs; the options elsewhere.
    assert [len(r["token_ids"]) for r in records] == [3, 3, 2, 1]
    assert records[2]["token_ids"] == records[0]["token_ids"][:2]
    assert [len(records[i]["logprobs"][0]["top"]) for i in range(4)] == [1, 1, 2, 1]
    for record in records:
        assert record["finish_reason"] == "length"
        assert [p["token_id"] for p in record["logprobs"]] == record["token_ids"]
        assert all(p["logprob"] <= 0 for p in record["logprobs"])
        prompt = record["prompt_logprobs"]  # null, then the prompt token alone at each
        assert len(prompt) == record["num_prompt_tokens"] and prompt[0] is None
        assert all(p["rank"] >= 1 and p["top"] == [] and p["logprob"] <= 0 for p in prompt[1:])
    assert "KV cache: 128 blocks" in out.stderr  # 4 prompts x 512 tokens, 16 a block


def test_a_conversation_is_counted_once_the_engine_is_up_before_any_output():
    """The chat template needs transformers, which the engine loads while its workers
    start: a conversation too long is refused there, before anything is printed."""
    require_embedded_model()
    out = run_cli("generate", "--chat", "hello " * 60, "--max-model-len", "64")
    assert out.returncode == 1 and out.stdout == "", out.stderr[-2000:]
    last = out.stderr.splitlines()[-1]
    assert re.fullmatch(
        r"zmqworker: error: prompt 0: the prompt has \d+ tokens, more than max_model_len=64", last
    )


def test_chat_prints_only_the_reply():
    require_embedded_model()
    out = run_cli(
        "generate", "--chat", "--system", "You answer in one word.",
        "What is the capital of France?", "--temperature", "0", "--max-tokens", "8",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Paris" in out.stdout
    for prompt_text in ("one word", "capital of France?", "<|im_start|>", "assistant"):
        assert prompt_text not in out.stdout


def test_sigterm_shuts_the_workers_down_and_exits_143():
    """SIGTERM mid-generation unwinds like Ctrl-C: no worker outlives the command."""
    require_embedded_model()
    proc = subprocess.Popen(
        [sys.executable, "-m", "zmqworker", "generate", "Once upon a time", "--pp", "2",
         "--max-tokens", "8000", "--ignore-eos"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        proc.stdout.read(len("Once upon a time") + 8)  # the prompt, then generated text
        workers = psutil.Process(proc.pid).children(recursive=True)
        assert len(workers) >= 2
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 143, stderr[-2000:]
    assert "zmqworker: terminated" in stderr and "Traceback" not in stderr
    gone, alive = psutil.wait_procs(workers, timeout=5)
    assert not alive


def test_n_samples_of_a_prompt_are_json_lines_seeded_apart():
    require_embedded_model()
    out = run_cli(
        "generate", "The capital of France is", "--json", "--n", "3", "--seed", "5",
        "--max-tokens", "3", "--temperature", "1", "--max-model-len", "256",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    records = [json.loads(line) for line in out.stdout.splitlines()]
    assert [(r["index"], r["sample"]) for r in records] == [(0, 0), (0, 1), (0, 2)]
    assert len({tuple(r["token_ids"]) for r in records}) == 3
    assert "KV cache: 48 blocks" in out.stderr  # 3 samples x 256 tokens, 16 a block
