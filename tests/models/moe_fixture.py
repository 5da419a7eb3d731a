"""Tiny random mixture-of-experts checkpoints of every MoE family, saved with transformers.

Each variant's differences move the logits: Mixtral's block_sparse_moe names and
renormalized top-2 with a sliding window shorter than the sequences; Qwen2-MoE's
sigmoid-gated shared expert, q/k/v biases, unrenormalized top-k and a dense layer
(mlp_only_layers); Qwen3-MoE's qk-norm, head_dim != dim / heads, renormalized top-k and a
dense first layer by decoder_sparse_step; OLMoE's qk-norm over the whole projection and
unrenormalized top-k. Four experts of top-2 over 17 tokens: every expert gets tokens.
"""
from __future__ import annotations

import contextlib

import torch
import transformers

from models.hf_fixture import VOCAB, write_char_tokenizer

SEQ = 17
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=96, max_position_embeddings=64, rms_norm_eps=1e-5, pad_token_id=0, eos_token_id=1,
             bos_token_id=2, num_experts_per_tok=2, router_aux_loss_coef=0.02)
MOE_ARCHS = {
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, intermediate_size=48, sliding_window=6)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                         norm_topk_prob=False, mlp_only_layers=[1], num_hidden_layers=3)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=4, moe_intermediate_size=32, head_dim=24, norm_topk_prob=True,
                                         decoder_sparse_step=2, num_hidden_layers=3)),
    "olmoe": ("OlmoeConfig", dict(num_experts=4, intermediate_size=32, norm_topk_prob=False)),
}


def hf_config(name: str, **shape) -> transformers.PretrainedConfig:
    cls, kwargs = MOE_ARCHS[name]
    return getattr(transformers, cls)(**{**SHAPE, **kwargs, **shape}, attn_implementation="eager")


@torch.no_grad()
def make_hf_moe(path: str, name: str, *, seed: int = 0, **shape) -> None:
    """Save a random `name` model (+ tokenizer.json) into `path` (weights std 0.1, norm scales near 1)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(name, **shape)).float()
    for pname, p in model.named_parameters():
        noise = torch.randn_like(p) * 0.1
        p.copy_(1.0 + noise if pname.endswith("norm.weight") else noise)
    model.save_pretrained(path)
    write_char_tokenizer(path)


@contextlib.contextmanager
def router_margins():
    """Inside the block, every router forward appends its smallest gap between a token's k-th and
    (k+1)-th expert score to the yielded list, over the positions its MoE layer counts as tokens
    (RouterLog.valid: a preference row's padding is left out; its routing reaches no loss). A
    layout moves the scores only by rounding, so a gap far above it means no token's experts
    differ between layouts (issue 44: a near-tie that a reordered sum breaks would change the
    routing, not only round it). Single-process runs: positions are the rows' own."""
    from megaft.models.moe.layer import MoE
    from megaft.models.moe.router import Router

    gaps: list[float] = []
    valid: list = [None]
    moe_forward, router_forward = MoE.forward, Router.forward

    def moe(self, x, residual=None):
        valid[0] = self.log.valid
        return moe_forward(self, x, residual)

    def router(self, x):
        out = router_forward(self, x)
        scores = out[1].detach()
        if valid[0] is not None and valid[0].shape == scores.shape[:-1]:
            scores = scores[valid[0].to(scores.device) > 0]
        top = scores.topk(self.top_k + 1, dim=-1).values
        gaps.append((top[..., -2] - top[..., -1]).min().item())
        return out

    MoE.forward, Router.forward = moe, router
    try:
        yield gaps
    finally:
        MoE.forward, Router.forward = moe_forward, router_forward


def load_reference(path: str):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def sample_ids(seed: int = 0, batch: int = 2) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def hf_grad_of(hf_grads: dict[str, torch.Tensor], name: str, arch: str = "") -> torch.Tensor:
    """The gradient transformers computed for our parameter `name` (its in-memory layout:
    experts fused as gate_up_proj [E, 2F, dim] and down_proj, the router at mlp.gate)."""
    hf = name if name == "lm_head.weight" else "model." + name
    prefix, sep, proj = hf.rpartition(".mlp.experts.")
    if sep and proj in ("gate_proj", "up_proj"):
        fused = hf_grads[f"{prefix}.mlp.experts.gate_up_proj"]
        half = fused.shape[1] // 2
        return fused[:, :half] if proj == "gate_proj" else fused[:, half:]
    return hf_grads[hf]
