"""DeepSeek-V3 / R1 (DeepseekV3ForCausalLM): multi-head latent attention (megaft.models.attention.mla) and a
mixture of n_routed_experts experts of moe_intermediate_size on every layer from
first_k_dense_replace on (the first ones: a dense MLP of intermediate_size), plus
n_shared_experts shared experts (one MLP of n_shared_experts × moe_intermediate_size, no gate);
the router scores with sigmoids, chooses within the topk_group best of n_group groups with a
correction bias (`mlp.gate.e_score_correction_bias`, a buffer), renormalizes with norm_topk_prob
and scales by routed_scaling_factor. transformers adds no load-balancing loss for this family:
megaft's router_aux_loss_coef is 0.

The published checkpoints carry num_nextn_predict_layers multi-token-prediction layers as
`model.layers.{num_hidden_layers + i}.*`: megaft trains next-token prediction only, so the
import skips them (megaft.models.hf.load) and the export writes num_nextn_predict_layers 0.
Their FP8 release (quantization_config quant_method fp8) is read for planning, and refused
for training and weight loading (dequantize to bf16 first)."""
from megaft.models.arch.spec import NO_GEMMA23, ArchSpec, HFConfigError, ModelConfig, get, refuse_unless

# Fields the remote-code config.json of the releases writes beside transformers' (DeepSeek-R1's),
# accepted at the values transformers' class computes: its only routing method and scoring.
FIXED = {"scoring_func": ("sigmoid", None), "topk_method": ("noaux_tc", None), "moe_layer_freq": (1, None),
         "attention_bias": (False, None)}
FIELDS = tuple(FIXED) + (
    "n_routed_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
    "routed_scaling_factor", "n_group", "topk_group", "norm_topk_prob", "first_k_dense_replace", "kv_lora_rank",
    "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "qk_head_dim", "rope_interleave",
    "num_nextn_predict_layers", "num_mtp_layers", "output_router_logits",
    "ep_size",  # the remote code's inference expert parallelism: no effect on the math
    "auto_map",  # the remote code's class names: metadata
)


def _read(raw: dict, file: str) -> dict:
    for key, ok in FIXED.items():
        if raw.get(key) not in ok:
            raise HFConfigError(f"{file}: {key}={raw[key]!r} is not supported (transformers' DeepseekV3ForCausalLM, "
                                f"which megaft follows, computes {key}={ok[0]!r}); fix: a DeepSeek-V3 checkpoint "
                                f"with it, or model.hf_ignore_keys=[{key}] if it has no effect")
    heads, rope = raw["num_attention_heads"], int(get(raw, SPEC, "qk_rope_head_dim"))
    if raw.get("num_key_value_heads", heads) != heads:
        raise HFConfigError(f"{file}: num_key_value_heads={raw['num_key_value_heads']} differs from "
                            f"num_attention_heads={heads}; multi-head latent attention gives every head its keys")
    nope = int(get(raw, SPEC, "qk_nope_head_dim"))
    for key, want in (("head_dim", rope), ("qk_head_dim", nope + rope)):
        if raw.get(key) not in (None, want):
            raise HFConfigError(f"{file}: {key}={raw[key]} differs from {want}, what transformers derives from "
                                "qk_nope_head_dim and qk_rope_head_dim")
    moe_ffn, shared = int(get(raw, SPEC, "moe_intermediate_size")), int(get(raw, SPEC, "n_shared_experts") or 0)
    experts = raw.get("n_routed_experts", raw.get("num_local_experts", SPEC.defaults["n_routed_experts"]))
    first_dense = int(get(raw, SPEC, "first_k_dense_replace"))
    mtp = raw.get("num_nextn_predict_layers", raw.get("num_mtp_layers", SPEC.defaults["num_nextn_predict_layers"]))
    return dict(
        head_dim=rope, n_kv_heads=heads, kv_lora_rank=int(get(raw, SPEC, "kv_lora_rank")),
        q_lora_rank=raw["q_lora_rank"] if "q_lora_rank" in raw else SPEC.defaults["q_lora_rank"],
        qk_nope_head_dim=nope, v_head_dim=int(get(raw, SPEC, "v_head_dim")),
        rope_interleave=bool(get(raw, SPEC, "rope_interleave")), attention_bias=False, sliding_window=None,
        layer_types=None, n_experts=int(experts), top_k=int(get(raw, SPEC, "num_experts_per_tok")),
        moe_ffn_dim=moe_ffn, shared_expert_ffn_dim=shared * moe_ffn, shared_expert_gate=False,
        norm_topk_prob=bool(get(raw, SPEC, "norm_topk_prob")), router_scoring="sigmoid",
        n_group=int(get(raw, SPEC, "n_group")), topk_group=int(get(raw, SPEC, "topk_group")),
        routed_scaling_factor=float(get(raw, SPEC, "routed_scaling_factor")),
        decoder_sparse_step=1, mlp_only_layers=list(range(min(first_dense, raw["num_hidden_layers"]))),
        router_aux_loss_coef=0.0, router_z_loss_coef=0.0,  # transformers trains DeepSeek-V3 without either
        extra={"num_nextn_predict_layers": int(mtp or 0)},
    )


def _write(cfg: ModelConfig) -> dict:
    return {"n_routed_experts": cfg.n_experts, "num_experts_per_tok": cfg.top_k, "moe_intermediate_size":
            cfg.expert_ffn, "n_shared_experts": cfg.shared_expert_ffn_dim // cfg.expert_ffn,
            "routed_scaling_factor": cfg.routed_scaling_factor, "n_group": cfg.n_group, "topk_group": cfg.topk_group,
            "norm_topk_prob": cfg.norm_topk_prob, "first_k_dense_replace": len(cfg.mlp_only_layers),
            "kv_lora_rank": cfg.kv_lora_rank, "q_lora_rank": cfg.q_lora_rank, "qk_nope_head_dim":
            cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.hd, "v_head_dim": cfg.v_head_dim,
            "rope_interleave": cfg.rope_interleave, "attention_bias": False, "output_router_logits": False,
            "num_nextn_predict_layers": 0}  # the multi-token-prediction layers were not imported


def _refuse(cfg: ModelConfig) -> list[str]:
    problems = refuse_unless(cfg, SPEC, **NO_GEMMA23, attention_bias=False, qkv_bias=False, mlp_bias=False,
                             qk_norm=False, activation="silu", norm_offset=0.0, scale_embeddings=False,
                             layer_types=None, sliding_window=None, router_scoring="sigmoid", shared_expert_gate=False,
                             decoder_sparse_step=1)
    if not cfg.mla:
        problems.append(f"model.kv_lora_rank=0 cannot be exported as deepseek_v3 ({SPEC.architecture} has "
                        "multi-head latent attention)")
    if cfg.mlp_only_layers != list(range(len(cfg.mlp_only_layers))):
        problems.append(f"model.mlp_only_layers={cfg.mlp_only_layers} cannot be exported as deepseek_v3 (its dense "
                        "layers are the first first_k_dense_replace)")
    if cfg.n_experts and cfg.shared_expert_ffn_dim % cfg.expert_ffn:
        problems.append(f"model.shared_expert_ffn_dim={cfg.shared_expert_ffn_dim} cannot be exported as deepseek_v3 "
                        f"(n_shared_experts whole experts of {cfg.expert_ffn})")
    return problems


SPEC = ArchSpec(
    model_type="deepseek_v3", architecture="DeepseekV3ForCausalLM",
    differs="multi-head latent attention; mixture of experts with sigmoid group-limited routing, a correction bias "
            "and shared experts; the first first_k_dense_replace layers dense",
    fields=frozenset(FIELDS),
    defaults={"n_routed_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 2048,
              "n_shared_experts": 1, "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4,
              "norm_topk_prob": True, "first_k_dense_replace": 3, "kv_lora_rank": 512, "q_lora_rank": 1536,
              "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "rope_interleave": True,
              "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "rms_norm_eps": 1e-6},
    read=_read, write=_write, moe=True, refuse=_refuse,
)
