"""A mixture of experts takes weight updates under either layout of its experts: one
tensor per expert, as checkpoints are published, or stacked, as transformers holds them
(what an RL trainer's state_dict sends); never both at once for the same weights. A
folder that one expert-parallel rank cannot load is refused by every rank."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file

from messages import SamplingParams
from tests.test_models import prompts
from tests.tiny import moe_checkpoint
from tests.weight_trainer import perturb
from zmqworker.frontend.llm import LLM

NEW_TOKENS = 6
PARAMS = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
STACKED = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def _published(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same weights with every stacked expert tensor cut into one per expert."""
    out = {}
    for name, tensor in state.items():
        match = STACKED.match(name)
        if match is None:
            out[name] = tensor
            continue
        prefix, kind = match.groups()
        for e, expert in enumerate(tensor):
            if kind == "down_proj":
                out[f"{prefix}.{e}.down_proj.weight"] = expert
            else:
                gate, up = expert.chunk(2)
                out[f"{prefix}.{e}.gate_proj.weight"] = gate
                out[f"{prefix}.{e}.up_proj.weight"] = up
    return out


def _greedy(model: transformers.PreTrainedModel, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def moe():
    """An LLM over the Qwen3-MoE checkpoint at TP=2 with expert parallelism; a function
    of its greedy tokens; those before and after perturb(7); the perturbed weights,
    stacked as transformers holds them; the number of experts."""
    path = moe_checkpoint("qwen3_moe")
    prompt = prompts(lens=(11,))[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    old = _greedy(model, prompt)
    perturb(model, 7)
    new = _greedy(model, prompt)
    assert old != new
    stacked = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert any(STACKED.match(k) for k in stacked)
    with LLM(
        model=path,
        tensor_parallel_size=2,
        enable_expert_parallel=True,
        block_size=4,
        max_model_len=64,
        kv_cache_bytes=1 << 20,
    ) as llm:

        def tokens() -> list[int]:
            return llm.generate([prompt], PARAMS)[0].token_ids

        yield llm, tokens, old, new, stacked, model.config.num_experts


def test_expert_weights_update_under_either_layout_with_expert_parallelism(moe):
    llm, tokens, old, new, stacked, _ = moe
    published = _published(stacked)
    assert tokens() == old
    llm.update_weights(stacked.items())
    assert tokens() == new
    llm.reload_weights()
    assert tokens() == old
    llm.update_weights(published.items())
    assert tokens() == new
    llm.reload_weights()
    mixed = {**published, "model.layers.0.mlp.experts.down_proj": stacked[
        "model.layers.0.mlp.experts.down_proj"
    ]}  # fmt: skip
    with pytest.raises(ValueError, match="two layouts of the same weights"):
        llm.update_weights(mixed.items())
    assert tokens() == old
    # After sleep(level=2) an update must give every weight, in either layout.
    llm.sleep(2)
    llm.wake_up()
    partial = {k: v for k, v in stacked.items() if k != "model.layers.1.mlp.experts.down_proj"}
    lacks = r"lacks 4: model\.layers\.1\.mlp\.experts\.\d\.down_proj\.weight"
    with pytest.raises(ValueError, match=lacks):
        llm.update_weights(partial.items())
    llm.update_weights(stacked.items())
    assert tokens() == new
    llm.reload_weights()


def test_a_folder_one_expert_rank_cannot_load_is_refused_by_every_rank(moe, tmp_path):
    """Each rank checked only its own experts: the rank of the first half loaded its
    new experts from a folder that lacked one of the second half's, and the model served
    was neither. Every rank now checks every expert, and refuses."""
    llm, tokens, old, _, stacked, num_experts = moe
    assert tokens() == old
    last = f"model.layers.1.mlp.experts.{num_experts - 1}.down_proj.weight"  # rank 1's
    published = _published(stacked)
    edits = {
        rf"lacks tensor\(s\): {re.escape(last)}": {k: v for k, v in published.items() if k != last},
        rf"{re.escape(last)} in checkpoint .* has shape": {
            **published, last: published[last][:, :-1].contiguous()
        },
    }  # fmt: skip
    source = Path(moe_checkpoint("qwen3_moe"))
    for k, (reason, tensors) in enumerate(edits.items()):
        folder = tmp_path / str(k)
        folder.mkdir()
        shutil.copy(source / "config.json", folder / "config.json")
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(ValueError, match=reason):
            llm.reload_weights(str(folder))
        assert llm.not_ready() is None
        assert tokens() == old, reason
