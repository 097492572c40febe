"""The checkpoint folder as the engine reads it: a folder the workers cannot run (quantized,
another architecture, a file instead of a folder) is refused by LLM with an error in the
user's words before any executor is made, and so before any worker process starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from messages import WorkerConfig
from tests.tiny import cached_tiny_checkpoint, make_fp8_checkpoint, make_gptq_checkpoint
from zmqworker.engine.model_folder import ModelFolder
from zmqworker.frontend.llm import LLM

SUPPORTED = r"supported: plain float32, bfloat16 or float16 safetensors weights"


class NoExecutor:
    """An executor factory that records being called: none of these runs may get one."""

    def __init__(self) -> None:
        self.configs: list[WorkerConfig] = []

    def __call__(self, config: WorkerConfig):
        self.configs.append(config)
        raise AssertionError("an executor was made for a folder that should be refused")


def refused(model: str, error: type[Exception], match: str) -> None:
    """LLM(model) raises error matching match, and no executor was ever made."""
    factory = NoExecutor()
    with pytest.raises(error, match=match):
        LLM(model, executor=factory)
    assert factory.configs == []


@pytest.fixture(scope="module")
def plain() -> str:
    return cached_tiny_checkpoint(family="llama", num_layers=2)


def test_a_plain_checkpoint_opens(plain):
    folder = ModelFolder.open(plain)
    assert folder.num_layers == 2 and folder.path == Path(plain).resolve()


def test_fp8_checkpoint_is_refused_naming_the_method(plain, tmp_path):
    path = make_fp8_checkpoint(plain, tmp_path / "fp8")
    refused(
        path, ValueError, rf"quantized \(fp8, in config.json's quantization_config\).*{SUPPORTED}"
    )


def test_fp8_tensors_without_a_quantization_config_are_refused(plain, tmp_path):
    path = make_fp8_checkpoint(plain, tmp_path / "fp8", with_config=False)
    refused(
        path,
        ValueError,
        rf"quantized \(tensor model.layers.0.mlp.down_proj.weight is float8_e4m3fn\).*{SUPPORTED}",
    )


def test_gptq_checkpoint_is_refused_naming_gptq(plain, tmp_path):
    path = make_gptq_checkpoint(plain, tmp_path / "gptq")
    refused(path, ValueError, rf"quantized \(gptq, in quantize_config.json\).*{SUPPORTED}")
    (Path(path) / "quantize_config.json").unlink()
    refused(path, ValueError, r"tensor model.layers.0.mlp.down_proj.qweight is int32")


@pytest.mark.parametrize(
    "section, method",
    [
        ({"quant_method": "awq", "bits": 4}, "awq"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes"),
        ({"quant_method": "compressed-tensors", "format": "float-quantized"}, "compressed-tensors"),
        ({"load_in_8bit": True}, "no quant_method given"),
    ],
)
def test_every_quantization_config_is_refused(plain, tmp_path, section, method):
    """The config alone refuses: its tensors here are plain."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    config = json.loads((Path(plain) / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": section}))
    refused(
        str(folder), ValueError, rf"quantized \({method}, in config.json's quantization_config\)"
    )


def test_autoawq_quant_config_beside_the_config_is_refused(plain, tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text((Path(plain) / "config.json").read_text())
    awq = {"zero_point": True, "q_group_size": 128, "w_bit": 4, "version": "GEMM"}
    (folder / "quant_config.json").write_text(json.dumps(awq))
    refused(str(folder), ValueError, r"quantized \(awq, in quant_config.json\)")


def test_gpt2_config_says_unsupported_architecture(tmp_path):
    gpt2 = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "n_layer": 12,
        "n_head": 12,
        "n_embd": 768,
        "n_positions": 1024,
        "vocab_size": 50257,
    }
    (tmp_path / "config.json").write_text(json.dumps(gpt2))
    refused(
        str(tmp_path),
        ValueError,
        r"unsupported architecture \['GPT2LMHeadModel'\] \(model_type 'gpt2'\); supported: "
        r"\['LlamaForCausalLM'",
    )


def test_an_architecture_of_another_model_type_is_refused(plain, tmp_path):
    # transformers would build a Llama (no q/k/v biases) from a Qwen2 checkpoint's tensors.
    config = json.loads((Path(plain) / "config.json").read_text())
    config["architectures"] = ["Qwen2ForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    refused(
        str(tmp_path),
        ValueError,
        r"architecture Qwen2ForCausalLM is model_type 'qwen2', but the config's model_type "
        r"is 'llama'",
    )


def test_a_file_instead_of_a_folder_says_so(plain, tmp_path):
    refused(
        f"{plain}/config.json",
        NotADirectoryError,
        rf"is a file, not a checkpoint folder: .*here perhaps '{plain}'",
    )
    gguf = tmp_path / "model.Q4_K_M.gguf"
    gguf.write_bytes(b"GGUF")
    refused(str(gguf), NotADirectoryError, r"is a GGUF file: GGUF is not loaded directly")
    refused(str(tmp_path / "nowhere"), FileNotFoundError, r"model folder .*nowhere' does not exist")


def test_end_of_sequence_ids_outside_the_vocabulary_are_ignored(plain, tmp_path, caplog):
    """A checkpoint naming an end-of-sequence id the model cannot sample (negative, past
    the vocabulary or past int32) keeps the others; each such id would make every
    request's message undecodable at the engine core."""
    folder = tmp_path / "odd_eos"
    folder.mkdir()
    for item in Path(plain).iterdir():
        (folder / item.name).symlink_to(item)
    config = json.loads((Path(plain) / "config.json").read_text())
    vocab = config["vocab_size"]
    (folder / "config.json").unlink()
    (folder / "config.json").write_text(json.dumps({**config, "eos_token_id": [2, -1, vocab]}))
    (folder / "generation_config.json").unlink(missing_ok=True)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 2**31]}))
    side = ModelFolder.open(str(folder)).load_text_side()
    assert side.eos_token_ids >= {2, 3}
    assert all(0 <= t < vocab for t in side.eos_token_ids)
    assert f"[-1, {vocab}, 2147483648] outside the vocabulary [0, {vocab})" in caplog.text


@pytest.mark.parametrize(
    ("model_type", "arch", "kv_heads", "head_dim"),
    [
        ("qwen3", "Qwen3ForCausalLM", 32, 128),
        ("mistral", "MistralForCausalLM", 8, 32),
        ("qwen2", "Qwen2ForCausalLM", 32, 32),
    ],
)
def test_head_counts_a_config_leaves_out_are_the_model_type_s(
    tmp_path, model_type, arch, kv_heads, head_dim
):
    """The engine sizes the cache and checks the layout by the head counts the workers
    build with: transformers' defaults for the model_type (not one kv head per head, nor
    hidden_size / heads for Qwen3's head_dim)."""
    config = {"architectures": [arch], "model_type": model_type, "hidden_size": 256,
              "num_attention_heads": 8, "num_hidden_layers": 2, "intermediate_size": 512,
              "vocab_size": 1000}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    folder = ModelFolder.open(str(tmp_path))
    assert (folder.num_kv_heads, folder.head_dim) == (kv_heads, head_dim)


def test_a_tokenizer_file_that_does_not_load_is_named(plain, tmp_path):
    """A tokenizer.json cut short was a traceback that named no file (the server's API
    server died with it once the engine had started)."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for item in Path(plain).iterdir():
        if not item.name.startswith("tokenizer"):  # never written through a link
            (folder / item.name).symlink_to(item)
    # What Python's json writes and transformers reads: taken.
    (folder / "tokenizer_config.json").write_text('{"model_max_length": NaN, "x": "\\ud83d"}')
    ModelFolder.open(str(folder))
    (folder / "tokenizer.json").write_text('{"version": "1.0", "added_tokens": [')
    refused(str(folder), ValueError, rf"cannot read {folder / 'tokenizer.json'}: .*truncated")
    (folder / "tokenizer.json").write_text('{"version": "1.0"}')  # JSON, but no tokenizer
    with pytest.raises(ValueError, match=rf"{folder}: its tokenizer does not load: "):
        ModelFolder.open(str(folder)).load_text_side()
