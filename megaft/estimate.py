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
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megaft.parallel.shard import padded_size
from megaft.peft.config import adapter_layer_params, head_adapter_params
from megaft.pipeline.partition import stage_layer_counts

GIB = 2 ** 30
MARGIN_FRACTION = 0.10  # allocator fragmentation and transient copies
MARGIN_FIXED = 1.0 * GIB  # CUDA context, cuBLAS workspaces, NCCL buffers
FP32 = 4
BF16 = 2


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank (`rank`: its pp rank) needs; `total` includes the margin."""

    rank: int
    params: int
    grads: int
    optimizer: int
    activations: int
    buffers: int

    @property
    def margin(self) -> int:
        return int(MARGIN_FRACTION * (self.params + self.grads + self.optimizer + self.activations + self.buffers)
                   + MARGIN_FIXED)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers + self.margin

    def describe(self) -> str:
        parts = ("params", "grads", "optimizer", "activations", "buffers", "margin")
        return ", ".join(f"{p} {getattr(self, p) / GIB:.2f}" for p in parts)


def layer_params(m, tp: int) -> int:
    """Parameters of one decoder block on one tp rank (row-parallel biases are whole)."""
    q, kv = m.n_heads * m.hd, m.kv_heads * m.hd
    attn = (m.dim * (q + 2 * kv) + q * m.dim) // tp
    if m.attention_bias:
        attn += (q + 2 * kv) // tp + m.dim
    mlp = 3 * m.dim * m.ffn_dim // tp
    if m.mlp_bias:
        mlp += 2 * m.ffn_dim // tp + m.dim
    norms = (4 if m.sandwich_norms else 2) * m.dim + (2 * m.hd if m.qk_norm else 0)  # RMSNorm weights
    return attn + mlp + norms


def rank_params(m, *, tp: int, pp: int, vpp: int, pp_layers=None) -> list[int]:
    """Parameters held by each pp rank (one tp shard): its stages' layers, the embedding on
    the first, the final norm and head on the last (a tied head is a copy when pp > 1)."""
    vocab = padded_size(m.vocab_size, m.make_vocab_size_divisible_by * tp) // tp * m.dim
    counts = stage_layer_counts(m.n_layers, pp * vpp, pp_layers)
    out = [sum(counts[r + c * pp] for c in range(vpp)) * layer_params(m, tp) for r in range(pp)]
    out[0] += vocab
    out[-1] += m.dim + (vocab if not m.tie_embeddings or pp > 1 else 0)
    return out


def trainable_rank_params(cfg) -> list[int]:
    """Trainable parameters of each pp rank (one tp shard): rank_params, or under LoRA
    (lora.rank > 0) the adapters alone (the base is frozen: no grads, no optimizer state)."""
    m, par = cfg.model, cfg.parallel
    full = rank_params(m, tp=par.tp, pp=par.pp, vpp=par.vpp, pp_layers=par.pp_layers)
    if getattr(cfg, "lora", None) is None or cfg.lora.rank <= 0:
        return full
    counts = stage_layer_counts(m.n_layers, par.pp * par.vpp, par.pp_layers)
    return [lora_rank_bytes(cfg, r, n, sum(counts[r + c * par.pp] for c in range(par.vpp)))[1]
            for r, n in enumerate(full)]


def lora_rank_bytes(cfg, r: int, n: int, layers: int) -> tuple[int, int]:
    """(frozen base bytes, trainable adapter parameters) of pp rank `r` holding `n` base params
    and `layers` blocks: base linears in lora.base_dtype, embedding and norms fp32."""
    m, lora, par = cfg.model, cfg.lora, cfg.parallel
    adapters, linear = adapter_layer_params(m, lora, par.tp)
    adapters, linear = adapters * layers, linear * layers
    if r == par.pp - 1 and not m.tie_embeddings:  # the untied head is a linear too
        vocab = padded_size(m.vocab_size, m.make_vocab_size_divisible_by * par.tp)
        linear += vocab // par.tp * m.dim
        adapters += head_adapter_params(m, lora, vocab // par.tp)
    saved = (FP32 - BF16) * linear if lora.base_dtype == "bf16" else 0
    return n * FP32 - saved, adapters


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


def activation_bytes_per_token(m, *, tp: int, sequence_parallel: bool, precision: str,
                               recompute: str = "none", cp: int = 1, seq: int = 0) -> float:
    """Bytes saved for backward per token (of this rank) per decoder block, as megaft's
    block saves them with the torch kernels (tests/test_recompute.py and
    tests/test_cp_training.py count the saved tensors and check this to a few percent).

    Each norm: its fp32 input (the residual), the normalized fp32 rows and the per-row
    rstd, sequence-sharded under sequence parallel; and the linears' input (the norm's
    output cast to the compute dtype; whole, as gathered, under sequence parallel; one
    tensor shared by q/k/v and by gate/up). Attention (tp-sharded heads): q, k, v, the
    output (o_proj reads it in place) and an fp32 log-sum-exp per head; SDPA's kernels and
    the ring keep no seq x seq scores. The MLP: gate, up, activation and product.

    model.recompute=selective recomputes the attention core (its log-sum-exp is not kept)
    and the MLP activation (one ffn-wide tensor less); full keeps only the block's fp32
    input. Under context parallelism (`cp` > 1) a rank holds seq/cp tokens of each row, and
    the ring attention keeps its log-sum-exp under selective too (it stores no scores,
    so there is nothing to recompute)."""
    sp = tp if sequence_parallel else 1
    if recompute == "full":
        return m.dim * FP32 / sp
    half = 2 if precision in ("bf16", "fp16") else FP32
    norms = 2 * ((2 * m.dim + 1) * FP32 / sp + m.dim * half)
    if getattr(m, "sandwich_norms", False):  # Gemma 2/3: two more norms, whose outputs feed no linear
        norms += 2 * (2 * m.dim + 1) * FP32 / sp
    attention = (2 * m.n_heads * m.hd + 2 * m.kv_heads * m.hd) * half / tp
    if recompute == "none" or cp > 1:
        attention += m.n_heads * FP32 / tp
    if recompute == "none" and getattr(m, "attn_softcap", None) is not None:
        # Gemma 2's explicit soft-capped attention (`seq` tokens per row): per query and key of each
        # head the capped scores (tanh's output) and the fp32 probabilities (and their cast for
        # the product with v under bf16/fp16); k and v repeated per query head; no log-sum-exp
        attention += m.n_heads * seq * (2 * FP32 + (half if half != FP32 else 0)) / tp
        attention += (2 * (m.n_heads - m.kv_heads) * m.hd * half - m.n_heads * FP32) / tp
    ffn = (4 if recompute == "none" else 3) * m.ffn_dim * half / tp
    return norms + attention + ffn


def estimate_memory(cfg, world_size: int) -> MemoryEstimate:
    """The fullest rank's estimate for a validated `cfg` (megaft.config.Config) on world_size ranks."""
    return max(estimate_ranks(cfg, world_size), key=lambda e: e.total)


def estimate_ranks(cfg, world_size: int) -> list[MemoryEstimate]:
    """One estimate per pp rank (tp and dp ranks of one stage hold the same amounts)."""
    from megaft.parallel.config import resolve_dp
    from megaft.training.config import accumulation_steps

    m, par = cfg.model, cfg.parallel
    dp = resolve_dp(par, world_size)
    micro = max(accumulation_steps(cfg.train, dp), 1)
    cp = par.cp
    replicas = dp * cp  # ZeRO shards over dp×cp (cp replicates the parameters like dp)
    tokens = cfg.train.micro_batch_size * cfg.data.seq_len // cp
    per_token = activation_bytes_per_token(m, tp=par.tp, sequence_parallel=par.sequence_parallel,
                                           precision=cfg.precision, recompute=m.recompute, cp=cp,
                                           seq=cfg.data.seq_len)
    # recomputed blocks hold only their input, and the one being recomputed holds everything
    every = activation_bytes_per_token(m, tp=par.tp, sequence_parallel=par.sequence_parallel,
                                       precision=cfg.precision, cp=cp, seq=cfg.data.seq_len)
    counts = stage_layer_counts(m.n_layers, par.pp * par.vpp, par.pp_layers)
    vocab_local = padded_size(m.vocab_size, m.make_vocab_size_divisible_by * par.tp) // par.tp
    offloaded = getattr(par, "offload", "none") == "cpu"  # Adam moments live in host memory
    # optim.master_weights: bf16 params and grads, fp32 masters beside the moments (2 + 2 + 12)
    weight, opt_bytes = (BF16, 3 * FP32) if cfg.optim.master_weights else (FP32, 2 * FP32)
    out = []
    for r, n in enumerate(rank_params(m, tp=par.tp, pp=par.pp, vpp=par.vpp, pp_layers=par.pp_layers)):
        layers = sum(counts[r + c * par.pp] for c in range(par.vpp))
        live = in_flight(par.schedule, par.pp, par.vpp, r, micro)
        # model.recompute_layers: the first N blocks of each of this rank's virtual stages
        again = 0 if m.recompute == "none" else sum(
            counts[r + c * par.pp] if m.recompute_layers is None else min(counts[r + c * par.pp], m.recompute_layers)
            for c in range(par.vpp))
        acts = (again * per_token + (layers - again) * every) * tokens * live
        if m.recompute == "full" and again:
            acts += every * tokens  # the block being recomputed in backward
        if r == par.pp - 1:  # fp32 logits and their softmax for the loss, one micro-batch at a time
            acts += 2 * tokens * vocab_local * FP32
        buffers = 0
        if par.zero >= 2:  # reduce-scatter scratch: about two buckets in flight
            buffers += int(2 * par.bucket_mb * 2 ** 20)
        if par.zero == 3:  # the gathered whole params and grads of the running and the next block
            buffers += 2 * 2 * layer_params(m, par.tp) * weight
        frozen = 0
        if getattr(cfg, "lora", None) is not None and cfg.lora.rank > 0:  # LoRA: only the adapters train
            frozen, n = lora_rank_bytes(cfg, r, n, layers)
        out.append(MemoryEstimate(
            rank=r, params=frozen + n * weight // (replicas if par.zero == 3 else 1),
            grads=n * weight // (replicas if par.zero >= 2 else 1),
            optimizer=0 if offloaded else n * opt_bytes // (replicas if par.zero >= 1 else 1), activations=int(acts),
            buffers=buffers))
    return out


# GiB per GPU of the Slurm presets' `gpu_type` (hydra.launcher.gpu_type): the vendors' memory
# sizes less the usual driver reserve, rounded down (not measured here; a MIG slice or another
# card: hydra.launcher.gpu_mem_gb), so that a sweep submitted from a login node without GPUs
# is checked as on the cluster's GPUs.
GPU_MEMORY_GIB = {
    "t4": 14.7, "v100-16g": 15.7, "v100-32g": 31.7, "a10g": 22.1, "l4": 22.0, "l40s": 44.3,
    "a100-40g": 39.3, "a100-80g": 79.1, "h100": 79.1, "h100-nvl": 93.1, "gh200": 94.5, "h200": 139.7,
    "b200": 178.3, "mi250x": 63.9, "mi300x": 191.9,
}


def gpu_type_memory(gpu_type: str) -> tuple[Optional[float], list[str]]:
    """(GiB per GPU of `gpu_type`, problems): the table's entry (case-insensitive), or a
    problem listing the known types when it has none."""
    gib = GPU_MEMORY_GIB.get(gpu_type.lower())
    if gib is not None:
        return gib, []
    return None, [f"hydra.launcher.gpu_type={gpu_type!r} is unknown; fix: one of {', '.join(GPU_MEMORY_GIB)}, "
                  "or hydra.launcher.gpu_mem_gb=<GiB per GPU> for another GPU"]


def memory_budget(cfg, target: Optional[tuple[int, str]] = None) -> tuple[Optional[int], str]:
    """(bytes per GPU, where that came from): launcher.gpu_mem_gb (GiB) when set, else
    `target` (the GPU a Slurm preset names, passed by the sweep launcher), else the first
    visible GPU's memory when this process sees one and the run uses CUDA; (None, "")
    when unknown (a CPU run, or a login node without GPUs), which skips the check."""
    if cfg.launcher.gpu_mem_gb > 0:
        return int(cfg.launcher.gpu_mem_gb * GIB), f"launcher.gpu_mem_gb={cfg.launcher.gpu_mem_gb:g}"
    if target is not None:
        return target
    import torch

    if cfg.device != "cpu" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return props.total_memory, props.name
    return None, ""


def check_memory(cfg, world_size: int, target: Optional[tuple[int, str]] = None) -> list[str]:
    """A problem when the estimate exceeds the per-GPU budget (see memory_budget for
    `target`), naming both and the fixes."""
    budget, source = memory_budget(cfg, target)
    if budget is None:
        return []
    est = estimate_memory(cfg, world_size)
    if est.total <= budget:
        return []
    par = cfg.parallel
    fixes = [f"raise parallel.tp={par.tp} or parallel.pp={par.pp}"]
    if est.activations > est.total / 2:  # activations dominate: split the sequence, or recompute
        fixes.append(f"raise parallel.cp={par.cp} (each rank holds seq_len/cp tokens)")
        if cfg.model.recompute != "full":
            fixes.append(f"set model.recompute={'selective' if cfg.model.recompute == 'none' else 'full'}")
    top_zero = 2 if cfg.lora.rank > 0 else 3  # LoRA refuses ZeRO-3 (megaft.peft.config.check_lora)
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
