"""ModelConfig: the Llama architecture knobs (`model.*`) and their validation."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional


@dataclass
class ModelConfig:
    name: str = "tiny"  # preset name, informational
    dim: int = 128  # hidden size (HF hidden_size)
    n_layers: int = 4  # decoder blocks (HF num_hidden_layers)
    n_heads: int = 4  # query heads (HF num_attention_heads)
    n_kv_heads: Optional[int] = None  # key/value heads for GQA; None = n_heads
    head_dim: Optional[int] = None  # None = dim // n_heads
    ffn_dim: int = 384  # SwiGLU inner size (HF intermediate_size)
    vocab_size: int = 0  # 0 = the tokenizer's vocabulary size
    norm_eps: float = 1e-5  # RMSNorm epsilon (HF rms_norm_eps)
    rope_theta: float = 10000.0  # rotary base
    rope_scaling: Optional[Dict[str, Any]] = None  # HF rope_scaling (rope_type "llama3" supported)
    max_seq_len: int = 2048  # longest sequence the rotary cache covers
    tie_embeddings: bool = False  # share the input embedding with the output head
    attention_bias: bool = False  # biases on q/k/v/o (HF attention_bias)
    mlp_bias: bool = False  # biases on gate/up/down (HF mlp_bias)
    dropout: float = 0.0  # residual dropout; 0 for exact parallel equivalence
    init_std: float = 0.02  # normal init std; output projections scaled by 1/sqrt(2*n_layers)
    init_from: Optional[str] = None  # Hugging Face Llama directory to load (overrides the shape fields)
    make_vocab_size_divisible_by: int = 1  # pad the vocabulary to a multiple of this * tp (Megatron uses 128)
    extra: Dict[str, Any] = field(default_factory=dict)  # HF config fields kept for export (bos/eos ids)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def hd(self) -> int:
        return self.head_dim or self.dim // self.n_heads


def check_model(cfg: ModelConfig, tp: int) -> list[str]:
    """Every problem of the architecture against the tensor-parallel degree, with its fix."""
    errors = []
    for name in ("dim", "n_layers", "n_heads", "ffn_dim", "max_seq_len"):
        if getattr(cfg, name) < 1:
            errors.append(f"model.{name}={getattr(cfg, name)} must be >= 1")
    if errors:
        return errors
    if cfg.n_heads % cfg.kv_heads:
        errors.append(f"model.n_heads={cfg.n_heads} is not a multiple of model.n_kv_heads={cfg.kv_heads}; "
                      "fix: choose n_kv_heads dividing n_heads")
    if cfg.head_dim is None and cfg.dim % cfg.n_heads:
        errors.append(f"model.dim={cfg.dim} is not divisible by model.n_heads={cfg.n_heads}; fix: set model.head_dim")
    if cfg.hd % 2:
        errors.append(f"head dim {cfg.hd} must be even for rotary embeddings; fix: change model.dim/n_heads/head_dim")
    if tp > 0:
        for name, value in (("n_heads", cfg.n_heads), ("n_kv_heads", cfg.kv_heads), ("ffn_dim", cfg.ffn_dim)):
            if value % tp:
                errors.append(f"parallel.tp={tp} does not divide model.{name}={value}; "
                              f"fix: pick tp among the divisors of {value}")
    if not 0.0 <= cfg.dropout < 1.0:
        errors.append(f"model.dropout={cfg.dropout} must be in [0, 1)")
    if cfg.rope_scaling and cfg.rope_scaling.get("rope_type", cfg.rope_scaling.get("type")) not in ("llama3", "default"):
        errors.append(f"model.rope_scaling={dict(cfg.rope_scaling)} is not supported; fix: use rope_type llama3 or none")
    return errors
