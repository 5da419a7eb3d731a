"""Per-GPU memory estimate of a config, checked against the device's memory in validate().

The estimate is for the fullest rank: parameters, gradients and AdamW moments as
megaft stores them (fp32 master weights and grads, the autocast copies are
transient) sharded by tp, pp and the ZeRO stage; activations saved for backward
of the micro-batches a rank holds at once under its pipeline schedule; the
communication scratch of ZeRO; plus a margin for the CUDA context, NCCL buffers
and allocator fragmentation. Parameters, grads and optimizer state match
`ShardedAdamW.memory_bytes()` closely (tests/test_estimate.py); activations are a
per-layer count of the saved tensors (SDPA keeps no seq x seq scores), a rough
figure meant to catch configs that cannot fit, not to promise one fits to the MiB.

Mixture-of-experts models (megaft.models.moe): parameters, grads and optimizer state hold
every expert, the routers and shared experts (megaft.perf.counts.rank_params); each MoE
block saves its routed activations (top_k copies of each token's MLP input and
intermediates), the router's fp32 logits and probabilities and the dispatch indices
(counts.moe_activation_bytes_per_token) in place of the dense MLP's, plus, per micro-batch
in flight, the compute-dtype copies of its fp32 expert weights that the grouped GEMMs keep
for backward (counts.moe_weight_copy_bytes; a block under full recompute keeps none until
it is recomputed).

Expert parallelism (parallel.ep > 1): a rank holds n_experts/ep of each MoE block's routed
experts, so their params, grads and optimizer state (counts.rank_expert_params) and their
compute-dtype copies are divided by ep, and ZeRO shards that part over the dp*cp/ep ranks
holding the same experts, the rest (router, shared expert, dense layers, embeddings) over
dp*cp as without ep; ZeRO-3's gathered blocks hold the rank's experts only. Each MoE block
also keeps the all-to-all's send and receive buffers of its routed token copies,
2 x tokens x top_k x dim in the compute dtype per micro-batch in flight
(counts.moe_dispatch_bytes_per_token, counted in the activations like the routed copies).

Objectives (train.objective) declare what they add in one place, `objective_terms`: the rows
a micro-batch sample becomes (a preference pair is two rows of up to data.seq_len, or one
packed row of up to 2 x data.seq_len: the same tokens), and the frozen models held beside
the policy (a reference or teacher: built like the policy at lora.rank=0, sharded by tp, pp
and ep but whole under ZeRO, fp32, no grads or optimizer state). Such a model's scoring pass
runs without grad before the policy's forward, so it adds no activations at the peak; the
rows' tokens are counted in the policy's activations.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from megaft.config.model import padded_size
from megaft.device import resolve_device
from megaft.perf.counts import (
    BF16,
    FP32,
    activation_bytes_per_token,
    expert_adapter_params,
    layer_params,
    lora_rank_bytes,
    moe_weight_copy_bytes,
    per_block,
    rank_expert_params,
    rank_layer_ids,
    rank_params,
)
from megaft.perf.hardware import GIB
from megaft.perf.muon import rank_muon_elements
from megaft.pipeline.partition import stage_layers

MARGIN_FRACTION = 0.10  # allocator fragmentation and transient copies
MARGIN_FIXED = 1.0 * GIB  # CUDA context, cuBLAS workspaces, NCCL buffers


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank (`rank`: its pp rank) needs; `total` includes the margin."""

    rank: int
    params: int
    grads: int
    optimizer: int
    activations: int
    buffers: int
    frozen: int = 0  # the objective's frozen models (a reference or teacher), see objective_terms

    @property
    def margin(self) -> int:
        return int(MARGIN_FRACTION * (self.params + self.grads + self.optimizer + self.activations + self.buffers
                                      + self.frozen) + MARGIN_FIXED)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers + self.frozen + self.margin

    def describe(self) -> str:
        parts = ("params", "grads", "optimizer", "activations", "buffers") + (("frozen",) if self.frozen else ()) + (
            "margin",)
        return ", ".join(f"{p} {getattr(self, p) / GIB:.2f}" for p in parts)


@dataclass(frozen=True)
class ObjectiveTerms:
    """What train.objective adds to the policy's memory and time: `rows` rows per micro-batch
    sample, `frozen_models` whole models beside the policy (reference, teacher), and the
    forwards of such a model per micro-batch while training (`frozen_forwards`: an online
    reference; one scored before training adds none; megaft.perf.time prices them)."""

    rows: int = 1
    frozen_models: int = 0
    frozen_forwards: int = 0
    # the frozen model's own shape when it is not the policy's (a distillation teacher); None: the policy's
    frozen_model: Optional[object] = None
    score_head: bool = False  # a reward model: the scalar head in place of the LM head and its logits


def objective_terms(cfg) -> ObjectiveTerms:
    """The one place each objective declares its memory terms (mirrors the models its step
    builds: megaft.training.objectives.preference.step.reference_model, grpo.reference_model)."""
    from megaft.config.pref import is_preference, needs_reference

    objective, pref = cfg.train.objective, cfg.pref
    if is_preference(objective):
        held = needs_reference(objective) and (pref.reference is not None or pref.reference_mode == "online")
        online = needs_reference(objective) and pref.reference_mode == "online"
        return ObjectiveTerms(rows=2, frozen_models=int(held), frozen_forwards=int(online))
    if objective == "grpo":  # the reference's log-probs of every step's completions
        kl = int(cfg.rl.beta != 0.0)
        return ObjectiveTerms(frozen_models=kl, frozen_forwards=kl)
    if objective == "distill" and cfg.distill.top_k is not None:  # scored once before step 1: no teacher held
        return ObjectiveTerms()
    if objective == "distill":  # the teacher: its own shape, read from its checkpoint when there is one
        return ObjectiveTerms(frozen_models=1, frozen_forwards=1, frozen_model=_teacher_shape(cfg))
    if objective == "reward":  # a pair's two rows through a model with the scalar head
        return ObjectiveTerms(rows=2, score_head=True)
    return ObjectiveTerms()


def _teacher_shape(cfg):
    """distill.teacher's ModelConfig (validation checks the directory), or None (the policy's shape)
    when it cannot be read."""
    import os

    path = cfg.distill.teacher
    if not path or not os.path.isfile(os.path.join(path, "config.json")):
        return None
    from megaft.models.hf.config import hf_model_config

    try:
        return hf_model_config(path, base=cfg.model)
    except (OSError, ValueError):
        return None


def in_flight(schedule: str, pp: int, vpp: int, pp_rank: int, microbatches: int) -> float:
    """Micro-batches whose activations (of all this rank's layers) are alive at the peak."""
    if pp == 1:
        return 1.0  # each backward follows its forward
    if schedule == "gpipe":
        return float(microbatches)
    if schedule == "interleaved":  # Megatron's warmup, in chunk-micro-batches of 1/vpp of the layers
        warmup = (pp - pp_rank - 1) * 2 + (vpp - 1) * pp + 1
        return min(microbatches * vpp, warmup) / vpp
    return float(min(pp - pp_rank, microbatches))  # 1f1b


def estimate_memory(cfg, world_size: int) -> MemoryEstimate:
    """The fullest rank's estimate for a validated `cfg` (megaft.config.Config) on world_size ranks."""
    return max(estimate_ranks(cfg, world_size), key=lambda e: e.total)


def estimate_ranks(cfg, world_size: int) -> list[MemoryEstimate]:
    """One estimate per pp rank (tp and dp ranks of one stage hold the same amounts)."""
    from megaft.config.parallel import resolve_dp
    from megaft.config.train import accumulation_steps

    m, par = cfg.model, cfg.parallel
    dp = resolve_dp(par, world_size)
    micro = max(accumulation_steps(cfg.train, dp), 1)
    cp, ep = par.cp, par.ep
    replicas = dp * cp  # ZeRO shards over dp×cp (cp replicates the parameters like dp)
    expert_replicas = max(replicas // ep, 1)  # ... and the routed experts over the dp×cp/ep ranks holding them
    terms = objective_terms(cfg)
    if terms.score_head and not m.score_head:  # validation's resolve sets it; the planner's configs may not have
        m = dataclasses.replace(m, score_head=True)
    tokens = terms.rows * cfg.train.micro_batch_size * cfg.data.seq_len // cp
    acts = dict(tp=par.tp, sequence_parallel=par.sequence_parallel, precision=cfg.precision, cp=cp,
                seq=cfg.data.seq_len, ep=ep)
    # per block (a mixture of experts' differ from the dense ones): everything it saves, and what
    # it keeps under model.recompute (recomputed blocks hold less, and the one being recomputed
    # holds everything)
    every = per_block(m, lambda i: activation_bytes_per_token(m, layer=i, **acts))
    kept = every if m.recompute == "none" else per_block(
        m, lambda i: activation_bytes_per_token(m, layer=i, recompute=m.recompute, **acts))
    # the grouped GEMMs' compute-dtype copies of fp32 expert weights, per micro-batch in flight
    copies = cfg.precision in ("bf16", "fp16") and not cfg.optim.master_weights
    expert_copies = per_block(m, lambda i: moe_weight_copy_bytes(m, tp=par.tp, layer=i, copies=copies, ep=ep))
    stages = stage_layers(m.n_layers, par.pp * par.vpp, par.pp_layers)
    vocab_local = padded_size(m.vocab_size, m.make_vocab_size_divisible_by * par.tp) // par.tp
    offloaded = par.offload == "cpu"  # Adam moments live in host memory
    # optim.master_weights: bf16 params and grads, fp32 masters beside the moments (2 + 2 + 12; Muon's: 2 + 2 + 8)
    weight, opt_bytes = (BF16, 3 * FP32) if cfg.optim.master_weights else (FP32, 2 * FP32)
    ids = rank_layer_ids(m, pp=par.pp, vpp=par.vpp, pp_layers=par.pp_layers)
    shape = dict(tp=par.tp, pp=par.pp, vpp=par.vpp, pp_layers=par.pp_layers, ep=ep)
    # the routed experts' share of each rank's parameters, sharded over expert_replicas (none at ep = 1)
    experts = rank_expert_params(m, **shape) if ep > 1 else [0] * par.pp
    out = []
    held_sizes = rank_params(terms.frozen_model, **shape) if terms.frozen_model is not None else None
    for r, n in enumerate(rank_params(m, **shape)):
        # lora.rank=0, fp32, whole under ZeRO; a teacher of its own shape
        held_models = terms.frozen_models * (n if held_sizes is None else held_sizes[r]) * FP32
        live = in_flight(par.schedule, par.pp, par.vpp, r, micro)
        # model.recompute_layers: the first N blocks of each of this rank's virtual stages
        again = set() if m.recompute == "none" else {
            i for c in range(par.vpp) for i in list(stages[r + c * par.pp])[:m.recompute_layers]}
        full = m.recompute == "full"
        if again:
            held = sum(kept[i] if i in again else every[i] for i in ids[r]) * tokens
            held += sum(expert_copies[i] for i in ids[r] if not (full and i in again))  # full: none kept
        else:  # the same sums in the same order, at the planner's thousands of layouts
            held = sum(map(every.__getitem__, ids[r])) * tokens
            held += sum(map(expert_copies.__getitem__, ids[r]))
        activations = held * live
        if full and again:  # the block being recomputed in backward (the fullest of them)
            activations += max(every[i] * tokens + expert_copies[i] for i in again)
        if r == par.pp - 1:  # fp32 logits and their softmax for the loss, one micro-batch at a time
            activations += 2 * tokens * (1 if m.score_head else vocab_local) * FP32  # a reward model: one score
        buffers = 0
        if par.zero >= 2:  # reduce-scatter scratch: about two buckets in flight
            buffers += int(2 * par.bucket_mb * 2 ** 20)
        if par.zero == 3:  # the gathered whole params and grads of the running and the next block
            buffers += 2 * 2 * layer_params(m, par.tp, ep=ep) * weight
        frozen, x = 0, experts[r]
        if cfg.lora.rank > 0:  # LoRA: only the adapters train; the per-expert ones shard like the experts
            frozen, n = lora_rank_bytes(m, cfg.lora, par, r, n, ids[r])
            x = sum(expert_adapter_params(m, cfg.lora, par.tp, i, ep) for i in ids[r]) if ep > 1 else 0
        n -= x  # the dense part, sharded over dp×cp; x over dp×cp/ep

        def sharded(nbytes: int, stage: int, dense: int = n, expert: int = x) -> int:
            """Bytes per element `nbytes` of the rank's parameters (or of `dense` and `expert` of them),
            ZeRO-sharded from `stage` on."""
            dense = dense * nbytes // (replicas if par.zero >= stage else 1)
            return dense + expert * nbytes // (expert_replicas if par.zero >= stage else 1)

        optimizer = sharded(opt_bytes, 1)
        if cfg.optim.name == "muon":  # a Muon element keeps one moment, the momentum (megaft.perf.muon)
            optimizer -= sharded(FP32, 1, *rank_muon_elements(m, ids[r], tp=par.tp, ep=ep,
                                                              lora=cfg.lora if cfg.lora.rank else None))
        out.append(MemoryEstimate(
            rank=r, params=frozen + sharded(weight, 3), grads=sharded(weight, 2),
            optimizer=0 if offloaded else optimizer, activations=int(activations), buffers=buffers,
            frozen=held_models))
    return out


def memory_budget(cfg, target: Optional[tuple[int, str]] = None) -> tuple[Optional[int], str]:
    """(bytes per GPU, where that came from): launcher.gpu_mem_gb (GiB) when set, else
    `target` (the GPU a Slurm preset names, passed by the sweep launcher), else the first
    visible GPU's memory when this process sees one and the run uses CUDA; (None, "")
    when unknown (a CPU run, or a login node without GPUs), which skips the check."""
    if cfg.launcher.gpu_mem_gb > 0:
        return int(cfg.launcher.gpu_mem_gb * GIB), f"launcher.gpu_mem_gb={cfg.launcher.gpu_mem_gb:g}"
    if target is not None:
        return target
    if cfg.device == "cpu":  # no GPU to ask (and no torch import in a CPU run's launcher)
        return None, ""
    import torch

    if resolve_device(cfg.device) == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return props.total_memory, props.name
    return None, ""


def check_memory(cfg, world_size: int, target: Optional[tuple[int, str]] = None,
                 estimate: Optional[MemoryEstimate] = None) -> list[str]:
    """A problem when the estimate (`estimate`, else estimate_memory's) exceeds the per-GPU
    budget (see memory_budget for `target`), naming both and the fixes."""
    budget, source = memory_budget(cfg, target)
    if budget is None:
        return []
    est = estimate or estimate_memory(cfg, world_size)
    if est.total <= budget:
        return []
    par = cfg.parallel
    fixes = [f"raise parallel.tp={par.tp} or parallel.pp={par.pp}"]
    stored_ok = not cfg.distill.generates and par.pp == 1 and par.cp == 1 and cfg.data.packing != "stream"
    if cfg.train.objective == "distill" and est.frozen and stored_ok:  # distill.top_k's own refusals excluded
        # the online teacher: whole under ZeRO, so only tp/pp or the stored top-k take it off the GPU
        fixes.append(f"set distill.top_k=64 with distill.scores=DIR (the teacher, {est.frozen / GIB:.1f} GiB here, is "
                     "scored once before training and not held while it trains)")
    if cfg.model.n_experts:  # expert parallelism splits the routed experts over the dp×cp replicas
        from megaft.config.parallel import resolve_dp

        replicas = resolve_dp(par, world_size) * par.cp
        more = [e for e in range(par.ep + 1, replicas + 1) if replicas % e == 0 and cfg.model.n_experts % e == 0]
        if more:
            fixes.append(f"raise parallel.ep={par.ep} (to {' or '.join(map(str, more))}: each rank holds "
                         "n_experts/ep experts)")
    if est.activations > est.total / 2:  # activations dominate: split the sequence, or recompute
        fixes.append(f"raise parallel.cp={par.cp} (each rank holds seq_len/cp tokens)")
        if cfg.model.recompute != "full":
            fixes.append(f"set model.recompute={'selective' if cfg.model.recompute == 'none' else 'full'}")
    top_zero = 2 if cfg.lora.rank > 0 else 3  # LoRA refuses ZeRO-3 (megaft.config.lora.check_lora)
    if par.zero < top_zero:
        fixes.append(f"raise parallel.zero={par.zero} (up to {top_zero})")
    if par.offload == "none":
        fixes.append("set parallel.offload=cpu")
    if cfg.train.micro_batch_size > 1:
        fixes.append(f"lower train.micro_batch_size={cfg.train.micro_batch_size}")
    if cfg.precision == "fp32":
        fixes.append("use precision=bf16")
    if par.tp > 1 and not par.sequence_parallel:
        fixes.append("set parallel.sequence_parallel=true")
    return [f"estimated memory per GPU {est.total / GIB:.1f} GiB (pp rank {est.rank}, GiB: {est.describe()}) > "
            f"{budget / GIB:.1f} GiB ({source}); fix: " + ", ".join(fixes)]
