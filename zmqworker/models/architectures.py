"""The architectures the workers build, by the name config.json gives them: a table of
names, read by the engine before any worker starts and by the workers' model registry."""

from __future__ import annotations

from collections.abc import Sequence

# config.json "architectures" entry -> its model_type.
SUPPORTED: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}


def supported_architecture(architectures: Sequence[str] | None, model_type: str | None) -> str:
    """The first supported entry of architectures (a config without any: by model_type);
    an error naming what the config says and the supported list, or an architecture of
    another model_type than the config's: transformers builds the model of its model_type,
    so the two would be different models (Qwen2's q/k/v biases ignored as a Llama, say)."""
    for arch in architectures or []:
        if arch in SUPPORTED:
            if model_type is not None and SUPPORTED[arch] != model_type:
                raise ValueError(
                    f"architecture {arch} is model_type {SUPPORTED[arch]!r}, but the config's "
                    f"model_type is {model_type!r}: transformers would build a {model_type!r} "
                    "model; make the two agree"
                )
            return arch
    if not architectures:
        for arch, arch_model_type in SUPPORTED.items():
            if arch_model_type == model_type:
                return arch
    raise ValueError(
        f"unsupported architecture {list(architectures) if architectures else None} "
        f"(model_type {model_type!r}); supported: {sorted(SUPPORTED)}"
    )
