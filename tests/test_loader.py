"""Weight loading: sharded == unsharded, clear errors, each rank reads only its tensors."""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from messages import ModelConfig
from tests.tiny import (
    cached_tiny_checkpoint,
    make_fp8_checkpoint,
    make_gptq_checkpoint,
    make_tiny_checkpoint,
    moe_checkpoint,
)
from zmqworker.distributed.parallel_state import ParallelState, single_rank_state
from zmqworker.engine.model_folder import ModelFolder
from zmqworker.models.loader import CheckpointError, load_checkpoint
from zmqworker.models.registry import build_model
from zmqworker.models.weight_names import config_differences
from zmqworker.worker.weight_transfer.engine import WeightTransferEngine

CPU = torch.device("cpu")


def state(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1) -> ParallelState:
    rank = pp_rank * tp_size + tp_rank
    return ParallelState(
        rank, tp_size * pp_size, tp_rank, tp_size, pp_rank, pp_size, None, None, CPU
    )


def copy_with(tmp_path, edit, src: str | None = None) -> str:
    """A copy of the checkpoint src (the tiny llama one) whose tensors went through
    edit(dict)."""
    src = src or cached_tiny_checkpoint(family="llama", num_layers=2)
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return str(dst)


def test_sharded_checkpoint_loads_identically_to_unsharded(tmp_path):
    whole = make_tiny_checkpoint(tmp_path / "whole", seed=3)
    sharded = make_tiny_checkpoint(tmp_path / "sharded", seed=3, shard_max_bytes=60_000)
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    a = build_model(ModelConfig(path=whole), single_rank_state(CPU)).state_dict()
    b = build_model(ModelConfig(path=sharded), single_rank_state(CPU)).state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_fused_parameters_hold_the_checkpoint_tensors():
    path = cached_tiny_checkpoint(family="qwen2", num_layers=2)
    model = build_model(ModelConfig(path=path), single_rank_state(CPU))
    ckpt = load_file(f"{path}/model.safetensors")
    attn = model.model.layers["1"].self_attn
    q, k, v = (ckpt[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv")
    assert torch.equal(attn.qkv_proj.weight, torch.cat([q, k, v]))
    qb, kb, vb = (ckpt[f"model.layers.1.self_attn.{n}_proj.bias"] for n in "qkv")
    assert torch.equal(attn.qkv_proj.bias, torch.cat([qb, kb, vb]))
    mlp = model.model.layers["1"].mlp
    gate_up = [ckpt[f"model.layers.1.mlp.{n}_proj.weight"] for n in ("gate", "up")]
    assert torch.equal(mlp.gate_up_proj.weight, torch.cat(gate_up))


def test_missing_tensor_is_named_with_the_folder(tmp_path):
    path = copy_with(tmp_path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"ckpt lacks tensor\(s\): model.layers.1.mlp.up_pro"):
        build_model(ModelConfig(path=path), single_rank_state(CPU))


def test_wrong_shape_is_named_with_the_folder(tmp_path):
    def shrink(tensors):
        tensors["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(64, 32)

    path = copy_with(tmp_path, shrink)
    with pytest.raises(CheckpointError, match=r"o_proj.weight in checkpoint .*ckpt has shape"):
        build_model(ModelConfig(path=path), single_rank_state(CPU))


def test_missing_folder_and_missing_weights_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        build_model(ModelConfig(path=str(tmp_path / "nowhere")), single_rank_state(CPU))
    shutil.copy(cached_tiny_checkpoint(family="llama", num_layers=2) + "/config.json", tmp_path)
    with pytest.raises(FileNotFoundError, match="no safetensors weights"):
        build_model(ModelConfig(path=str(tmp_path)), single_rank_state(CPU))


def test_pipeline_stage_reads_only_its_layers_and_files(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "c", num_layers=4, shard_max_bytes=60_000)
    last = build_model(ModelConfig(path=path), state(pp_rank=1, pp_size=2))
    report = load_checkpoint(last, path)
    layers = {int(n.split(".")[2]) for n in report.tensors if n.startswith("model.layers.")}
    assert layers == {2, 3}
    assert {n for n in report.tensors if not n.startswith("model.layers.")} == {
        "model.norm.weight",
        "lm_head.weight",
    }
    first = build_model(ModelConfig(path=path), state(pp_rank=0, pp_size=2))
    first_files = load_checkpoint(first, path).files
    # The shards are small, so each stage's tensors live in different files.
    assert report.files and first_files and report.files != first_files


def test_tied_last_stage_loads_the_embedding_for_its_lm_head():
    path = cached_tiny_checkpoint(family="qwen3", tie_word_embeddings=True, num_layers=2)
    last = build_model(ModelConfig(path=path), state(pp_rank=1, pp_size=2))
    assert last.model.embed_tokens is None
    ckpt = load_file(f"{path}/model.safetensors")
    assert torch.equal(last.lm_head.weight, ckpt["model.embed_tokens.weight"])
    assert "model.embed_tokens.weight" in load_checkpoint(last, path).tensors


@pytest.mark.parametrize("stage", [state(), state(pp_rank=1, pp_size=2)])
def test_tied_checkpoint_holding_another_lm_head_is_refused(tmp_path, stage):
    # transformers unties the two when both are there and differ: tying would be wrong.
    src = cached_tiny_checkpoint(family="qwen3", tie_word_embeddings=True, num_layers=2)
    shutil.copytree(src, tmp_path / "ckpt")
    file = tmp_path / "ckpt" / "model.safetensors"
    tensors = load_file(file)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].bfloat16()
    save_file(tensors, file, metadata={"format": "pt"})
    model = build_model(ModelConfig(path=str(tmp_path / "ckpt"), dtype="bfloat16"), stage)
    assert torch.equal(model.lm_head.weight, tensors["lm_head.weight"])  # the same: tied
    tensors["lm_head.weight"] = tensors["lm_head.weight"].float() + 1
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="holds a lm_head.weight that differs from it"):
        build_model(ModelConfig(path=str(tmp_path / "ckpt")), stage)


def test_tp_ranks_read_their_slices_and_pad_the_vocab():
    path = cached_tiny_checkpoint(family="llama", num_layers=1, vocab_size=250)
    ckpt = load_file(f"{path}/model.safetensors")
    ranks = [build_model(ModelConfig(path=path), state(tp_rank=r, tp_size=2)) for r in range(2)]
    attn = [m.model.layers["0"].self_attn for m in ranks]
    q = ckpt["model.layers.0.self_attn.q_proj.weight"]  # 4 heads of 16: rank r holds 2 heads
    assert torch.equal(attn[1].qkv_proj.weight[:32], q[32:])
    o = ckpt["model.layers.0.self_attn.o_proj.weight"]
    assert torch.equal(torch.cat([a.o_proj.weight for a in attn], dim=1), o)
    heads = [m.lm_head.weight for m in ranks]  # 125 rows each
    assert torch.equal(torch.cat(heads), ckpt["lm_head.weight"])
    odd = cached_tiny_checkpoint(family="llama", num_layers=1, vocab_size=251)
    padded = build_model(ModelConfig(path=odd), state(tp_rank=1, tp_size=2)).lm_head.weight
    assert padded.shape == (126, 64) and not padded[-1].any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_checkpoint_and_model(tmp_path, dtype):
    name = str(dtype).removeprefix("torch.")
    path = make_tiny_checkpoint(tmp_path / name, num_layers=1, dtype=dtype)
    ckpt = load_file(f"{path}/model.safetensors")
    as_fp32 = build_model(ModelConfig(path=path), single_rank_state(CPU))
    as_half = build_model(ModelConfig(path=path, dtype=name), single_rank_state(CPU))
    w = ckpt["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(as_half.model.layers["0"].mlp.down_proj.weight, w)
    assert torch.equal(as_fp32.model.layers["0"].mlp.down_proj.weight, w.float())
    assert as_half.rotary.cos_sin.dtype == dtype


def test_float8_weights_are_refused_by_the_loader_itself(tmp_path):
    """A worker driven by an engine that skipped the engine's check never casts them."""
    plain = cached_tiny_checkpoint(family="llama", num_layers=2)
    fp8 = make_fp8_checkpoint(plain, tmp_path / "fp8", with_config=False)
    model = build_model(ModelConfig(path=plain, load_format="dummy"), single_rank_state(CPU))
    before = {name: p.clone() for name, p in model.state_dict().items()}
    with pytest.raises(
        CheckpointError, match=r"tensor model.layers.0.mlp.down_proj.weight is float8_e4m3fn"
    ):
        load_checkpoint(model, fp8)
    after = model.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)


def test_gptq_tensors_are_refused_by_the_loader_as_quantized(tmp_path):
    plain = cached_tiny_checkpoint(family="llama", num_layers=2)
    gptq = make_gptq_checkpoint(plain, tmp_path / "gptq", with_config=False)
    with pytest.raises(CheckpointError, match=r"quantized \(tensor .*down_proj.qweight is int32"):
        build_model(ModelConfig(path=gptq), single_rank_state(CPU))


def test_a_non_float_tensor_is_never_cast_into_a_parameter(tmp_path):
    """An integer tensor the header check lets by (a bias is no quantized weight) is still
    refused where it would be cast."""
    path = tmp_path / "ckpt"
    shutil.copytree(cached_tiny_checkpoint(family="qwen2", num_layers=2), path)
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.1.self_attn.q_proj.bias"
    tensors[name] = (tensors[name] * 100).to(torch.int32)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"tensor {name} in checkpoint .* is int32"):
        build_model(ModelConfig(path=str(path)), single_rank_state(CPU))


def test_float32_bfloat16_and_float16_tensors_load_in_any_mix(tmp_path):
    dtypes = [torch.bfloat16, torch.float16, torch.float32]

    def mix(tensors):
        for i, name in enumerate(sorted(tensors)):
            tensors[name] = tensors[name].to(dtypes[i % 3])

    path = copy_with(tmp_path, mix)
    mixed = load_file(f"{path}/model.safetensors")
    model = build_model(ModelConfig(path=path), single_rank_state(CPU))
    down = model.model.layers["1"].mlp.down_proj.weight
    assert torch.equal(down, mixed["model.layers.1.mlp.down_proj.weight"].float())
    assert {t.dtype for t in mixed.values()} == set(dtypes)


def test_an_index_beside_model_safetensors_is_refused_naming_both(tmp_path):
    """transformers loads model.safetensors, vLLM the index's files: neither is ours to
    pick, for the workers' loader and the engine's folder check alike."""
    path = make_tiny_checkpoint(tmp_path / "c", num_layers=2, shard_max_bytes=60_000)
    shutil.copy(cached_tiny_checkpoint(family="llama", num_layers=2) + "/model.safetensors", path)
    both = r"holds both model.safetensors and model.safetensors.index.json"
    with pytest.raises(CheckpointError, match=both):
        build_model(ModelConfig(path=path), single_rank_state(CPU))
    with pytest.raises(CheckpointError, match=both):
        ModelFolder.open(path)


def test_a_tensor_in_two_files_is_refused_naming_it_and_both_files(tmp_path):
    """A stray file beside a checkpoint without an index used to override its weights."""
    path = make_tiny_checkpoint(tmp_path / "c", num_layers=2)
    (tmp_path / "c" / "model.safetensors").rename(tmp_path / "c" / "model-1.safetensors")
    save_file({"model.norm.weight": torch.full((64,), 3.0)}, tmp_path / "c" / "z.safetensors")
    with pytest.raises(
        CheckpointError, match=r"tensor model.norm.weight twice, in model-1.safetensors and in z"
    ):
        build_model(ModelConfig(path=path), single_rank_state(CPU))


def _add_shared_expert(tensors):
    for proj, shape in (("gate", (48, 80)), ("up", (48, 80)), ("down", (80, 48))):
        tensors[f"model.layers.0.mlp.shared_expert.{proj}_proj.weight"] = torch.zeros(shape)
    tensors["model.layers.0.mlp.shared_expert_gate.weight"] = torch.zeros(1, 80)


def _add_stacked_experts(tensors):
    tensors["model.layers.1.mlp.experts.gate_up_proj"] = torch.zeros(8, 112, 80)
    tensors["model.layers.1.mlp.experts.down_proj"] = torch.zeros(8, 80, 56)


LLAMA = {"model_type": "llama"}
# Tensors no weight of the model takes, which carry maths: transformers drops them.
FOREIGN = {
    "biases, attention_bias false": (
        dict(family="llama", attention_bias=True, config_json={"attention_bias": False}),
        None,
        r"model.layers.0.self_attn.q_proj.bias present but attention_bias is false",
    ),
    "Qwen3 q/k norms as a Llama": (
        dict(family="qwen3", config_json={"architectures": ["LlamaForCausalLM"], **LLAMA}),
        None,
        r"'llama' model takes: model.layers.0.self_attn.k_norm.weight; .*q_norm",
    ),
    "Qwen2-MoE's shared expert": (
        "qwen3_moe",
        _add_shared_expert,
        r"takes: model.layers.0.mlp.shared_expert.down_proj.weight; .*shared_expert_gate",
    ),
    "both expert layouts": (
        "qwen3_moe",
        _add_stacked_experts,
        r"holds model.layers.1.mlp.experts.0.gate_proj.weight and "
        r"model.layers.1.mlp.experts.gate_up_proj: two layouts of the same weights",
    ),
}


@pytest.mark.parametrize("case", FOREIGN)
@pytest.mark.parametrize("stage", [state(), state(pp_rank=1, pp_size=2)])
def test_tensors_no_weight_takes_are_refused_by_name(tmp_path, case, stage):
    """By the whole model's names: a pipeline stage refuses another stage's too."""
    source, edit, named = FOREIGN[case]
    if isinstance(source, str):
        path = copy_with(tmp_path, edit, moe_checkpoint(source))
    else:
        path = cached_tiny_checkpoint(num_layers=2, **source)
    with pytest.raises(CheckpointError, match=named):
        build_model(ModelConfig(path=path), stage)


def test_a_layer_past_num_hidden_layers_names_the_field():
    path = cached_tiny_checkpoint(
        family="llama", num_layers=2, config_json={"num_hidden_layers": 1}
    )
    with pytest.raises(
        CheckpointError, match=r"model.layers.1.input_layernorm.weight present but num_hidden_l"
    ):
        build_model(ModelConfig(path=path), single_rank_state(CPU))


def test_inv_freq_buffers_and_kv_cache_scales_are_left_aside(tmp_path):
    def add(tensors):
        for i in range(2):
            attn = f"model.layers.{i}.self_attn"
            tensors[f"{attn}.rotary_emb.inv_freq"] = torch.ones(8)
            for scale in ("k_scale", "v_scale"):
                tensors[f"{attn}.{scale}"] = torch.tensor(0.5)

    path = copy_with(tmp_path, add)
    model = build_model(ModelConfig(path=path), single_rank_state(CPU))
    plain = build_model(
        ModelConfig(path=cached_tiny_checkpoint(family="llama", num_layers=2)),
        single_rank_state(CPU),
    )
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters(), strict=True)
    )


FP8_CONFIG = {"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"}}


def test_a_quantization_config_is_refused_by_the_loader_itself(tmp_path):
    """Float tensors, but config.json (or a side file) says quantized: the engine refused
    it only where it opened the folder; build_model and a load from a path refuse it too."""
    path = cached_tiny_checkpoint(family="llama", num_layers=2, config_json=FP8_CONFIG)
    with pytest.raises(CheckpointError, match=r"quantized \(fp8, in config.json's quantization_c"):
        build_model(ModelConfig(path=path), single_rank_state(CPU))
    plain = cached_tiny_checkpoint(family="llama", num_layers=2)
    side = shutil.copytree(plain, tmp_path / "side")
    (side / "quantize_config.json").write_text('{"bits": 4, "group_size": 128}')
    model = build_model(ModelConfig(path=plain), single_rank_state(CPU))
    with pytest.raises(CheckpointError, match=r"quantized \(gptq, in quantize_config.json\)"):
        load_checkpoint(model, str(side))


def test_a_reload_from_a_quantized_folder_is_refused_and_changes_nothing():
    plain = cached_tiny_checkpoint(family="llama", num_layers=2)
    quantized = cached_tiny_checkpoint(family="llama", num_layers=2, seed=4, config_json=FP8_CONFIG)
    model = build_model(ModelConfig(path=plain), single_rank_state(CPU))
    before = {name: p.clone() for name, p in model.state_dict().items()}
    engine = WeightTransferEngine(model, ModelConfig(path=plain))
    with pytest.raises(
        CheckpointError, match=r"quantization_config: None vs \{'quant_method': 'fp8'"
    ):
        engine.reload(quantized)
    with pytest.raises(CheckpointError, match=r"quantized \(fp8"):  # the loader's own check
        load_checkpoint(model, quantized)
    after = model.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)


def test_a_top_level_original_length_is_a_difference():
    """transformers' model takes it before rope_parameters' (for yarn and llama3)."""

    def config(**more):
        yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
        return transformers.LlamaConfig(
            num_hidden_layers=2, hidden_size=64, num_attention_heads=4, rope_parameters=yarn, **more
        )

    assert config_differences(config(), config()) == []
    diffs = config_differences(config(), config(original_max_position_embeddings=32))
    assert any("'original_max_position_embeddings': 32" in diff for diff in diffs), diffs


@pytest.mark.parametrize(
    "family, change, named",
    [
        ("LlamaConfig", {"rope_theta": 500.0}, "rope_parameters"),
        ("LlamaConfig", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_param"),
        ("LlamaConfig", {"rms_norm_eps": 1e-2}, "rms_norm_eps: 1e-06 vs 0.01"),
        ("MistralConfig", {"sliding_window": 16}, "sliding_window: None vs 16"),
        ("Qwen3MoeConfig", {"norm_topk_prob": True}, "norm_topk_prob: False vs True"),
        ("Qwen3MoeConfig", {"num_experts_per_tok": 3}, "num_experts_per_tok: 2 vs 3"),
        ("LlamaConfig", {"quantization_config": {"quant_method": "fp8"}}, "quantization_conf"),
    ],
)
def test_another_checkpoint_s_forward_settings_are_named(family, change, named):
    # A reload from another folder keeps the model built for this config: any value the
    # forward reads must agree, or the new weights would run under the old settings.
    base = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, rms_norm_eps=1e-6)
    if family == "MistralConfig":
        base["sliding_window"] = None
    if family == "Qwen3MoeConfig":
        base.update(num_experts=4, num_experts_per_tok=2)
    config_cls = getattr(transformers, family)
    ours, theirs = config_cls(**base), config_cls(**{**base, **change})
    assert config_differences(ours, config_cls(**base)) == []
    assert any(named in diff for diff in config_differences(ours, theirs))
