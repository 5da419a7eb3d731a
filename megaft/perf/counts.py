"""What a model holds and does, counted: parameters, FLOPs per token, activation and
message bytes per block, for every family, LoRA, recompute, sequence and context parallel
setting. The one place megaft counts; memory.py, time.py, the trainer's MFU and
megaft-report read it (tests/test_layering.py checks that nobody else counts).

MFU = tokens/s * model FLOPs per token / (ranks * peak FLOP/s), the PaLM paper's
definition (appendix B): the FLOPs the model needs, not what the hardware ran, so
activation recomputation, padding and pipeline bubbles lower MFU instead of inflating it.

Mixtures of experts (megaft.models.moe): parameter and memory counts hold every expert;
FLOPs count the weights a token is multiplied by (router, top_k experts, shared expert),
so idle experts do not inflate MFU (flops_per_token); blocks differ only in whether they
are a mixture (ModelConfig.is_moe), and each count is per block (`layer`). Under expert
parallelism (parallel.ep > 1) a rank holds n_experts/ep of each block's routed experts:
the per-rank counts take `ep` (expert_params, layer_params, rank_params), the whole-model
ones (total_params, matmul_params, FLOPs) do not; a2a_bytes counts the tokens it moves.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence, TypeVar

from megaft.config.lora import LoraConfig
from megaft.config.model import ModelConfig, kv_replicas, padded_size
from megaft.pipeline.partition import stage_layer_counts, stage_layers

T = TypeVar("T")
FP32 = 4
BF16 = 2


def per_block(m: ModelConfig, count: Callable[[int], T]) -> list[T]:
    """`count(layer)` for every decoder block, evaluated once per kind of block: every count
    here depends on a block only through whether it is a mixture of experts (m.is_moe)."""
    if m.n_experts == 0:  # every block dense: one count (the planner asks this thousands of times)
        return [count(0)] * m.n_layers
    kinds: dict = {}
    return [kinds[kind] if (kind := m.is_moe(i)) in kinds else kinds.setdefault(kind, count(i))
            for i in range(m.n_layers)]


# --- parameters ---------------------------------------------------------------------------
#
# A mixture-of-experts block (megaft.models.moe, where `m.is_moe(layer)`) replaces the dense MLP
# by: the router `gate.weight` [E, dim] (replicated over tp); the stacked experts gate/up
# [E, F/tp, dim] and down [E, dim, F/tp] (F = m.expert_ffn, split over tp like the dense MLP);
# with `shared_expert_ffn_dim` S > 0 a dense gated MLP of inner size S (tp-split, with the MLP's
# biases) and its sigmoid gate `shared_expert_gate.weight` [1, dim] (replicated). Other blocks
# keep the dense MLP of ffn_dim. Counts of all weights (memory, optimizer state) hold every
# expert; counts of the weights a token multiplies (FLOPs) hold the router, the top_k experts
# it is sent to, the shared expert and its gate. Under expert parallelism (`ep` > 1) a rank
# holds n_experts/ep of the routed experts, [E/ep, F/tp, dim] each; the router, the shared
# expert and every dense layer stay whole on every rank.

def _dense_mlp_params(m: ModelConfig, ffn: int, tp: int) -> int:
    """One tp rank's gated MLP of inner size `ffn`: gate, up (column) and down (row, bias whole)."""
    return 3 * m.dim * ffn // tp + ((2 * ffn // tp + m.dim) if m.mlp_bias else 0)


def expert_params(m: ModelConfig, layer: int, tp: int, ep: int = 1) -> int:
    """Routed expert parameters of block `layer` on one tp rank of one ep rank: gate, up and
    down of its n_experts/ep experts, [E/ep, F/tp, dim] each (0 for a dense block). The part
    of a rank's parameters whose gradients reduce, and whose ZeRO shards split, over the
    expert-data-parallel group (dp*cp/ep ranks) instead of dp*cp."""
    if not m.is_moe(layer):
        return 0
    return 3 * (m.n_experts // ep) * m.dim * m.expert_ffn // tp


def mlp_params(m: ModelConfig, layer: int, tp: int, ep: int = 1) -> int:
    """Parameters of block `layer`'s MLP on one tp rank (of one ep rank): the dense MLP, or
    the router, the tp slice of every expert (of the rank's n_experts/ep under ep), the
    shared expert and its gate."""
    if not m.is_moe(layer):
        return _dense_mlp_params(m, m.ffn_dim, tp)
    out = m.n_experts * m.dim + expert_params(m, layer, tp, ep)
    if m.shared_expert_ffn_dim:
        out += _dense_mlp_params(m, m.shared_expert_ffn_dim, tp) + (m.dim if m.shared_expert_gate else 0)
    return out


def mlp_matmul_params(m: ModelConfig, layer: int) -> int:
    """Weights of block `layer`'s MLP that one token multiplies (the whole model, no tp): the
    dense gate/up/down, or the router (E * dim), the top_k experts it is routed to (3 * dim * F
    each) and the shared expert with its gate (3 * dim * S + dim). Idle experts do not count."""
    if not m.is_moe(layer):
        return 3 * m.dim * m.ffn_dim
    out = m.n_experts * m.dim + m.top_k * 3 * m.dim * m.expert_ffn
    if m.shared_expert_ffn_dim:
        out += 3 * m.dim * m.shared_expert_ffn_dim + (m.dim if m.shared_expert_gate else 0)
    return out


def _attention_matmul_params(m: ModelConfig) -> int:
    if m.mla:
        replicated, split = _mla_params(m)
        return replicated + split
    q, kv = m.n_heads * m.hd, m.kv_heads * m.hd  # GQA: k and v project to kv heads only
    return m.dim * q + 2 * m.dim * kv + q * m.dim


# Multi-head latent attention (DeepSeek-V3, megaft.models.attention.mla): the down projections q_a_proj
# [q_lora, dim] and kv_a_proj_with_mqa [kv_lora + rope, dim] are replicated over tp; q_b_proj
# [heads * qk, q_lora] (or q_proj [heads * qk, dim]), kv_b_proj [heads * (nope + v), kv_lora] and
# o_proj [dim, heads * v] are split by heads; the latent norms [q_lora], [kv_lora] are replicated.

def _mla_params(m: ModelConfig) -> tuple[int, int]:
    """(replicated, tp-split) linear weights of one latent attention."""
    h, qk = m.n_heads, m.qk_head_dim
    replicated = m.dim * (m.kv_lora_rank + m.hd)
    split = m.kv_lora_rank * h * (m.qk_nope_head_dim + m.v_head_dim) + h * m.v_head_dim * m.dim
    if m.q_lora_rank is None:
        split += m.dim * h * qk
    else:
        replicated += m.dim * m.q_lora_rank
        split += m.q_lora_rank * h * qk
    return replicated, split


def _attention_params(m: ModelConfig, tp: int) -> int:
    """One tp rank's attention weights, biases and qk-norms."""
    if m.mla:
        replicated, split = _mla_params(m)
        return replicated + split // tp + m.kv_lora_rank + (m.q_lora_rank or 0)
    q, kv = m.n_heads * m.hd, m.kv_heads * kv_replicas(m, tp) * m.hd
    attn = (m.dim * (q + 2 * kv) + q * m.dim) // tp
    if m.attention_bias or m.qkv_bias:
        attn += (q + 2 * kv) // tp + (m.dim if m.attention_bias else 0)
    if m.qk_norm:  # per head: [hd] each, replicated; full width (OLMoE): [heads * hd] split like q and k
        attn += (m.n_heads + m.kv_heads) * m.hd // tp if m.qk_norm_width == "full" else 2 * m.hd
    return attn


def matmul_params(m: ModelConfig) -> int:
    """Weights that take part in a matmul per token: every linear of every block and the
    output head (the embedding lookup is a gather; a tied head still multiplies; a reward
    model's head is its scalar score). Of a mixture of experts only the active ones
    (mlp_matmul_params): the router, top_k experts, the shared expert and its gate."""
    return (m.n_layers * _attention_matmul_params(m) + sum(per_block(m, lambda i: mlp_matmul_params(m, i)))
            + m.dim * (1 if m.score_head else m.vocab_size))


def total_params(m: ModelConfig) -> int:
    """Weights of the whole model as built (no tp, no vocabulary padding): every block with all
    its experts, norms and biases, the input embedding, the final norm and an untied head (a
    reward model: its scalar score, nothing tied)."""
    vocab = m.vocab_size * m.dim
    return (sum(per_block(m, lambda i: layer_params(m, 1, i))) + vocab + m.dim
            + (m.dim if m.score_head else 0 if m.tie_embeddings else vocab))


def layer_params(m: ModelConfig, tp: int, layer: Optional[int] = None, ep: int = 1) -> int:
    """Parameters of decoder block `layer` on one tp rank (row-parallel biases are whole; kv
    heads copied when tp > n_kv_heads count once per rank; n_experts/ep routed experts under
    expert parallelism); None: the largest block (the same for every block of a dense model)."""
    if layer is None:
        return max(per_block(m, lambda i: layer_params(m, tp, i, ep)))
    norms = (4 if m.sandwich_norms else 2) * m.dim  # RMSNorm weights
    return _attention_params(m, tp) + mlp_params(m, layer, tp, ep) + norms


def rank_layer_ids(m: ModelConfig, *, pp: int, vpp: int, pp_layers=None) -> list[list[int]]:
    """The decoder blocks (global indices) each pp rank holds: its virtual stages r, r + pp, ..."""
    return [list(ids) for ids in _rank_layer_ids(m.n_layers, pp, vpp, tuple(pp_layers) if pp_layers else None)]


@functools.lru_cache(maxsize=1024)  # the planner asks for the same few splits thousands of times
def _rank_layer_ids(n_layers: int, pp: int, vpp: int, pp_layers: Optional[tuple]) -> tuple[tuple[int, ...], ...]:
    stages = stage_layers(n_layers, pp * vpp, pp_layers)
    return tuple(tuple(i for c in range(vpp) for i in stages[r + c * pp]) for r in range(pp))


def rank_params(m: ModelConfig, *, tp: int, pp: int, vpp: int, pp_layers=None, ep: int = 1) -> list[int]:
    """Parameters held by each pp rank (one tp shard, one ep rank): its stages' layers (with
    n_experts/ep routed experts per MoE block), the embedding on the first, the final norm
    and head on the last (a tied head is a copy when pp > 1; a reward model's head is its scalar
    `score`, whole on every tp rank, and nothing is tied)."""
    vocab = padded_size(m.vocab_size, m.make_vocab_size_divisible_by * tp) // tp * m.dim
    blocks = per_block(m, lambda i: layer_params(m, tp, i, ep))
    out = [sum(map(blocks.__getitem__, ids)) for ids in rank_layer_ids(m, pp=pp, vpp=vpp, pp_layers=pp_layers)]
    out[0] += vocab
    if m.score_head:
        out[-1] += m.dim + m.dim
    else:
        out[-1] += m.dim + (vocab if not m.tie_embeddings or pp > 1 else 0)
    return out


def rank_expert_params(m: ModelConfig, *, tp: int, pp: int, vpp: int, pp_layers=None, ep: int = 1) -> list[int]:
    """The routed expert parameters (expert_params) among each pp rank's rank_params: the
    part that reduces and shards over the dp*cp/ep expert-data-parallel ranks."""
    blocks = per_block(m, lambda i: expert_params(m, i, tp, ep))
    return [sum(blocks[i] for i in ids) for ids in rank_layer_ids(m, pp=pp, vpp=vpp, pp_layers=pp_layers)]


def rank_layers(m: ModelConfig, par) -> list[int]:
    """Decoder blocks held by each pp rank (all its virtual stages) under `par` (ParallelConfig)."""
    counts = stage_layer_counts(m.n_layers, par.pp * par.vpp, par.pp_layers)
    return [sum(counts[r + c * par.pp] for c in range(par.vpp)) for r in range(par.pp)]


def adapter_layer_params(m: ModelConfig, lora: LoraConfig, tp: int, layer: int, ep: int = 1) -> tuple[int, int]:
    """(adapter parameters, base linear weight elements) of decoder block `layer` on one tp rank
    and ep rank (megaft.peft.lora's splits: column A [r, in] whole, B [out/tp, r]; row A [r, in/tp],
    B [out, r] whole). gate/up/down adapt the dense MLP; in a mixture-of-experts block
    `shared_expert` adapts the shared expert's three, `experts` each of this ep rank's E/ep
    experts' three (split over tp alike, megaft.peft.experts), `router` the router [E, dim].
    The stacked experts, the router and the shared expert's gate stay fp32 under lora.base_dtype=bf16,
    and so do latent attention's replicated down projections (q_a, kv_a: no parallel linears)."""
    r = lora.rank
    if m.mla:  # adaptable: o_proj, and q_proj without a query latent (the latent projections are no targets)
        shapes = {"o": (m.n_heads * m.v_head_dim, m.dim, True)}
        if m.q_lora_rank is None:
            shapes["q"] = (m.dim, m.n_heads * m.qk_head_dim, False)
        base = _mla_params(m)[1]  # the tp-split linears (q_b or q_proj, kv_b, o) are the base linears
    else:
        q, kv = m.n_heads * m.hd, m.kv_heads * m.hd
        shapes = {"q": (m.dim, q, False), "k": (m.dim, kv, False), "v": (m.dim, kv, False), "o": (q, m.dim, True)}
        base = sum(i * o for i, o, _ in shapes.values())
    moe = m.is_moe(layer)
    ffn = m.shared_expert_ffn_dim if moe else m.ffn_dim
    if ffn:
        shapes.update({"gate": (m.dim, ffn, False), "up": (m.dim, ffn, False), "down": (ffn, m.dim, True)})
        base += 3 * m.dim * ffn
    mlp = "shared_expert" if moe else "gate"  # a MoE block's gate/up/down linears are its shared expert's
    wanted = {t for t in lora.targets if t not in ("gate", "up", "down")}
    wanted |= {t for t in ("gate", "up", "down") if (t if mlp == "gate" else "shared_expert") in lora.targets}

    def pair(i: int, o: int, row: bool) -> int:
        return r * (i // tp + o) if row else r * (i + o // tp)

    adapters = sum(pair(i, o, row) for t, (i, o, row) in shapes.items() if t in wanted)
    adapters += expert_adapter_params(m, lora, tp, layer, ep)
    if moe and "router" in lora.targets:
        adapters += r * (m.dim + m.n_experts)
    return adapters, base // tp


def expert_adapter_params(m: ModelConfig, lora: LoraConfig, tp: int, layer: int, ep: int = 1) -> int:
    """The per-expert adapters (target `experts`) of block `layer` on one tp and ep rank: gate/up
    A [E/ep, r, dim], B [E/ep, F/tp, r]; down A [E/ep, r, F/tp], B [E/ep, dim, r]. The part of
    adapter_layer_params that, like the experts, reduces and shards over the dp*cp/ep ranks."""
    if not (m.is_moe(layer) and "experts" in lora.targets):
        return 0
    f = m.expert_ffn // tp
    return m.n_experts // ep * lora.rank * (2 * (m.dim + f) + (f + m.dim))


def head_adapter_params(m: ModelConfig, lora: LoraConfig, vocab_local: int) -> int:
    """Parameters of the lm_head adapter on one tp rank holding `vocab_local` head rows (0 unless targeted;
    0 for a reward model, which has no lm_head)."""
    return lora.rank * (m.dim + vocab_local) if "lm_head" in lora.targets and not m.score_head else 0


def lora_rank_bytes(m: ModelConfig, lora: LoraConfig, par, r: int, n: int, layers: Sequence[int]) -> tuple[int, int]:
    """(frozen base bytes, trainable adapter parameters) of pp rank `r` holding `n` base params
    and the blocks `layers` (global indices): base linears in lora.base_dtype, embedding,
    norms and experts fp32."""
    blocks = per_block(m, lambda i: adapter_layer_params(m, lora, par.tp, i, par.ep))
    adapters, linear = sum(blocks[i][0] for i in layers), sum(blocks[i][1] for i in layers)
    if r == par.pp - 1 and not m.tie_embeddings:  # the untied head is a linear too
        vocab = padded_size(m.vocab_size, m.make_vocab_size_divisible_by * par.tp)
        linear += vocab // par.tp * m.dim
        adapters += head_adapter_params(m, lora, vocab // par.tp)
    saved = (FP32 - BF16) * linear if lora.base_dtype == "bf16" else 0
    return n * FP32 - saved, adapters


def trainable_rank_params(m: ModelConfig, par, lora: LoraConfig) -> list[int]:
    """Trainable parameters of each pp rank (one tp shard, one ep rank): rank_params, or under
    LoRA (lora.rank > 0) the adapters alone (the base is frozen: no grads, no optimizer state)."""
    full = rank_params(m, tp=par.tp, pp=par.pp, vpp=par.vpp, pp_layers=par.pp_layers, ep=par.ep)
    if lora.rank <= 0:
        return full
    ids = rank_layer_ids(m, pp=par.pp, vpp=par.vpp, pp_layers=par.pp_layers)
    return [lora_rank_bytes(m, lora, par, r, n, layers)[1] for r, (n, layers) in enumerate(zip(full, ids))]


# --- FLOPs ----------------------------------------------------------------------------------

def flops_per_token(m: ModelConfig, seq_len: int, lora: Optional[LoraConfig] = None) -> float:
    """Training FLOPs per token: 6 per matmul weight (forward 2, backward 4) plus attention
    scores and values, 2 matmuls of n_heads * head_dim * seq_len each, times 2 FLOPs and 3
    passes = 12 * layers * n_heads * head_dim * seq_len (PaLM counts the full square, not
    the causal half; query heads count, GQA shares only the k/v projections); under latent
    attention 6 * layers * n_heads * (qk_head_dim + v_head_dim) * seq_len, and its matmul
    weights are the down and up projections (the latents are never expanded into weights).

    A mixture-of-experts block counts the weights a token is multiplied by, not the ones it
    holds (matmul_params): 6 * (E * dim + top_k * 3 * dim * F + 3 * dim * S + dim) per MoE
    block (router, the top_k routed experts, the shared expert of S and its gate), as
    Megatron-LM's and DeepSeek's counts of activated parameters do, so idle experts do not
    inflate MFU; dense blocks of the same model keep 6 * 3 * dim * ffn_dim. The gather,
    sort and weighted sum of the dispatch are not matmuls and do not count.

    Under LoRA (`lora.rank` > 0) the frozen weights need no weight gradient: 4 per base
    weight (forward and input gradient), and 6 per adapter parameter."""
    attention = m.n_layers * 3 * attention_core_flops(m, seq_len)
    if lora is None or lora.rank <= 0:
        return 6.0 * matmul_params(m) + attention
    adapters = (sum(a for a, _ in per_block(m, lambda i: adapter_layer_params(m, lora, 1, i)))
                + head_adapter_params(m, lora, m.vocab_size))
    return 4.0 * matmul_params(m) + 6.0 * adapters + attention


def flops_per_token_from_params(params: int, n_layers: int, dim: int, seq_len: int) -> float:
    """The same count from a summary without the shape (older summary.json files):
    6 * all params + 12 * layers * dim * seq_len."""
    return 6.0 * params + 12.0 * n_layers * dim * seq_len


def layer_forward_flops(m: ModelConfig, seq_len: int, layer: Optional[int] = None) -> float:
    """Forward FLOPs per token of block `layer`: 2 per weight it multiplies (a mixture of
    experts: its active ones, mlp_matmul_params) plus the attention core; a third of its
    share of flops_per_token. None: the mean block (n_layers of them make the blocks' share)."""
    if layer is None:
        return sum(per_block(m, lambda i: layer_forward_flops(m, seq_len, i))) / m.n_layers
    return 2.0 * (_attention_matmul_params(m) + mlp_matmul_params(m, layer)) + attention_core_flops(m, seq_len)


def mlp_activation_flops(m: ModelConfig, layer: int) -> float:
    """Forward FLOPs per token of block `layer`'s gated activation (what model.recompute=selective
    runs again besides the attention core), about 4 per element: ffn_dim wide, or in a mixture
    of experts top_k * F wide for the routed copies plus S for the shared expert."""
    width = m.top_k * m.expert_ffn + m.shared_expert_ffn_dim if m.is_moe(layer) else m.ffn_dim
    return 4.0 * width


def attention_core_flops(m: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs per token of one block's attention core (scores and values) over whole rows:
    2 * heads * (qk width + value width) * seq_len (4 * heads * head_dim but under latent attention)."""
    return 2.0 * m.n_heads * (m.qk_head_dim + m.v_dim) * seq_len


def head_forward_flops(m: ModelConfig) -> float:
    """Forward FLOPs per token of the output head."""
    return 2.0 * m.dim * m.vocab_size


def mfu(tokens_per_s: float, flops_per_tok: float, ranks: int, peak: float) -> float:
    """Model FLOPs utilization: achieved model FLOP/s over the ranks' summed peak (TFLOP/s)."""
    return tokens_per_s * flops_per_tok / (ranks * peak * 1e12)


# --- bytes ----------------------------------------------------------------------------------

def activation_bytes_per_token(m: ModelConfig, *, tp: int, sequence_parallel: bool, precision: str,
                               recompute: str = "none", cp: int = 1, seq: int = 0,
                               layer: Optional[int] = None, ep: int = 1) -> float:
    """Bytes saved for backward per token (of this rank) by decoder block `layer` (None: the
    fullest block of the model; every block of a dense model is alike), as megaft's block
    saves them with the torch kernels (tests/test_recompute.py, tests/test_cp_training.py
    and tests/test_perf_moe.py count the saved tensors and check this to a few percent).

    Each norm: its fp32 input (the residual), the normalized fp32 rows and the per-row
    rstd, sequence-sharded under sequence parallel; and the linears' input (the norm's
    output cast to the compute dtype; whole, as gathered, under sequence parallel; one
    tensor shared by q/k/v and by gate/up). Attention (tp-sharded heads): q, k, v, the
    output (o_proj reads it in place) and an fp32 log-sum-exp per head; SDPA's kernels and
    the ring keep no seq x seq scores. The MLP: gate, up, activation and product. A
    mixture-of-experts block's MLP is moe_activation_bytes_per_token's instead (with, under
    expert parallelism `ep` > 1, its all-to-all buffers: moe_dispatch_bytes_per_token).

    model.recompute=selective recomputes the attention core (its log-sum-exp is not kept)
    and the MLP activation (one ffn-wide tensor less); full keeps only the block's fp32
    input. Under context parallelism (`cp` > 1) a rank holds seq/cp tokens of each row, and
    the ring attention keeps its log-sum-exp under selective too (it stores no scores,
    so there is nothing to recompute)."""
    sp = tp if sequence_parallel else 1
    if recompute == "full":
        return m.dim * FP32 / sp
    if layer is None:
        return max(per_block(m, lambda i: activation_bytes_per_token(
            m, tp=tp, sequence_parallel=sequence_parallel, precision=precision, recompute=recompute, cp=cp, seq=seq,
            layer=i, ep=ep)))
    half = 2 if precision in ("bf16", "fp16") else FP32
    norms = 2 * (2 * m.dim + 1) * FP32 / sp + m.dim * half  # the MLP's input is counted with the MLP
    if m.sandwich_norms:  # Gemma 2/3: two more norms, whose outputs feed no linear
        norms += 2 * (2 * m.dim + 1) * FP32 / sp
    attention = (2 * m.n_heads * m.hd + 2 * m.kv_heads * m.hd) * half / tp
    if m.mla:  # q, k (qk wide), v and out (v wide) per head; the gathered latents, their fp32 norms
        # (input and normalized rows); not yet checked against the bytes a forward saves
        latents = (m.q_lora_rank or 0) + m.kv_lora_rank
        attention = ((2 * m.n_heads * m.qk_head_dim + 2 * m.n_heads * m.v_head_dim) * half / tp
                     + (latents + m.hd) * half + 2 * latents * FP32)
    if recompute == "none" or cp > 1:
        attention += m.n_heads * FP32 / tp
    if recompute == "none" and m.attn_softcap is not None:
        # Gemma 2's explicit soft-capped attention (`seq` tokens per row): per query and key of each
        # head the capped scores (tanh's output) and the fp32 probabilities (and their cast for
        # the product with v under bf16/fp16); k and v repeated per query head; no log-sum-exp
        attention += m.n_heads * seq * (2 * FP32 + (half if half != FP32 else 0)) / tp
        attention += (2 * (m.n_heads - m.kv_heads) * m.hd * half - m.n_heads * FP32) / tp
    if m.is_moe(layer):
        return norms + attention + moe_activation_bytes_per_token(m, tp=tp, sp=sp, half=half, recompute=recompute,
                                                                  ep=ep)
    ffn = (4 if recompute == "none" else 3) * m.ffn_dim * half / tp
    return norms + attention + m.dim * half + ffn


def moe_activation_bytes_per_token(m: ModelConfig, *, tp: int, sp: int, half: int, recompute: str,
                                   ep: int = 1) -> float:
    """Bytes a mixture-of-experts MLP (megaft.models.moe) saves for backward per token of this
    rank (`sp`: tp under sequence parallel, else 1; `half`: the compute dtype's itemsize), with
    k = top_k, E = n_experts, F = expert_ffn, S = shared_expert_ffn_dim:

    - its input, the norm's fp32 output, which the fp32 router multiplies: dim * 4 / sp;
    - the router (fp32, on this rank's tokens): logits, probabilities and the z-loss's
      log-sum-exp (2E + 1) * 4, the top-k indices k * 8, under norm_topk_prob the top-k
      values and their sum (k + 1) * 4, all / sp; the routing weights the output sum
      multiplies, k * 4 (gathered over the micro-batch under sequence parallel);
    - the dispatch: the sort order and the source rows, 2 * k * 8 (int64 over the micro-batch);
    - the routed copies (k per token; every tp rank sees the micro-batch's tokens): the
      sorted input k * dim * half, the grouped gate/up outputs, SwiGLU's activation and
      product (4 | 3 under selective) * k * F / tp * half, the down output k * dim * half
      (kept by the reorder) and its token-order copy the fp32 sum recasts in backward
      k * dim * half (megaft.models.moe.combine);
    - with a shared expert: its input (the gate's and the MLP's casts of the norm output;
      under sequence parallel the MLP's is the gathered whole), its gate/up/activation/product
      (4 | 3) * S / tp * half, its output and sigmoid gate (dim + 1) * half / sp;
    - under expert parallelism (`ep` > 1), the all-to-all's send and receive buffers of the
      routed copies, 2 * k * dim * half (moe_dispatch_bytes_per_token). The routed copies
      above stay k per token: a rank computes, on average, as many rows for its n_experts/ep
      experts as its own tokens send out (no capacity limit).

    The compute-dtype copies of the expert weights the grouped GEMMs keep are per layer, not
    per token: moe_weight_copy_bytes."""
    k, e, f, shared = m.top_k, m.n_experts, m.expert_ffn, m.shared_expert_ffn_dim
    wide = 4 if recompute == "none" else 3  # selective recomputes the SwiGLU activation
    router = (m.dim * FP32 + (2 * e + 1) * FP32 + k * 8 + ((k + 1) * FP32 if m.norm_topk_prob else 0)) / sp + k * FP32
    dispatch = 2 * k * 8
    routed = k * m.dim * half + wide * k * f * half / tp + 2 * k * m.dim * half
    out = router + dispatch + routed + moe_dispatch_bytes_per_token(m, half=half, ep=ep)
    if shared:
        cast = half != FP32
        out += (m.dim * half / sp if cast else 0) + (m.dim * half if cast or sp > 1 else 0)
        out += wide * shared * half / tp + (m.dim + 1) * half / sp
    return out


def moe_dispatch_bytes_per_token(m: ModelConfig, *, half: int, ep: int) -> int:
    """Bytes per token of a mixture-of-experts block's expert-parallel dispatch buffers: the
    all-to-all's send and receive buffers of the token's top_k routed copies, dim wide in the
    compute dtype (`half`: its itemsize), 2 * top_k * dim * half; 0 without expert
    parallelism (ep = 1: no token leaves the rank). Counted with the block's routed
    activations (moe_activation_bytes_per_token), for every micro-batch in flight."""
    return 2 * m.top_k * m.dim * half if ep > 1 else 0


def a2a_bytes(tokens: int, top_k: int, dim: int, elem_bytes: int, ep: int) -> float:
    """Bytes one ep rank sends in one mixture-of-experts block's forward under expert
    parallelism, with uniform routing and the experts in contiguous blocks of E / ep: each of
    its `tokens` tokens' top_k rows (dim wide, `elem_bytes` each) leaves the rank when its
    expert lives on another rank, (ep - 1) / ep of them, once to the expert (dispatch) and
    once back (combine), 2 * tokens * top_k * (ep - 1) / ep * dim * elem_bytes; the backward
    moves as much again in reverse. 0 at ep = 1 (benchmarks/moe.py checks it against the
    exact count of a measured routing)."""
    return 2 * tokens * top_k * (ep - 1) / ep * dim * elem_bytes


def moe_weight_copy_bytes(m: ModelConfig, *, tp: int, layer: int, copies: bool, ep: int = 1) -> int:
    """Bytes of the compute-dtype copies of block `layer`'s stacked expert weights that the
    grouped GEMMs keep for backward (Experts.forward casts gate/up/down to the autocast dtype):
    3 * E/ep * dim * F / tp * 2 per micro-batch whose backward is pending (the rank's
    n_experts/ep experts under expert parallelism), when `copies` (fp32 parameters under
    bf16/fp16 compute); 0 for a dense block or when the weights already are in the compute
    dtype (optim.master_weights, fp32 runs)."""
    if not copies or not m.is_moe(layer):
        return 0
    return 3 * (m.n_experts // ep) * m.dim * m.expert_ffn // tp * BF16


def ring_bytes(rows: int, seq: int, kv_heads: int, head_dim: int, cp: int, *, itemsize: int,
               recompute_forward: bool = False) -> int:
    """Bytes one rank sends around the context-parallel ring (megaft.parallel.context.ring) for one
    layer and micro-batch of `rows` rows of `seq` tokens (`kv_heads`: this tp rank's):
    forward, cp-1 K/V blocks; backward, cp-1 K/V blocks again and cp fp32 dK/dV
    accumulators; a recomputed forward (model.recompute=full) sends its K/V again."""
    block = 2 * rows * (seq // cp) * kv_heads * head_dim
    forward = (cp - 1) * block * itemsize
    return forward * (2 if recompute_forward else 1) + (cp - 1) * block * itemsize + cp * block * FP32
