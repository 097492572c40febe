"""`zmqworker generate` refuses bad input before any worker starts: each case runs the
command in this process with the executor factory and subprocess.Popen replaced by spies
that fail, exits 1 with one `zmqworker: error:` line and prints nothing on stdout."""

from __future__ import annotations

import io
import json
import logging
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from messages import SamplingParams
from tests import bad_input_table
from tests.test_readme import require_embedded_model
from tests.tiny import cached_tiny_checkpoint, make_fp8_checkpoint, make_gptq_checkpoint
from zmqworker.cli import main
from zmqworker.cli.preflight import check_run
from zmqworker.cli.prompts import PromptItem, read_prompts
from zmqworker.engine.model_folder import ModelFolder
from zmqworker.frontend import llm as llm_module
from zmqworker.models.embedded import default_model_path

ROOT = Path(__file__).resolve().parent.parent
MAX_MODEL_LEN = 8192  # the embedded model's max_position_embeddings
VOCAB = 49152


@pytest.fixture(scope="module")
def model() -> str:
    require_embedded_model()
    return default_model_path(progress=False)


@pytest.fixture
def refuse(monkeypatch, capsys, model):
    """Run `zmqworker generate ARGS` here, stdin given; return its one error line. Fails
    if a worker process was started or anything reached stdout."""
    started: list[object] = []

    def spy(*args: object, **kwargs: object) -> None:
        started.append(args)
        raise AssertionError(f"an engine core or a worker was started: {args!r:.200}")

    monkeypatch.setattr(llm_module, "EngineCoreLauncher", spy)
    monkeypatch.setattr(subprocess, "Popen", spy)
    logger = logging.getLogger("zmqworker")
    handlers, level = list(logger.handlers), logger.level
    sigterm = signal.getsignal(signal.SIGTERM)

    def run(*args: str, stdin: bytes = b"") -> str:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
        try:
            code = main(["generate", *args])
        finally:
            logger.handlers[:], logger.level = handlers, level
            signal.signal(signal.SIGTERM, sigterm)
        out, err = capsys.readouterr()
        assert (code, out, started) == (1, "", []), err
        assert err.count("\n") == 1 and err.startswith("zmqworker: error: "), err
        return err.removeprefix("zmqworker: error: ").rstrip("\n")

    return run


def count(model: str, text: str) -> int:
    return len(Tokenizer.from_file(f"{model}/tokenizer.json").encode(text).ids)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["x", "--temperature", "inf"],
         "temperature must be finite in float32 (at most 3.4028235e+38), got inf"),
        (["x", "--logprobs", "50"], "--logprobs 50 is more than max_logprobs=20"),
        (["x", "--logprobs", "6", "--max-logprobs", "5"],
         "--logprobs 6 is more than max_logprobs=5"),
        (["x", "--stop-token-ids", "999999"],
         f"--stop-token-ids 999999 is outside the vocabulary [0, {VOCAB})"),
        (["x", "--stop-token-ids", str(VOCAB)],
         f"--stop-token-ids {VOCAB} is outside the vocabulary"),
        (["a", ""], "prompt 1 is empty"),
        (["Hello \udcff"], "prompt 0 is not valid UTF-8 text: byte 0xff at character 7"),
        (["x", "--stop", "\udcfe"], "--stop is not valid UTF-8 text: byte 0xfe at character 1"),
        (["--chat", "--system", "\udcff", "x"], "--system is not valid UTF-8 text: byte 0xff"),
        (["x", "--system", "s"], "--system needs --chat"),
        (["x", "--max-tokens", "10000000"],
         "--max-tokens 10000000 leaves no room for a prompt in "
         f"max_model_len={MAX_MODEL_LEN}: at most {MAX_MODEL_LEN - 1}"),
        (["x", "y z", "--max-model-len", "64", "--max-tokens", "63"],
         "prompt 1: the prompt has 2 tokens; with --max-tokens 63 that is 65, more than "
         "max_model_len=64: at most 62 fit after it"),
        (["x", "--max-model-len", "9000"], "max_model_len=9000 is more than the model's"),
    ],
)  # fmt: skip
def test_bad_options_and_arguments_are_refused_before_the_start(refuse, args, message):
    assert message in refuse(*args)


def test_bad_structured_output_files_name_their_option(made, refuse, tmp_path):
    truncated, binary = tmp_path / "truncated.json", tmp_path / "binary.json"
    truncated.write_text('{"type": "object"')
    binary.write_bytes(b'{"type": "\xff"}')
    assert refuse("x", "--json-schema", str(truncated)) == (
        "--json-schema: structured_outputs.json is not JSON: Input data was truncated"
    )
    assert refuse("x", "--grammar", str(binary)) == (
        f"--grammar: {binary} is not UTF-8 text: byte 0xff at byte 11"
    )
    # What the grammar compiler refuses, before the start too (as the server's 400).
    nonsense = tmp_path / "nonsense.json"
    nonsense.write_text('{"type": "nonsense"}')
    assert refuse("x", "--regex", "(").startswith(
        "--json-schema/--regex/--choice/--grammar: structured_outputs.regex is invalid: "
    )
    assert "structured_outputs.json is invalid" in refuse("x", "--json-schema", str(nonsense))
    plain = cached_tiny_checkpoint(family="llama", num_layers=2)  # made's; no tokenizer
    for option, value in (("--stop", "x"), ("--bad-words", "x"), ("--regex", "a+")):
        name = "--json-schema/--regex/--choice/--grammar" if option == "--regex" else option
        assert refuse("x", "--model", plain, option, value) == (
            f"{name} needs the model's tokenizer, which it lacks"
        )


def test_prompt_lengths_are_counted_before_the_start(refuse, model):
    long = "a" * 100_000
    assert refuse(long) == (
        f"prompt 0: the prompt has {count(model, long)} tokens, more than max_model_len=8192"
    )
    # Exactly: the largest max_tokens that fits is accepted, one more is not.
    prompt = "The capital of France is"
    room = 100 - count(model, prompt)
    [job] = check_run([PromptItem(prompt=prompt)], {"max_tokens": room}, **run_args(model, 100))
    assert job.num_tokens == 100 - room
    assert refuse(prompt, "--max-model-len", "100", "--max-tokens", str(room + 1)).endswith(
        f"that is 101, more than max_model_len=100: at most {room} fit after it"
    )


def run_args(model: str, max_model_len: int | None = None, chat: bool = False) -> dict:
    return dict(model=model, max_model_len=max_model_len, max_logprobs=20, chat=chat, system=None)


def test_bad_prompt_sources_name_the_prompt_and_line(refuse, tmp_path):
    path = tmp_path / "p.jsonl"
    cases = {
        b'{"prompt": "a"}\n\n{"prompt": "b"\n': "prompt 1 (FILE line 3) is not valid JSON (Input "
        'data was truncated); the file is JSONL, as its first line starts with "{"',
        b'{"prompt": "a"}\nplain text\n': "prompt 1 (FILE line 2) is not valid JSON",
        b'{"prompt": "a"}\n[1, 2]\n': "prompt 1 (FILE line 2) is not a JSON object",
        b'{"prompt": "a", "max_token": 3}\n': 'prompt 0 (FILE line 1): unknown key "max_token": '
        'a line takes "prompt" or "messages", and sampling fields (temperature, top_k',
        b'{"prompt": "a", "temperature": -1}\n': 'prompt 0 (FILE line 1): "temperature": '
        "Expected `float` >= 0.0",
        b'{"prompt": "a", "max_tokens": 9000}\n': "prompt 0 (FILE line 1): the prompt has 1 "
        'token; with "max_tokens" 9000 that is 9001',
        b'{"prompt": "a", "logprobs": 21}\n': 'prompt 0 (FILE line 1): "logprobs" 21 is more '
        "than max_logprobs=20",
        b'{"prompt": [1, 49152]}\n': "prompt 0 (FILE line 1): token ids [49152] are outside "
        "the vocabulary [0, 49152)",
        b'{"prompt": []}\n': 'prompt 0 (FILE line 1): "prompt" must be text or a non-empty list',
        b'{"prompt": "a\\udcff"}\n': "prompt 0 (FILE line 1) is not valid JSON (JSON is "
        "malformed: invalid utf-16 surrogate pair",
        b'{"messages": [{"role": "bot", "content": "x"}]}\n': "prompt 0 (FILE line 1): message "
        "0: role must be system, user, assistant or tool, got 'bot'",
        b"ok\nbad \xff\n": "prompt 1 (FILE line 2) is not valid UTF-8 text: byte 0xff at byte "
        "5 of the line",
    }
    for content, message in cases.items():
        path.write_bytes(content)
        got = refuse("--prompts-file", str(path)).replace(str(path), "FILE")
        assert got.startswith(message), (content, got)
    assert refuse("first", "-", stdin=b"ok\n\nnot \xfe utf-8\n") == (
        "prompt 2 (stdin line 3) is not valid UTF-8 text: byte 0xfe at byte 5 of the line"
    )
    assert refuse("-", "--chat", stdin=b'{"prompt": [1, 2]}\n') == (
        "prompt 0 (stdin line 1): --chat needs text prompts, not token ids"
    )


def test_a_line_s_sampling_fields_are_its_prompt_s(model, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(
        json.dumps({"prompt": "a", "max_tokens": 3, "stop": ["."], "temperature": 0.5}) + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "hi"}], "logprobs": 2}) + "\n"
        + json.dumps({"prompt": [1, 2, 3]}) + "\n"
    )  # fmt: skip
    items = read_prompts([], str(path))
    jobs = check_run(items, {"max_tokens": 7, "temperature": 0.0}, **run_args(model))
    assert [j.params for j in jobs] == [
        SamplingParams(max_tokens=3, stop=["."], temperature=0.5),
        SamplingParams(max_tokens=7, temperature=0.0, logprobs=2),
        SamplingParams(max_tokens=7, temperature=0.0),
    ]
    assert [j.num_tokens for j in jobs] == [1, None, 3]  # the conversation: after the start
    assert jobs[1].conversation == [{"role": "user", "content": "hi"}]


def test_a_line_s_messages_are_taken_in_openai_s_shape(model, tmp_path):
    """Content parts, an assistant's tool calls with content None and the developer role,
    as LLM.chat and the server take them (the check refused them before the engine ran)."""
    call = {"type": "function", "function": {"name": "f", "arguments": "{}"}}
    conversation = [
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "42"},
    ]
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"messages": conversation}) + "\n")
    [job] = check_run(read_prompts([], str(path)), {}, **run_args(model))
    assert job.conversation == conversation  # handed on as given: LLM.chat normalises it


def test_generation_config_defaults_take_part_in_the_checks(model, tmp_path, refuse):
    folder = tmp_path / "m"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(model) / name, folder / name)
    prompt = "a b c"
    max_new_tokens = MAX_MODEL_LEN - count(model, prompt) + 1  # one too many for the prompt
    (folder / "generation_config.json").write_text(
        json.dumps(
            {"temperature": 0.6, "top_k": 50, "max_new_tokens": max_new_tokens,
             "repetition_penalty": 1.05, "do_sample": True}
        )
    )  # fmt: skip
    assert ModelFolder.open(str(folder)).default_sampling_params() == SamplingParams(
        temperature=0.6, top_k=50, max_tokens=max_new_tokens, repetition_penalty=1.05
    )  # vLLM's: those keys, nothing else
    assert refuse(prompt, "--model", str(folder)).startswith(
        f"prompt 0: the prompt has {count(model, prompt)} tokens; with the default max_tokens "
        f"{max_new_tokens} that is {MAX_MODEL_LEN + 1}, more than max_model_len={MAX_MODEL_LEN}"
    )
    (folder / "generation_config.json").write_text('{"max_new_tokens": 8192, "top_p": 0}')
    assert refuse("x", "--model", str(folder)).startswith(f"{folder / 'generation_config.json'}: ")
    (folder / "generation_config.json").write_text('{"max_new_tokens": 8192}')
    assert refuse("x", "--model", str(folder)) == (
        "the default max_tokens 8192 leaves no room for a prompt in max_model_len=8192: at most "
        "8191"
    )


def test_tokenizer_json_counts_as_the_engine_s_tokenizer(model):
    """The count before the start is the engine's: transformers' tokenizer of the embedded
    model is its tokenizer.json, special tokens included."""
    folder = ModelFolder.open(model)
    tokenizer = folder.load_text_side().tokenizer
    texts = [
        "The capital of France is", "  two spaces", "tabs\tand\r\nnewlines\n", "x\u2028y",
        "<|im_start|>user\nhi<|im_end|>", "<|endoftext|>", "émoji 🚀 中文", "a" * 5000, " " * 300,
    ]  # fmt: skip
    items = [PromptItem(prompt=t) for t in texts]
    jobs = check_run(items, {"max_tokens": 1}, **run_args(model))
    assert [j.num_tokens for j in jobs] == [len(tokenizer.encode(t)) for t in texts]


def test_the_real_command_refuses_invalid_utf8_in_one_line():
    """As a user runs it: bytes that are not UTF-8 in an argument and on stdin."""
    require_embedded_model()
    for argv, stdin in ([b"Hello \xff"], b""), ([b"-"], b"fine\n\xff\xfe\n"):
        out = subprocess.run(
            [sys.executable, "-m", "zmqworker", "generate", *argv],
            input=stdin, capture_output=True, timeout=120, cwd=ROOT,
        )  # fmt: skip
        assert out.returncode == 1 and out.stdout == b"", out.stderr
        assert out.stderr.decode().startswith("zmqworker: error: prompt ")
        assert out.stderr.count(b"\n") == 1 and b"is not valid UTF-8 text" in out.stderr


@pytest.fixture(scope="module")
def made(model, tmp_path_factory) -> dict[str, str]:
    """What docs/bad_input.md's <names> stand for."""
    folder = tmp_path_factory.mktemp("bad_input")
    plain = cached_tiny_checkpoint(family="llama", num_layers=2)
    (folder / "cut.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b"\n')
    (folder / "unknown.jsonl").write_text('{"prompt": "a", "max_token": 3}\n')
    (folder / "gpt2").mkdir()
    gpt2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": 12}
    (folder / "gpt2" / "config.json").write_text(json.dumps(gpt2))
    for name, tokenizer in (("cut", '{"version": "1.0", "added'), ("empty", '{"version": "1.0"}')):
        (folder / name).mkdir()
        for item in Path(plain).iterdir():
            (folder / name / item.name).symlink_to(item)
        (folder / name / "tokenizer.json").write_text(tokenizer)
    return {
        "<100,000 characters>": "a" * 100_000,
        "<Hello, then byte 0xff>": "Hello \udcff",
        "<JSONL, line 2 cut short>": str(folder / "cut.jsonl"),
        "<JSONL, an unknown key>": str(folder / "unknown.jsonl"),
        "<FP8 checkpoint>": make_fp8_checkpoint(plain, folder / "fp8"),
        "<FP8 tensors, no quantization_config>": make_fp8_checkpoint(
            plain, folder / "fp8-bare", with_config=False
        ),
        "<GPTQ checkpoint>": make_gptq_checkpoint(plain, folder / "gptq"),
        "<GPT-2 folder>": str(folder / "gpt2"),
        "<tokenizer.json cut short>": str(folder / "cut"),
        "<tokenizer.json of no model>": str(folder / "empty"),
        "<config.json>": f"{model}/config.json",
        "<embedded model>": model,
    }


@pytest.mark.parametrize(
    "row", bad_input_table.rows("`zmqworker generate`"), ids=lambda row: row[0].strip("`")
)
def test_the_bad_input_page_is_what_generate_says(refuse, made, row):
    arguments, message = row
    [expected] = bad_input_table.code(message)
    got = refuse(*bad_input_table.arguments(arguments, made))
    assert got == bad_input_table.resolve(expected, made)


def test_json_lines_hold_a_ruled_out_token_s_logprob_as_a_number():
    """A token a grammar, a bad word or min_tokens rules out has a logprob of -inf, which
    --json wrote as -Infinity: no JSON reader takes it. It gets the API's floor."""
    from zmqworker.cli.generate import _position
    from zmqworker.frontend.outputs import MIN_LOGPROB, PositionLogprobs, TokenLogprob

    ruled_out = TokenLogprob(2, float("-inf"), "</s>")
    position = PositionLogprobs(TokenLogprob(5, -0.5, "a"), 1, [ruled_out])
    line = json.loads(json.dumps(_position(position), allow_nan=False))
    assert line["logprob"] == -0.5 and line["top"][0]["logprob"] == MIN_LOGPROB
