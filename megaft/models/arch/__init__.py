"""One spec per architecture family megaft imports and exports (HF model_type -> ArchSpec).

Each module says what its family changes in the Llama block (as ModelConfig fields the
model code reads), the HF parameter names and the config.json fields read and written.
Mixtures of experts: mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v3 (megaft.models.moe; DeepSeek-V3's
latent attention: megaft.models.attention.mla). Everything else (GPT-2, DeepSeek-V2, multimodal Gemma 3, ...) is
refused by name.
"""
from megaft.models.arch import (
    deepseek_v3,
    gemma,
    gemma2,
    gemma3,
    llama,
    mistral,
    mixtral,
    olmoe,
    qwen2,
    qwen2_moe,
    qwen3,
    qwen3_moe,
)
from megaft.models.arch.spec import ArchSpec, HFConfigError

SPECS: dict[str, ArchSpec] = {m.SPEC.model_type: m.SPEC for m in (llama, qwen2, qwen3, mistral, gemma, gemma2, gemma3,
                                                                   mixtral, qwen2_moe, qwen3_moe, olmoe,
                                                                   deepseek_v3)}


def spec_for(model_type: object, file: str = "config.json") -> ArchSpec:
    """The spec of `model_type`, or an error naming the supported ones."""
    if model_type not in SPECS:
        raise HFConfigError(f"{file}: model_type {model_type!r} is not supported; megaft imports "
                            f"{', '.join(SPECS)} checkpoints")
    return SPECS[model_type]


__all__ = ["ArchSpec", "HFConfigError", "SPECS", "spec_for"]
