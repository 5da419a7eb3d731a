"""LoRA settings (`lora.*`) and their validation. Imports nothing of megaft: the root
config (megaft.config) assembles it, megaft.peft.lora reads it."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import List, Optional

# Target name -> the module it adapts (HF's names, which are also megaft's: megaft.models.decoder).
TARGET_MODULES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj",
                  "up": "up_proj", "down": "down_proj", "lm_head": "lm_head"}
# Mixture-of-experts targets (megaft.peft.experts): every routed expert's gate/up/down (per-expert
# adapters), the shared expert(s)' gate/up/down (Qwen2-MoE, DeepSeek-V3), the router's weight.
MOE_TARGETS = ("experts", "shared_expert", "router")
TARGETS = (*TARGET_MODULES, *MOE_TARGETS)


class BaseDtype(StrEnum):
    fp32 = "fp32"  # frozen base linears kept in fp32 (as the full fine-tune keeps them)
    bf16 = "bf16"  # frozen base linears stored in bf16: half their memory (needs precision=bf16)


class LoraInit(StrEnum):
    kaiming = "kaiming"  # peft's default (init_lora_weights=True): A kaiming-uniform(a=sqrt(5)), B zeros
    gaussian = "gaussian"  # peft's "gaussian": A ~ N(0, 1/rank), B zeros


@dataclass
class LoraConfig:
    rank: int = 0  # r of the adapters B (out x r) A (r x in); 0 = LoRA off (full fine-tuning)
    alpha: float = 16.0  # the update is (alpha / rank) * B A x (alpha / sqrt(rank) with rslora)
    dropout: float = 0.0  # dropout probability on the adapter input (training only)
    # what gets adapters: q, k, v, o, gate, up, down (dense MLPs), lm_head; on a mixture of experts also
    # experts (one adapter per routed expert and projection), shared_expert, router (docs/lora.md)
    targets: List[str] = field(default_factory=lambda: ["q", "k", "v", "o", "gate", "up", "down"])
    rslora: bool = False  # rank-stabilized scaling alpha / sqrt(rank) (Kalajdzievski 2023)
    base_dtype: BaseDtype = BaseDtype.fp32  # storage of the frozen base linears: fp32 | bf16
    init: LoraInit = LoraInit.kaiming  # adapter init, seeded by parameter name: kaiming | gaussian
    # with the export (train.export_hf): also write base + adapters merged (RUN_DIR/hf_merged); null = yes
    export_merged: Optional[bool] = None

    @property
    def scale(self) -> float:
        """The factor of B A x: alpha / rank, or alpha / sqrt(rank) with rslora."""
        return self.alpha / (self.rank ** 0.5 if self.rslora else self.rank)


def check_lora(cfg: LoraConfig, *, precision: str, fused_linear_cross_entropy: bool = False,
               zero: int = 0, export_hf: bool = False) -> list[str]:
    """Every problem of the `lora.*` settings (none when LoRA is off), each with its fix."""
    if cfg.rank == 0:
        return []
    problems = []
    if cfg.rank < 0:
        problems.append(f"lora.rank={cfg.rank} must be >= 0; fix: 0 (off) or e.g. lora.rank=16")
    if cfg.alpha <= 0:
        problems.append(f"lora.alpha={cfg.alpha} must be > 0; fix: e.g. lora.alpha=2*lora.rank")
    if not 0.0 <= cfg.dropout < 1.0:
        problems.append(f"lora.dropout={cfg.dropout} must be in [0, 1); fix: e.g. lora.dropout=0.05")
    unknown = [t for t in cfg.targets if t not in TARGETS]
    if unknown:
        problems.append(f"lora.targets has unknown {unknown}; fix: choose from {list(TARGETS)}")
    if "router" in cfg.targets and "experts" not in cfg.targets:
        problems.append("lora.targets has router without experts: a router adapter alone reroutes tokens to "
                        "experts that cannot adapt; fix: add experts to lora.targets or drop router")
    moe = [t for t in ("experts", "router") if t in cfg.targets]
    if moe and cfg.dropout > 0:
        problems.append(f"lora.targets has {moe} with lora.dropout={cfg.dropout}: their adapters have no dropout "
                        "(peft's adapters on expert parameters refuse it too); fix: lora.dropout=0")
    if not cfg.targets:
        problems.append("lora.targets is empty: nothing would train; fix: e.g. lora.targets=[q,k,v,o,gate,up,down]")
    if len(set(cfg.targets)) != len(cfg.targets):
        problems.append(f"lora.targets={list(cfg.targets)} repeats a target; fix: list each once")
    if cfg.base_dtype not in set(BaseDtype):
        problems.append(f"lora.base_dtype={cfg.base_dtype!r} is unknown; fix: fp32 or bf16")
    elif cfg.base_dtype == BaseDtype.bf16 and precision != "bf16":
        problems.append(f"lora.base_dtype=bf16 needs bf16 compute, not precision={precision}; fix: precision=bf16 "
                        "or lora.base_dtype=fp32")
    if cfg.init not in set(LoraInit):
        problems.append(f"lora.init={cfg.init!r} is unknown; fix: kaiming or gaussian")
    if "lm_head" in cfg.targets and fused_linear_cross_entropy:
        problems.append("lora.targets has lm_head, whose adapter the fused linear cross-entropy would skip; fix: "
                        "kernels.fused_linear_cross_entropy=false or drop lm_head from lora.targets")
    if zero == 3:
        problems.append("lora with parallel.zero=3 is not supported (the adapters are small: ZeRO-3 saves nothing "
                        "over ZeRO-2); fix: parallel.zero=2")
    if cfg.export_merged is True and not export_hf:
        problems.append("lora.export_merged=true writes with the export; fix: also set train.export_hf=true")
    return problems


def check_lora_model(cfg: LoraConfig, *, tie_embeddings: bool, kv_heads: int, tp: int, mla: bool = False,
                     q_latent: bool = False) -> list[str]:
    """The `lora.*` problems that depend on the resolved architecture and tp (the model
    files are read by then), checked before launch rather than when the model is built.
    `mla`: multi-head latent attention (DeepSeek-V3, megaft.models.attention.mla), `q_latent` with a query
    latent (q_lora_rank): there q, k, v name no projection, and nothing says so at build time."""
    if cfg.rank <= 0:
        return []
    problems = []
    if "lm_head" in cfg.targets and tie_embeddings:
        problems.append("lora.targets has lm_head but the model ties its embeddings: the head is the embedding, "
                        "which peft's lm_head adapter would not reproduce; fix: drop lm_head from lora.targets")
    if mla:
        return problems + _mla_targets(cfg, q_latent)
    kv = [t for t in ("k", "v") if t in cfg.targets]
    if kv and tp > kv_heads:
        problems.append(f"lora.targets has {kv} but parallel.tp={tp} is larger than the model's {kv_heads} kv heads "
                        "(copied kv heads read the weight directly); fix: drop k and v from lora.targets or "
                        f"parallel.tp<={kv_heads}")
    return problems


def _mla_targets(cfg: LoraConfig, q_latent: bool) -> list[str]:
    """The targets that adapt nothing under multi-head latent attention: k and v always (one
    kv_b_proj makes both), q when the queries come from a latent (q_a_proj, q_b_proj; without one,
    q adapts q_proj). lora.targets has no name for the latent projections."""
    idle = [t for t in ("q", "k", "v") if t in cfg.targets and (t != "q" or q_latent)]
    if not idle:
        return []
    kept = [t for t in cfg.targets if t not in idle] or ["o", "gate", "up", "down"]
    projections = "q_a_proj, q_b_proj, " if q_latent else "q_proj, "
    latent = "q_a/q_b/kv_a/kv_b" if q_latent else "kv_a/kv_b"
    return [f"lora.targets has {idle} but the model uses multi-head latent attention (MLA, DeepSeek-V3), whose "
            f"projections are {projections}kv_a_proj_with_mqa, kv_b_proj and o_proj: {', '.join(idle)} would adapt "
            f"nothing, and lora.targets has no target for MLA's latent projections ({latent} are not targets); "
            f"fix: lora.targets=[{','.join(kept)}]"
            + (" (q adapts q_proj)" if not q_latent and "q" in kept else "")]


def check_lora_moe(cfg: LoraConfig, *, n_experts: int, shared_expert: bool) -> list[str]:
    """The `lora.targets` problems of a model's mixture of experts (`n_experts` routed experts,
    0 for a dense model; `shared_expert`: its MoE blocks have a shared expert MLP)."""
    if cfg.rank <= 0:
        return []
    problems = []
    moe = [t for t in ("experts", "router") if t in cfg.targets]
    if moe and n_experts == 0:
        problems.append(f"lora.targets has {moe} but the model is dense (no routed experts); fix: drop "
                        f"{' and '.join(moe)} from lora.targets (gate, up, down adapt its MLP)")
    if "shared_expert" in cfg.targets and not shared_expert:
        problems.append("lora.targets has shared_expert but the model has no shared expert (Qwen2-MoE's "
                        "shared_expert, DeepSeek-V3's shared_experts); fix: drop shared_expert from lora.targets")
    return problems
