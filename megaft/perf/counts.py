"""What a model holds and does, counted: parameters, FLOPs per token, activation and
message bytes per block, for every family, LoRA, recompute, sequence and context parallel
setting. The one place megaft counts; memory.py, time.py, the trainer's MFU and
megaft-report read it (tests/test_layering.py checks that nobody else counts).

MFU = tokens/s * model FLOPs per token / (ranks * peak FLOP/s), the PaLM paper's
definition (appendix B): the FLOPs the model needs, not what the hardware ran, so
activation recomputation, padding and pipeline bubbles lower MFU instead of inflating it.
"""
from __future__ import annotations

from typing import Optional

from megaft.models.config import ModelConfig
from megaft.parallel.tensor.shard import padded_size
from megaft.peft.config import LoraConfig
from megaft.pipeline.partition import stage_layer_counts

FP32 = 4
BF16 = 2


# --- parameters ---------------------------------------------------------------------------

def matmul_params(m: ModelConfig) -> int:
    """Weights that take part in a matmul per token: every linear of every block and the
    output head (the embedding lookup is a gather; a tied head still multiplies)."""
    q, kv = m.n_heads * m.hd, m.kv_heads * m.hd  # GQA: k and v project to kv heads only
    attn = m.dim * q + 2 * m.dim * kv + q * m.dim
    mlp = 3 * m.dim * m.ffn_dim  # SwiGLU: gate, up, down
    return m.n_layers * (attn + mlp) + m.dim * m.vocab_size


def total_params(m: ModelConfig) -> int:
    """Weights of the model: the matmul weights plus the input embedding."""
    return matmul_params(m) + (0 if m.tie_embeddings else m.vocab_size * m.dim)


def layer_params(m: ModelConfig, tp: int) -> int:
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


def rank_params(m: ModelConfig, *, tp: int, pp: int, vpp: int, pp_layers=None) -> list[int]:
    """Parameters held by each pp rank (one tp shard): its stages' layers, the embedding on
    the first, the final norm and head on the last (a tied head is a copy when pp > 1)."""
    vocab = padded_size(m.vocab_size, m.make_vocab_size_divisible_by * tp) // tp * m.dim
    counts = stage_layer_counts(m.n_layers, pp * vpp, pp_layers)
    per_layer = layer_params(m, tp)
    out = [sum(counts[r + c * pp] for c in range(vpp)) * per_layer for r in range(pp)]
    out[0] += vocab
    out[-1] += m.dim + (vocab if not m.tie_embeddings or pp > 1 else 0)
    return out


def rank_layers(m: ModelConfig, par) -> list[int]:
    """Decoder blocks held by each pp rank (all its virtual stages) under `par` (ParallelConfig)."""
    counts = stage_layer_counts(m.n_layers, par.pp * par.vpp, par.pp_layers)
    return [sum(counts[r + c * par.pp] for c in range(par.vpp)) for r in range(par.pp)]


def adapter_layer_params(m: ModelConfig, lora: LoraConfig, tp: int) -> tuple[int, int]:
    """(adapter parameters, base linear weight elements) of one decoder block on one tp rank
    (megaft.peft.lora's splits: column A [r, in] whole, B [out/tp, r]; row A [r, in/tp],
    B [out, r] whole)."""
    q, kv, r = m.n_heads * m.hd, m.kv_heads * m.hd, lora.rank
    shapes = {"q": (m.dim, q, False), "k": (m.dim, kv, False), "v": (m.dim, kv, False), "o": (q, m.dim, True),
              "gate": (m.dim, m.ffn_dim, False), "up": (m.dim, m.ffn_dim, False), "down": (m.ffn_dim, m.dim, True)}
    adapters = sum(r * (i // tp + o) if row else r * (i + o // tp)
                   for t, (i, o, row) in shapes.items() if t in lora.targets)
    return adapters, sum(i * o for i, o, _ in shapes.values()) // tp


def head_adapter_params(m: ModelConfig, lora: LoraConfig, vocab_local: int) -> int:
    """Parameters of the lm_head adapter on one tp rank holding `vocab_local` head rows (0 unless targeted)."""
    return lora.rank * (m.dim + vocab_local) if "lm_head" in lora.targets else 0


def lora_rank_bytes(m: ModelConfig, lora: LoraConfig, par, r: int, n: int, layers: int) -> tuple[int, int]:
    """(frozen base bytes, trainable adapter parameters) of pp rank `r` holding `n` base params
    and `layers` blocks: base linears in lora.base_dtype, embedding and norms fp32."""
    adapters, linear = adapter_layer_params(m, lora, par.tp)
    adapters, linear = adapters * layers, linear * layers
    if r == par.pp - 1 and not m.tie_embeddings:  # the untied head is a linear too
        vocab = padded_size(m.vocab_size, m.make_vocab_size_divisible_by * par.tp)
        linear += vocab // par.tp * m.dim
        adapters += head_adapter_params(m, lora, vocab // par.tp)
    saved = (FP32 - BF16) * linear if lora.base_dtype == "bf16" else 0
    return n * FP32 - saved, adapters


def trainable_rank_params(m: ModelConfig, par, lora: LoraConfig) -> list[int]:
    """Trainable parameters of each pp rank (one tp shard): rank_params, or under LoRA
    (lora.rank > 0) the adapters alone (the base is frozen: no grads, no optimizer state)."""
    full = rank_params(m, tp=par.tp, pp=par.pp, vpp=par.vpp, pp_layers=par.pp_layers)
    if lora.rank <= 0:
        return full
    return [lora_rank_bytes(m, lora, par, r, n, layers)[1]
            for r, (n, layers) in enumerate(zip(full, rank_layers(m, par)))]


# --- FLOPs ----------------------------------------------------------------------------------

def flops_per_token(m: ModelConfig, seq_len: int, lora: Optional[LoraConfig] = None) -> float:
    """Training FLOPs per token: 6 per matmul weight (forward 2, backward 4) plus attention
    scores and values, 2 matmuls of n_heads * head_dim * seq_len each, times 2 FLOPs and 3
    passes = 12 * layers * n_heads * head_dim * seq_len (PaLM counts the full square, not
    the causal half; query heads count, GQA shares only the k/v projections).

    Under LoRA (`lora.rank` > 0) the frozen weights need no weight gradient: 4 per base
    weight (forward and input gradient), and 6 per adapter parameter."""
    attention = 12.0 * m.n_layers * m.n_heads * m.hd * seq_len
    if lora is None or lora.rank <= 0:
        return 6.0 * matmul_params(m) + attention
    adapters = m.n_layers * adapter_layer_params(m, lora, 1)[0] + head_adapter_params(m, lora, m.vocab_size)
    return 4.0 * matmul_params(m) + 6.0 * adapters + attention


def flops_per_token_from_params(params: int, n_layers: int, dim: int, seq_len: int) -> float:
    """The same count from a summary without the shape (older summary.json files):
    6 * all params + 12 * layers * dim * seq_len."""
    return 6.0 * params + 12.0 * n_layers * dim * seq_len


def layer_forward_flops(m: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs per token of one block: a third of flops_per_token's per-layer share."""
    q, kv = m.n_heads * m.hd, m.kv_heads * m.hd
    return 2.0 * (m.dim * (q + 2 * kv) + q * m.dim + 3 * m.dim * m.ffn_dim) + 4.0 * m.n_heads * m.hd * seq_len


def attention_core_flops(m: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs per token of one block's attention core (scores and values) over whole rows."""
    return 4.0 * m.n_heads * m.hd * seq_len


def head_forward_flops(m: ModelConfig) -> float:
    """Forward FLOPs per token of the output head."""
    return 2.0 * m.dim * m.vocab_size


def mfu(tokens_per_s: float, flops_per_tok: float, ranks: int, peak: float) -> float:
    """Model FLOPs utilization: achieved model FLOP/s over the ranks' summed peak (TFLOP/s)."""
    return tokens_per_s * flops_per_tok / (ranks * peak * 1e12)


# --- bytes ----------------------------------------------------------------------------------

def activation_bytes_per_token(m: ModelConfig, *, tp: int, sequence_parallel: bool, precision: str,
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
    if m.sandwich_norms:  # Gemma 2/3: two more norms, whose outputs feed no linear
        norms += 2 * (2 * m.dim + 1) * FP32 / sp
    attention = (2 * m.n_heads * m.hd + 2 * m.kv_heads * m.hd) * half / tp
    if recompute == "none" or cp > 1:
        attention += m.n_heads * FP32 / tp
    if recompute == "none" and m.attn_softcap is not None:
        # Gemma 2's explicit soft-capped attention (`seq` tokens per row): per query and key of each
        # head the capped scores (tanh's output) and the fp32 probabilities (and their cast for
        # the product with v under bf16/fp16); k and v repeated per query head; no log-sum-exp
        attention += m.n_heads * seq * (2 * FP32 + (half if half != FP32 else 0)) / tp
        attention += (2 * (m.n_heads - m.kv_heads) * m.hd * half - m.n_heads * FP32) / tp
    ffn = (4 if recompute == "none" else 3) * m.ffn_dim * half / tp
    return norms + attention + ffn


def ring_bytes(rows: int, seq: int, kv_heads: int, head_dim: int, cp: int, *, itemsize: int,
               recompute_forward: bool = False) -> int:
    """Bytes one rank sends around the context-parallel ring (megaft.parallel.context.ring) for one
    layer and micro-batch of `rows` rows of `seq` tokens (`kv_heads`: this tp rank's):
    forward, cp-1 K/V blocks; backward, cp-1 K/V blocks again and cp fp32 dK/dV
    accumulators; a recomputed forward (model.recompute=full) sends its K/V again."""
    block = 2 * rows * (seq // cp) * kv_heads * head_dim
    forward = (cp - 1) * block * itemsize
    return forward * (2 if recompute_forward else 1) + (cp - 1) * block * itemsize + cp * block * FP32
