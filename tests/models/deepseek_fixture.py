"""Tiny random DeepSeek-V3 checkpoints saved by transformers (DeepseekV3ForCausalLM).

Two variants whose differences move the logits: `latent_q` has a query latent (q_lora_rank),
interleaved RoPE pairs and default RoPE; `plain_q` one q_proj, rotate-half RoPE and YaRN with
mscale/mscale_all_dim (the cos/sin factor and the softmax scale both differ from 1). Both route
over 8 experts in 4 groups, top-2 within the best 2 groups, with a random correction bias
large enough to change choices, 2 shared experts, a dense first layer (first_k_dense_replace=1),
norm_topk_prob and routed_scaling_factor 2.5.
"""
from __future__ import annotations

import torch
import transformers

from models.hf_fixture import VOCAB, write_char_tokenizer
from models.moe_fixture import load_reference, sample_ids  # noqa: F401 (the same helpers serve both)

SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2, n_routed_experts=8,
             routed_scaling_factor=2.5, kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16,
             n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=True,
             max_position_embeddings=64, rms_norm_eps=1e-5, pad_token_id=0, eos_token_id=1, bos_token_id=2)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}
VARIANTS = {
    "latent_q": dict(q_lora_rank=24, rope_interleave=True),
    "plain_q": dict(q_lora_rank=None, rope_interleave=False, rope_parameters=YARN),
}


@torch.no_grad()
def make_hf_deepseek(path: str, variant: str = "latent_q", *, seed: int = 0) -> None:
    """Save a random DeepseekV3ForCausalLM (+ tokenizer.json) into `path`: weights std 0.1,
    norm scales near 1, correction biases N(0, 0.3) (sigmoid scores are near 0.5, so they move choices)."""
    torch.manual_seed(seed)
    cfg = transformers.DeepseekV3Config(**{**SHAPE, **VARIANTS[variant]}, attn_implementation="eager")
    model = transformers.AutoModelForCausalLM.from_config(cfg).float()
    for name, p in model.named_parameters():
        noise = torch.randn_like(p) * 0.1
        p.copy_(1.0 + noise if name.endswith("norm.weight") else noise)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(torch.randn_like(b) * 0.3)
    model.save_pretrained(path)
    write_char_tokenizer(path)


def labels_of(ids: torch.Tensor) -> torch.Tensor:
    return torch.cat([ids[:, 1:], torch.full((ids.shape[0], 1), -100)], 1)
