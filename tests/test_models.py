"""Our Llama-family models against transformers on the same tiny random checkpoints,
through the paged KV cache: prefill, chunked prefill, mixed batches, decode, PP stages."""

from __future__ import annotations

import pytest
import torch
import transformers

from messages import ModelConfig
from tests.tiny import PagedDriver, cached_tiny_checkpoint
from zmqworker.distributed.parallel_state import ParallelState, single_rank_state
from zmqworker.models.llama import pp_layer_range
from zmqworker.models.registry import build_model

CPU = torch.device("cpu")
FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]
TOL = 1e-3


def prompts(lens: tuple[int, ...] = (11, 19, 7), seed: int = 0) -> list[list[int]]:
    """Random token ids (from 3 up: 0-2 are special in the tiny configs) of those lengths."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in lens]


def hf_logits(path: str, tokens: list[int]) -> torch.Tensor:
    model = _hf_model(path)
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


_hf_cache: dict[str, torch.nn.Module] = {}


def _hf_model(path: str) -> torch.nn.Module:
    if path not in _hf_cache:
        _hf_cache[path] = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    return _hf_cache[path]


def ours(path: str, **kwargs) -> torch.nn.Module:
    return build_model(ModelConfig(path=path, **kwargs), single_rank_state(CPU))


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    diff = (actual - expected).abs().max().item()
    assert diff < TOL, f"max abs diff {diff}"


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_chunked_and_mixed_batch_match_transformers(family):
    path = cached_tiny_checkpoint(family=family, seed=FAMILIES.index(family))
    a, b, c = prompts()
    driver = PagedDriver(ours(path))
    # Step 1: a whole, first chunk of b. Step 2: second chunk of b, all of c, a decodes.
    # Step 3: last chunk of b with decodes of a and c.
    got = {"a": [], "b": [], "c": []}
    for schedule in (
        {"a": a, "b": b[:6]},
        {"b": b[6:13], "c": c, "a": [5]},
        {"c": [9], "a": [17], "b": b[13:]},
    ):
        for req, logits in driver.step(schedule).items():
            got[req].append(logits)
    for req, tokens in (("a", a + [5, 17]), ("b", b), ("c", c + [9])):
        assert_close(torch.cat(got[req]), hf_logits(path, tokens))


def test_single_request_prefill_then_greedy_decode_matches_generate():
    path = cached_tiny_checkpoint(family="llama", seed=7)
    prompt = prompts(lens=(9,))[0]
    driver = PagedDriver(ours(path), block_size=4)
    logits = driver.step({"r": prompt})["r"]
    tokens = []
    for _ in range(12):
        tokens.append(int(logits[-1].argmax()))
        logits = driver.step({"r": tokens[-1:]})["r"]
    with torch.no_grad():
        expected = _hf_model(path).generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0
        )[0, len(prompt) :]
    assert tokens == expected.tolist()


ROPE_SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    "yarn_mscale": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
    },
    "yarn_attention_factor": {
        "rope_type": "yarn",
        "factor": 2.0,
        "original_max_position_embeddings": 128,
        "attention_factor": 0.8,
        "beta_fast": 16,
        "beta_slow": 2,
        "truncate": False,
    },
}


# Rope settings config.json gives outside rope_parameters, as transformers' model reads
# them: a top-level original_max_position_embeddings outranks the one in rope_parameters
# for llama3 and yarn (transformers' "Phi3 exception"); transformers 4's rope_scaling.
ROPE_CONFIG_JSON = {
    "yarn_top_level_original": (ROPE_SCALINGS["yarn"], {"original_max_position_embeddings": 32}),
    "yarn_v4_rope_scaling_top_level_original": (
        None,
        {
            "rope_parameters": None,
            "rope_scaling": {"type": "yarn", "factor": 4.0},
            "rope_theta": 10000.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "llama3_top_level_original": (
        {**ROPE_SCALINGS["llama3"], "original_max_position_embeddings": 256},
        {"original_max_position_embeddings": 32},
    ),
}


@pytest.mark.parametrize("kind", sorted(ROPE_SCALINGS) + sorted(ROPE_CONFIG_JSON))
def test_rope_scaling_variants_match_transformers(kind):
    scaling, config_json = ROPE_CONFIG_JSON.get(kind, (ROPE_SCALINGS.get(kind), None))
    path = cached_tiny_checkpoint(
        family="llama", rope_scaling=scaling, config_json=config_json, num_layers=2
    )
    prompt = prompts(lens=(40,))[0]
    driver = PagedDriver(ours(path))
    logits = torch.cat([driver.step({"r": prompt[:25]})["r"], driver.step({"r": prompt[25:]})["r"]])
    assert_close(logits, hf_logits(path, prompt))


def test_dynamic_rope_beyond_max_position_embeddings_is_refused_naming_both():
    """transformers rescales dynamic rope for each length past max_position_embeddings
    (which keys cached at other lengths cannot follow); within it, it is the default."""
    dynamic = ROPE_SCALINGS["dynamic"]
    path = cached_tiny_checkpoint(
        family="llama", rope_scaling=dynamic, config_json=None, num_layers=2
    )
    with pytest.raises(ValueError, match=r"max_position_embeddings=512 .*max_model_len=1024"):
        ours(path, max_model_len=1024)
    assert ours(path, max_model_len=512).rotary.max_positions == 512


# Valid config values off the beaten path, each exact (max_model_len within any window).
UNUSUAL_CONFIGS = {
    "llama_eps_theta": dict(
        family="llama", rms_norm_eps=1e-2, rope_scaling={"rope_type": "default"}, rope_theta=500.0
    ),
    "llama_gelu_tanh": dict(family="llama", hidden_act="gelu_pytorch_tanh"),
    "mistral_head_dim": dict(family="mistral", head_dim=24, tie_word_embeddings=True),
    "mistral_window": dict(family="mistral", sliding_window=48),
    "qwen2_window_layers": dict(
        family="qwen2", use_sliding_window=True, sliding_window=48, max_window_layers=1
    ),
    "qwen3_bias_head_dim": dict(family="qwen3", attention_bias=True, head_dim=24),
}


@pytest.mark.parametrize("name", sorted(UNUSUAL_CONFIGS))
def test_unusual_config_values_match_transformers(name):
    path = cached_tiny_checkpoint(num_layers=2, **UNUSUAL_CONFIGS[name])
    prompt = prompts(lens=(40,))[0]
    driver = PagedDriver(ours(path, max_model_len=48))
    logits = torch.cat([driver.step({"r": prompt[:25]})["r"], driver.step({"r": prompt[25:]})["r"]])
    assert_close(logits, hf_logits(path, prompt))


REFUSED_CONFIGS = {
    "partial_rotary_factor 0.5": dict(rope_scaling={"partial_rotary_factor": 0.5}),
    "rope_type 'longrope'": dict(
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": [1.0] * 8,
            "long_factor": [2.0] * 8,
            "original_max_position_embeddings": 128,
        }
    ),
    "hidden_act 'relu'": dict(hidden_act="relu"),
    "window 16": dict(
        family="qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=0
    ),
}


@pytest.mark.parametrize("named", sorted(REFUSED_CONFIGS))
def test_unsupported_config_values_are_refused_by_name(named):
    path = cached_tiny_checkpoint(**{"family": "llama", "num_layers": 1, **REFUSED_CONFIGS[named]})
    with pytest.raises(ValueError, match=named):
        ours(path, max_model_len=32)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_tied_embeddings_share_the_embedding(family):
    path = cached_tiny_checkpoint(family=family, tie_word_embeddings=True, num_layers=2)
    model = ours(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    prompt = prompts(lens=(13,))[0]
    assert_close(PagedDriver(model).step({"r": prompt})["r"], hf_logits(path, prompt))


def test_llama_biases_and_head_dim_from_config():
    path = cached_tiny_checkpoint(
        family="llama", attention_bias=True, mlp_bias=True, head_dim=32, num_layers=2
    )
    model = ours(path)
    assert model.head_dim == 32 and model.model.layers["0"].self_attn.o_proj.bias is not None
    prompt = prompts(lens=(10,))[0]
    assert_close(PagedDriver(model).step({"r": prompt})["r"], hf_logits(path, prompt))


def stage_state(pp_rank: int, pp_size: int) -> ParallelState:
    return ParallelState(pp_rank, pp_size, 0, 1, pp_rank, pp_size, None, None, CPU)


@pytest.mark.parametrize("tied", [False, True])
def test_pipeline_stages_chained_equal_one_stage(tied):
    path = cached_tiny_checkpoint(family="qwen3", tie_word_embeddings=tied, num_layers=5)
    cfg = ModelConfig(path=path)
    stages = [build_model(cfg, stage_state(r, 3)) for r in range(3)]
    assert [(s.start_layer, s.end_layer) for s in stages] == [(0, 2), (2, 4), (4, 5)]
    assert stages[1].lm_head is None and stages[1].model.embed_tokens is None
    assert stages[2].layer_names == ["model.layers.4.self_attn"]
    a, b = prompts(lens=(9, 6))
    chained, single = PagedDriver(stages), PagedDriver(ours(path))
    for schedule in ({"a": a}, {"a": [4], "b": b}):
        got, expected = chained.step(schedule), single.step(schedule)
        for req in schedule:
            assert torch.equal(got[req], expected[req])
    with pytest.raises(RuntimeError, match="no LM head"):
        stages[0].compute_logits(torch.zeros(1, 64))


def test_pp_layer_split_is_even_with_earlier_stages_taking_the_rest():
    assert [pp_layer_range(30, r, 4) for r in range(4)] == [(0, 8), (8, 16), (16, 23), (23, 30)]
    with pytest.raises(ValueError, match="pipeline parallel size 5 exceeds the model's 4 layers"):
        pp_layer_range(4, 0, 5)


def tp_state(tp_rank: int, tp_size: int) -> ParallelState:
    # Building needs no process group: collectives only run in forward.
    return ParallelState(tp_rank, tp_size, tp_rank, tp_size, 0, 1, None, None, CPU)


def test_tp_layouts_that_cannot_split_are_rejected_naming_the_numbers():
    path = cached_tiny_checkpoint(family="llama", num_heads=4, num_kv_heads=2)
    with pytest.raises(ValueError, match="4 attention heads are not divisible by tensor paral"):
        build_model(ModelConfig(path=path), tp_state(0, 3))
    kv3 = cached_tiny_checkpoint(family="llama", num_heads=6, num_kv_heads=3, hidden_size=48)
    with pytest.raises(ValueError, match="3 key/value heads are not divisible by tensor paral"):
        build_model(ModelConfig(path=kv3), tp_state(0, 2))
    kv2 = cached_tiny_checkpoint(family="llama", num_heads=6, num_kv_heads=2, hidden_size=48)
    with pytest.raises(ValueError, match="tensor parallel size 3 is not a multiple of the 2"):
        build_model(ModelConfig(path=kv2), tp_state(0, 3))


def test_kv_heads_fewer_than_tp_ranks_are_replicated():
    path = cached_tiny_checkpoint(family="llama", num_heads=4, num_kv_heads=1)
    models = [build_model(ModelConfig(path=path), tp_state(r, 4)) for r in range(4)]
    assert {m.num_kv_heads for m in models} == {1}
    hf = _hf_model(path).model.layers[0].self_attn
    for m in models:
        qkv = m.model.layers["0"].self_attn.qkv_proj.weight
        assert torch.equal(qkv[-16:], hf.v_proj.weight)  # every rank holds the one kv head


def test_unsupported_architecture_names_it_and_the_supported_list(tmp_path):
    path = cached_tiny_checkpoint(family="llama", num_layers=1)
    cfg = transformers.AutoConfig.from_pretrained(path)
    cfg.architectures = ["GPT2LMHeadModel"]
    cfg.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*LlamaForCausalLM"):
        ours(str(tmp_path))


def test_architecture_and_model_type_that_disagree_are_refused(tmp_path):
    path = cached_tiny_checkpoint(family="qwen2", num_layers=1)
    cfg = transformers.AutoConfig.from_pretrained(path)
    cfg.architectures = ["LlamaForCausalLM"]  # transformers would still build a Qwen2
    cfg.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"LlamaForCausalLM is model_type 'llama', but the co"):
        ours(str(tmp_path))


def test_bfloat16_model_runs_close_to_float32():
    path = cached_tiny_checkpoint(family="qwen2", num_layers=2)
    prompt = prompts(lens=(12,))[0]
    model = ours(path, dtype="bfloat16")
    assert model.model.layers["0"].mlp.gate_up_proj.weight.dtype == torch.bfloat16
    logits = PagedDriver(model).step({"r": prompt})["r"]
    assert logits.dtype == torch.float32
    assert (logits - hf_logits(path, prompt)).abs().max().item() < 0.1
