"""ModelConfig: the decoder's architecture knobs (`model.*`).

The defaults are Llama's block; the fields after `mlp_bias` switch on what other
families change (megaft.models.arch holds one spec per family, mapping their HF
config.json onto these fields). The model code reads only these fields; their checks
need the families' specs and live with them (megaft.models.checks.check_model)."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Dict, List, Optional

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")  # transformers' rope_type values megaft computes
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # gate activations of the gated MLP (SwiGLU, GeGLU)
ROUTER_SCORING = ("softmax", "sigmoid")  # router scores: softmax over the experts, or each expert's sigmoid
QK_NORM_WIDTHS = ("head", "full")  # what model.qk_norm normalizes: each head, or all heads at once (OLMoE)
LAYER_TYPES = ("full_attention", "sliding_attention")  # HF `layer_types` values megaft runs
# Fields at their value in every family but DeepSeek-V3 (latent attention, its routing, ungated shared experts)
DEEPSEEK_ONLY = {"kv_lora_rank": 0, "router_scoring": "softmax", "n_group": 1, "topk_group": 1,
                 "routed_scaling_factor": 1.0, "shared_expert_gate": True, "rope_interleave": False}


class Recompute(StrEnum):  # activation checkpointing (megaft.models.recompute)
    none = "none"
    selective = "selective"
    full = "full"


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
    rope_scaling: Optional[Dict[str, Any]] = None  # HF rope parameters with rope_type (see ROPE_TYPES)
    max_seq_len: int = 2048  # longest sequence the rotary cache covers (HF max_position_embeddings on import)
    tie_embeddings: bool = False  # share the input embedding with the output head
    # a scalar head `score` [1, dim] read at each row's last real token instead of the LM head (HF
    # *ForSequenceClassification, num_labels=1); train.objective=reward sets it (validation.resolve)
    score_head: bool = False
    attention_bias: bool = False  # biases on q/k/v/o (HF attention_bias)
    mlp_bias: bool = False  # biases on gate/up/down (HF mlp_bias)
    arch: str = "llama"  # architecture family (HF model_type) export writes; see megaft.models.arch
    qkv_bias: bool = False  # biases on q/k/v only, none on o (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3)
    qk_norm_width: str = "head"  # what qk_norm normalizes: head (each head, Qwen3) | full (all heads at once, OLMoE)
    sliding_window: Optional[int] = None  # keys a query sees, itself included (Mistral); None = full causal
    layer_types: Optional[List[str]] = None  # per layer full_attention | sliding_attention; None = all sliding
    #   when sliding_window is set (HF layer_types, Qwen2's max_window_layers)
    activation: str = "silu"  # gate activation of the MLP: silu (SwiGLU) | gelu_pytorch_tanh (GeGLU, Gemma)
    norm_offset: float = 0.0  # RMSNorm scales by (norm_offset + w): Gemma stores w - 1 (offset 1)
    scale_embeddings: bool = False  # multiply input embeddings by sqrt(dim) (Gemma)
    sandwich_norms: bool = False  # also norm the attention and MLP outputs before their residual adds (Gemma 3)
    query_pre_attn_scalar: Optional[float] = None  # scores scaled by this ** -0.5, not head_dim ** -0.5 (Gemma 3)
    rope_local: Optional[Dict[str, Any]] = None  # RoPE of the sliding-window layers when theirs differs:
    #   {"rope_theta": ..., optional "rope_type" + parameters} (Gemma 3's local base frequency)
    attn_softcap: Optional[float] = None  # attention scores soft-capped: cap * tanh(s / cap) (Gemma 2)
    final_softcap: Optional[float] = None  # logits soft-capped the same way (Gemma 2)
    dropout: float = 0.0  # residual dropout; 0 for exact parallel equivalence
    # activation checkpointing: none | selective (attention core, MLP activation) | full
    recompute: Recompute = Recompute.none
    recompute_layers: Optional[int] = None  # recompute the first N blocks of each pipeline stage; None = all
    init_std: float = 0.02  # normal init std; output projections scaled by 1/sqrt(2*n_layers)
    init_from: Optional[str] = None  # Hugging Face checkpoint directory to load (overrides the shape fields)
    # config.json keys you know do not change the math, read as metadata instead of refused (not
    # quantization_config); the run's config.yaml and summary.json record them
    hf_ignore_keys: List[str] = field(default_factory=list)
    # parts of a vision-language model kept as loaded: vision (the tower) | projector; they get no
    # gradient and no optimizer state (docs/vision.md)
    freeze: List[str] = field(default_factory=list)
    # Mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE; megaft.models.moe); 0 experts = dense MLPs
    n_experts: int = 0  # routed experts of each MoE layer (HF num_local_experts / num_experts)
    top_k: int = 2  # experts each token goes to (HF num_experts_per_tok)
    moe_ffn_dim: Optional[int] = None  # each expert's inner size (HF moe_intermediate_size); None = ffn_dim
    norm_topk_prob: bool = True  # rescale the top-k routing weights to sum to 1 (HF norm_topk_prob)
    shared_expert_ffn_dim: int = 0  # inner size of a sigmoid-gated expert every token passes (Qwen2-MoE); 0 = none
    decoder_sparse_step: int = 1  # layer i is MoE when (i + 1) % step == 0 (HF decoder_sparse_step)
    mlp_only_layers: List[int] = field(default_factory=list)  # layers kept dense (HF mlp_only_layers)
    router_aux_loss_coef: float = 0.001  # weight of the load-balancing loss in the training loss
    router_z_loss_coef: float = 0.0  # weight of the router z-loss (ST-MoE: mean logsumexp(logits)^2); 0 = off
    # DeepSeek-V3 routing (megaft.models.moe.router.Router): sigmoid scores, a choice among the topk_group best of
    # n_group expert groups, a correction bias added for the choice only, weights scaled after normalizing
    router_scoring: str = "softmax"  # softmax (Mixtral, Qwen, OLMoE) | sigmoid (DeepSeek-V3, with a correction bias)
    n_group: int = 1  # expert groups (HF n_group); a token's experts come from its topk_group best groups
    topk_group: int = 1  # groups a token may use (HF topk_group)
    routed_scaling_factor: float = 1.0  # the routed experts' weights times this (HF routed_scaling_factor)
    shared_expert_gate: bool = True  # scale the shared expert by sigmoid(gate(x)) (Qwen2-MoE); false: DeepSeek
    # Multi-head latent attention (DeepSeek-V3, megaft.models.attention.mla); 0 = grouped-query attention. head_dim is
    # then the rotary part's width (qk_rope_head_dim, as transformers sets it)
    kv_lora_rank: int = 0  # width of the compressed key/value latent (HF kv_lora_rank)
    q_lora_rank: Optional[int] = None  # width of the query latent; None = one q_proj (HF q_lora_rank)
    qk_nope_head_dim: int = 0  # per-head query/key width without rotary embedding
    v_head_dim: int = 0  # per-head value width
    rope_interleave: bool = False  # the rotary dims come in interleaved pairs (HF rope_interleave)
    make_vocab_size_divisible_by: int = 1  # pad the vocabulary to a multiple of this * tp (Megatron uses 128)
    extra: Dict[str, Any] = field(default_factory=dict)  # HF config fields kept for export (bos/eos ids)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def hd(self) -> int:
        return self.head_dim or self.dim // self.n_heads

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V3) instead of grouped-query attention."""
        return self.kv_lora_rank > 0

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width: head_dim, or under MLA its unrotated plus rotary parts."""
        return self.qk_nope_head_dim + self.hd if self.mla else self.hd

    @property
    def v_dim(self) -> int:
        """Per-head value width."""
        return self.v_head_dim if self.mla else self.hd

    @property
    def expert_ffn(self) -> int:
        """Each routed expert's inner size."""
        return self.moe_ffn_dim or self.ffn_dim

    def is_moe(self, layer: int) -> bool:
        """Whether block `layer` has a mixture-of-experts MLP (Qwen2-MoE's rule, every family's)."""
        return (self.n_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    def window(self, layer: int) -> Optional[int]:
        """The attention window of block `layer` (None = full causal)."""
        if self.sliding_window is None:
            return None
        if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window


def padded_size(size: int, multiple: int) -> int:
    """`size` rounded up to a multiple of `multiple`: the vocabulary padded to make_vocab_size_divisible_by * tp,
    as the parallel embedding and head hold it (megaft.layers) and the performance model counts it."""
    return -(-size // multiple) * multiple


def kv_replicas(cfg: ModelConfig, tp: int) -> int:
    """Ranks holding a copy of each kv head: tp / n_kv_heads when tp is wider than the
    kv heads (each rank keeps the one kv head its query heads read), else 1."""
    return tp // cfg.kv_heads if tp > cfg.kv_heads else 1
