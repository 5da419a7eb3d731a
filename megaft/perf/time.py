"""Predicted step time of a layout: compute, collectives, the pipeline bubble, the optimizer.

Every term is in seconds per optimizer step for the slowest rank, and the terms add up
to the step (`StepCost.step_s`):

* **compute**: the FLOPs megaft counts for MFU (`megaft.perf.counts`: 6 per matmul
  weight per token plus attention's 12·layers·heads·head_dim·seq) summed over the blocks
  each virtual stage holds (`layer_forward_flops` per block: a mixture-of-experts block
  counts its active weights, the router, top_k experts and the shared expert, so a stage
  of MoE blocks weighs what its tokens multiply). With a GEMM curve in the cluster preset
  (`cluster.gemm_*`, megaft.perf.gemm) every linear of a block and the head is priced by its
  (m, n, k) shape, forward and both backward GEMMs (small and skinny ones run far below peak);
  the attention core (or by a flash kernel's causal curve, `cluster.attention_*`, megaft.perf.attention)
  and the FLOPs not listed as linears run at `peak × cluster.matmul_fraction`,
  which prices every FLOP in a preset without a curve and at fp32 (the curves are bf16's).
  With `cluster.hbm_fraction` > 0 a block also pays its norms, rotary, gated activation and
  residual adds, and the last stage its cross-entropy, by the bytes they move over HBM, plus
  `cluster.kernel_gap_us` per kernel; under `cluster.compiled: false` (eager PyTorch) by the
  unfused ops' bytes, and a pass takes at least its host dispatch time (megaft.perf.kernels_cost).
* **tp_comm**: per block two collectives in forward and two in backward (all-reduces, or
  with sequence parallelism reduce-scatter + all-gather: the same bytes), three with a
  shared expert (its MLP reduces on its own), plus the vocab-parallel embedding and head;
  megaft overlaps them only under `parallel.tp_overlap=ring` (sequence parallel, dense GQA/MLP
  blocks: megaft.parallel.tensor.overlap), priced step by step: each of a half's tp - 1 ring
  transfers shows what one chunk's GEMM (1/tp of the linear's) does not cover, the first
  input-gradient step also hidden by the weight gradients (`_ring_tp_s`). `cluster.tp_overlap`
  (what Megatron's published runs do: TransformerEngine's userbuffers) hides each block
  collective's halves behind the whole GEMMs next to them.
* **cp_comm**: the context-parallel ring (megaft.parallel.context.ring): per block, cp-1 K/V
  blocks in forward, and in backward cp-1 K/V blocks plus cp fp32 dK/dV accumulators, each
  a p2p over the cp group's link, hidden behind the attention core's compute of the block
  in hand; only what that compute cannot cover shows. Under cp every rank holds
  seq_len/cp tokens, so compute, tp collectives and pipeline messages shrink with it, and
  gradients and ZeRO shards span dp×cp.
* **ep_comm**: expert parallelism's all-to-alls (parallel.ep > 1): per MoE block, the
  dispatch of each of the rank's tokens' top_k rows (dim wide, compute dtype) to its
  expert's rank and the combine back, in forward and again in backward (and in the
  recomputed forward under model.recompute=full), `counts.a2a_bytes` per direction pair
  at uniform routing, over the link of the ep group (ep consecutive dp×cp replicas, tp
  apart), not overlapped with compute. Under ep the routed experts' gradients reduce, and
  their ZeRO shards gather, over the dp×cp/ep ranks holding the same experts (a link of
  ranks tp·ep apart), the rest over dp×cp: zero_comm, dp_comm, param_gather and the
  optimizer price each part over its own group.
* **pp_bubble**: what megaft's own simulator (`megaft.pipeline.simulate.replay`) leaves
  idle on the busiest rank when every F/B action costs its stage's compute + tp + ZeRO
  time and every p2p message (activations in the compute dtype, megaft's wire dtype) its
  transfer time.
* **zero_comm**: ZeRO-3's per-layer all-gathers (before forward and backward) and
  reduce-scatters of each block's parameters (`layer_params`: every expert of a MoE
  block), each hidden behind the previous layer's compute as megaft prefetches one layer
  ahead; ZeRO-2's per-micro-batch reduce-scatter behind that backward.
* **dp_comm**: ZeRO 0/1's gradient reduction. Buckets launch during the last
  micro-batch's backward, so only what backward cannot hide (at least the last bucket)
  shows; under pp > 1 megaft reduces after the schedule, so all of it shows. Under pp > 1
  with tied embeddings (and an LM head) it also holds the tied weight's gradient all-reduce
  between its two copies, the first and the last pp rank (megaft.pipeline.stage.sync_tied_grads,
  after the schedule, before the loss reaches every pp rank: every rank waits on it), over
  the link of two ranks (pp−1)·tp·dp×cp apart.
* **param_gather**: ZeRO 1/2's all-gather of the updated parameters after the step.
  `cluster.dp_overlap` (what Megatron's published runs do with --overlap-grad-reduce
  --overlap-param-gather, not megaft's runtime) hides, on the fullest pp rank, the reduction
  behind its last micro-batch's backward at pp > 1 too (as at pp = 1: at least one bucket shows)
  and the all-gather behind the next step's first micro-batch forward (at least one bucket shows).
* **optimizer**: the AdamW update, memory-bound (~32 bytes touched per updated element).
* **offload**: with `parallel.offload=cpu`, the grad/master copies over PCIe overlapped
  with the host AdamW, whichever is slower.

Under LoRA (`lora.rank` > 0) the frozen base linears compute no weight gradient, so a
block's backward is its forward plus the attention core's second matmul, and the
adapters add their own forward and backward; the dp reduction, ZeRO-2's reduce-scatter,
the parameter all-gather and AdamW move the adapters only (ZeRO-3 is refused with LoRA).

Collectives and compute are priced at the rates of megaft.perf.rates: ring formulas over the
link a group spans, and the device's peak, GEMM curve and HBM, each corrected by the cluster's
calibrated factors (`cluster.compute_scale`, `cluster.comm_scale`, `cluster.optimizer_scale`;
`cluster.step_overhead_s`, the **overhead** term: what a step spends outside every phase).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from megaft.config.parallel import resolve_dp
from megaft.config.train import accumulation_steps
from megaft.forks import fork_map
from megaft.perf.attention import AttentionCurve
from megaft.perf.counts import (
    a2a_bytes,
    adapter_layer_params,
    attention_core_flops,
    expert_params,
    flops_per_token,
    head_adapter_params,
    layer_forward_flops,
    layer_params,
    mfu,
    mlp_activation_flops,
    per_block,
    rank_expert_params,
    rank_layer_ids,
    trainable_rank_params,
)
from megaft.perf.gemm import block_linears, linear_s
from megaft.perf.hardware import cluster_hbm_tbps, cluster_peak_tflops
from megaft.perf.head import head_params, head_s, head_tp_s, loss_s, with_score_head
from megaft.perf.kernels_cost import add_block_kernels, block_passes, pass_s
from megaft.perf.memory import objective_terms
from megaft.perf.muon import block_matrix_elements, block_ns_flops, muon_offload_bytes, tp_gathered
from megaft.perf.op_recompute import op_recompute_s
from megaft.perf.rates import all_reduce_s, all_to_all_s, compute_rates, gather_s, group_link, p2p_s
from megaft.pipeline.partition import stage_layers
from megaft.pipeline.schedules import build_schedule
from megaft.pipeline.simulate import replay_many

TERMS = ("compute", "tp_comm", "cp_comm", "ep_comm", "pp_bubble", "zero_comm", "dp_comm", "param_gather", "optimizer",
         "offload", "overhead")


def p2p_bytes(precision: str) -> int:
    """Bytes per element of a pipeline message (megaft.pipeline.runtime.wire_dtype): the compute
    dtype under bf16/fp16 autocast, fp32 otherwise."""
    return 2 if precision in ("bf16", "fp16") else 4

ADAM_BYTES = 32  # per updated element: param, grad, two moments read and written (fp32)
MIB = 2 ** 20



def _a2a_s(cfg, cluster, tokens: int) -> float:
    """Seconds of one MoE block's dispatch and combine all-to-alls in one pass (forward, or
    backward) for this rank's `tokens`: counts.a2a_bytes, half each way, over the ep group
    (ep consecutive dp×cp replicas, tp apart); 0 without expert parallelism."""
    m, par = cfg.model, cfg.parallel
    if par.ep <= 1:
        return 0.0
    act = 2 if cfg.precision in ("bf16", "fp16") else 4  # the rows travel in the compute dtype
    return 2 * all_to_all_s(a2a_bytes(tokens, m.top_k, m.dim, act, par.ep) / 2, par.ep, cluster, par.tp)


def _over_replicas(collective, count: float, expert: float, nbytes: int, cluster, par, replicas: int) -> float:
    """Seconds of `collective` (all_reduce_s, gather_s) over `count` parameters of `nbytes`
    each held by the dp×cp `replicas`, of which `expert` (the routed experts under ep > 1)
    go over the replicas/ep ranks holding the same experts instead (every ep-th replica,
    tp·ep apart), one collective after the other."""
    link = group_link(cluster, replicas, par.tp)
    if not expert:
        return collective(count * nbytes, replicas, link)
    experts = group_link(cluster, replicas // par.ep, par.tp * par.ep)
    return (collective((count - expert) * nbytes, replicas, link)
            + collective(expert * nbytes, replicas // par.ep, experts))


@dataclass(frozen=True)
class StepCost:
    """The predicted step of one layout: seconds per term (they add up to step_s)."""

    terms: dict = field(default_factory=dict)
    tokens_per_step: int = 0
    world_size: int = 1
    flops_per_token: float = 0.0
    peak_tflops: float = 0.0

    @property
    def step_s(self) -> float:
        return sum(self.terms.values())

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_step / self.step_s / self.world_size

    @property
    def mfu(self) -> float:
        """Model FLOPs utilization as megaft reports it (one rank's share of the step)."""
        return mfu(self.tokens_per_s_per_gpu, self.flops_per_token, 1, self.peak_tflops)

    @property
    def bottleneck(self) -> str:
        """The term that takes the most time."""
        return max(self.terms, key=self.terms.get)


def _ring_s(cfg, cluster, tokens: int, core_f: float, core_b: float) -> tuple[float, float]:
    """(forward, backward) exposed seconds of one block's cp ring for this rank's `tokens`."""
    m, par = cfg.model, cfg.parallel
    cp = par.cp
    if cp <= 1:
        return 0.0, 0.0
    act = 2 if cfg.precision in ("bf16", "fp16") else 4
    kv = 2 * tokens * max(m.kv_heads / par.tp, 1) * m.hd  # K and V elements of one block (this tp rank's heads)
    link = group_link(cluster, cp, par.tp)
    forward = (cp - 1) * p2p_s(kv * act, link)
    backward = (cp - 1) * p2p_s(kv * act, link) + cp * p2p_s(kv * 4, link)
    return max(0.0, forward - core_f), max(0.0, backward - core_b)


def _block_collectives(m, layer: int) -> int:
    """tp collectives of block `layer` in forward (and as many in backward): attention's and
    the MLP's, and a shared expert's own (a mixture of experts' routing gathers under sequence
    parallel, k indices and weights per token, are too small to count)."""
    return 3 if m.is_moe(layer) and m.shared_expert_ffn_dim else 2


def _block_s(m, seq: int, layer: int, tokens: int, tp: int, ep: int, rate: float,
             curve) -> tuple[float, float, float]:
    """(forward, input-gradient, weight-gradient) seconds of block `layer` for this rank's `tokens`:
    its linears by shape on the cluster's GEMM curve (megaft.perf.gemm) and the rest of its FLOPs (the
    attention core, what block_linears does not list) at `rate`, once in each of the three passes
    (backward = twice forward for them, as the FLOP count has it); all of it at `rate` without a curve."""
    flops = tokens * layer_forward_flops(m, seq, layer) / tp
    if curve is None:
        return (flops / rate,) * 3
    linears = block_linears(m, layer, tokens, tp, ep)
    f, d, w = (sum(x) for x in zip(*(linear_s(lin, curve) for lin in linears))) if linears else (0.0,) * 3
    rest = max(0.0, flops - sum(lin.flops for lin in linears)) / rate
    return f + rest, d + rest, w + rest


def _overlapped_tp_s(m, layer: int, tokens: int, tp: int, ep: int, curve, rate: float, one: float,
                     wgrad: bool = True) -> tuple[float, float]:
    """(forward, backward) exposed seconds of block `layer`'s tp collectives under cluster.tp_overlap
    (Megatron/TransformerEngine's tp_comm_overlap): each of its collectives (`one`: an all-reduce, or a
    reduce-scatter + all-gather) is half before and half after a linear (the all-gather before q/k/v
    and gate/up, the reduce-scatter after o and down; the reverse in backward) and hides behind that
    linear's GEMMs only, pass by pass; a half without a listed linear (latent attention) shows.
    `wgrad`: False under LoRA (the frozen linears compute no weight gradient)."""
    halves = 2 * _block_collectives(m, layer)
    linears = block_linears(m, layer, tokens, tp, ep)[:halves]
    if curve is None:
        times = [(lin.flops / rate, 2 * lin.flops / rate) for lin in linears]
    else:
        times = [(f, d + (w if wgrad else 0.0)) for f, d, w in (linear_s(lin, curve) for lin in linears)]
    rest = (halves - len(times)) * one / 2
    return (rest + sum(max(0.0, one / 2 - f) for f, _ in times),
            rest + sum(max(0.0, one / 2 - b) for _, b in times))


def _ring_tp_s(m, layer: int, tokens: int, tp: int, curve, rate: float, one: float,
               wgrad: bool = True) -> tuple[float, float]:
    """(forward, backward) exposed seconds of dense block `layer`'s tp collectives under
    parallel.tp_overlap=ring (megaft.parallel.tensor.overlap): each half (`one` / 2: the all-gather
    before q/k/v and gate/up, the reduce-scatter after o and down) is tp - 1 ring steps of one
    chunk's transfer, each beside one chunk's GEMM (1/tp of the linear's), so a step shows only
    what its chunk's GEMM does not cover; the last chunk's GEMM hides nothing. Backward: the
    column linears' input-gradient reduce-scatter steps beside the dgrad chunks, the first one
    beside the weight gradients too (`wgrad`: False under LoRA); the row linears' output-gradient
    all-gather beside the dgrad chunks (their weight gradient waits for the whole gradient)."""
    steps, times = tp - 1, []
    for lin in block_linears(m, layer, tokens, tp)[:4]:  # q/k/v, o, gate/up, down (MoE and MLA refused)
        f, d, w = (lin.flops / rate,) * 3 if curve is None else linear_s(lin, curve)
        times.append((f / tp, d / tp, w if wgrad else 0.0))
    step = one / 2 / steps  # one chunk's transfer
    fwd = sum(steps * max(0.0, step - f) for f, _, _ in times)
    bwd = 0.0
    for i, (_, d, w) in enumerate(times):
        column = i % 2 == 0
        bwd += max(0.0, step - d - (w if column else 0.0)) + (steps - 1) * max(0.0, step - d)
    return fwd, bwd


def _stage_costs(cfg, cluster, dp: int) -> list[dict]:
    """Per virtual stage, one micro-batch's seconds: f/b compute, tp, the cp ring, the ep
    all-to-alls and ZeRO (exposed)."""
    m, par, seq = cfg.model, cfg.parallel, cfg.data.seq_len
    tp, stages, ep = par.tp, par.pp * par.vpp, par.ep
    terms = objective_terms(cfg)  # a preference pair is 2 rows; a frozen model's forward per micro-batch
    tokens = terms.rows * cfg.train.micro_batch_size * seq // par.cp  # this rank's share of each row under cp
    dp = dp * par.cp  # ZeRO shards over the dp×cp replicas
    # the FLOPs no GEMM curve prices (all of them without one), the curve, the elementwise kernels
    rate, curve, kc = compute_rates(cluster, str(cfg.precision))
    act = 2 if cfg.precision in ("bf16", "fp16") else 4
    wbytes = 2 if cfg.optim.master_weights else 4
    gbytes = 2 if par.grad_compression == "bf16" else 4
    tp_link, dp_link = group_link(cluster, tp), group_link(cluster, dp, tp)
    tp_one = all_reduce_s(tokens * m.dim * act, tp, tp_link)  # one block collective (AR, or RS + AG)
    head_f, head_d, head_w = head_s(m, tokens, tp, par.sequence_parallel, rate, curve)  # an LM's, or a score
    attention_f = tokens * attention_core_flops(m, seq) / tp / rate  # the attention core over whole rows
    # ... or by the preset's flash-kernel curve, causal, at the sequence of each call (megaft.perf.attention)
    attention = AttentionCurve.of(cluster, str(cfg.precision))
    att_f, att_b = attention.core_s(attention_f * rate, seq // par.cp) if attention else (attention_f, 2 * attention_f)
    ring_f, ring_b = _ring_s(cfg, cluster, tokens, att_f, att_b)
    a2a = _a2a_s(cfg, cluster, tokens)  # one MoE block's all-to-alls, each pass
    lora = cfg.lora if cfg.lora.rank > 0 else None
    # per block (a mixture of experts' differ from the dense ones): forward and backward compute,
    # what model.recompute runs again (the whole block under full, the attention core and the
    # activation under selective), the parameters ZeRO moves (this ep rank's experts) and the trained ones
    def block(i: int) -> tuple[float, float, float, int, int]:
        layer_f, dgrad, wgrad = _block_s(m, seq, i, tokens, tp, ep, rate, curve)
        core_f = att_f + tokens * mlp_activation_flops(m, i) / tp / rate
        lp = layer_params(m, tp, i, ep)
        if lora:  # frozen base linears skip their weight gradient; the adapters train (megaft.peft)
            adapters = adapter_layer_params(m, lora, tp, i, ep)[0]
            adapter_f = tokens * 2.0 * adapters / rate
            layer_b = dgrad + attention_f + 2 * adapter_f  # input grads of every matmul, the core's second
            layer_f += adapter_f
        else:
            adapters, layer_b = lp, dgrad + wgrad
        if attention:  # the core at the kernel's rates instead of matmul_fraction (twice the forward in backward)
            layer_f, layer_b = layer_f + att_f - attention_f, layer_b + att_b - 2 * attention_f
        if kc:  # norms, rotary, the activation, residual adds, launches (and an eager host)
            passes = block_passes(m, i, tokens, tp, par.sequence_parallel, act, kc.compiled)
            layer_f, layer_b, core_f = add_block_kernels(layer_f, layer_b, core_f, passes, kc)
        again = {"full": layer_f, "selective": core_f}.get(m.recompute, 0.0)
        if cluster.recompute_ops and m.recompute == "selective":  # torchtitan's op policy instead
            again = op_recompute_s(m, i, tokens, tp, rate, curve, passes[0] if kc else None, kc)
        return layer_f, layer_b, again, lp, adapters

    f, b, again, params, trained = zip(*per_block(m, block))
    # the routed experts' share of `params`, which ZeRO moves over the dp×cp/ep expert replicas
    experts = per_block(m, lambda i: expert_params(m, i, tp, ep) if ep > 1 and not lora else 0)

    seen: dict = {}  # the same block moves the same bytes: price each distinct collective once

    def zero_s(collective, count: float, expert: float, nbytes: int) -> float:
        key = (collective, count, expert, nbytes)
        if key not in seen:
            seen[key] = _over_replicas(collective, count, expert, nbytes, cluster, par, dp)
        return seen[key]

    if lora:
        head_adapters = 0 if m.score_head else head_adapter_params(m, lora, -(-m.vocab_size // tp))
        head_adapter_f = tokens * 2.0 * head_adapters / rate
        head_b, head_f = head_d + 2 * head_adapter_f, head_f + head_adapter_f
    else:
        head_b = head_d + head_w
    loss_f, loss_b = loss_s(m, tokens, tp, act, kc)  # the cross-entropy over this rank's logits
    head_f, head_b = head_f + loss_f, head_b + loss_b
    head_tp_f, head_tp_b = head_tp_s(m, tokens, tp, par.sequence_parallel, tp_one, tp_link)
    if cluster.tp_overlap and tp > 1:  # Megatron's (published rows); megaft's runtime: parallel.tp_overlap
        hidden = per_block(m, lambda i: _overlapped_tp_s(m, i, tokens, tp, ep, curve, rate, tp_one, not lora))
        tp_f, tp_b = [x for x, _ in hidden], [y for _, y in hidden]
    elif par.tp_overlap == "ring" and par.sequence_parallel and tp > 1:  # megaft's ring (validation: dense GQA)
        hidden = per_block(m, lambda i: _ring_tp_s(m, i, tokens, tp, curve, rate, tp_one, not lora))
        tp_f, tp_b = [x for x, _ in hidden], [y for _, y in hidden]
    else:
        tp_f = tp_b = [tp_one * n for n in per_block(m, lambda i: _block_collectives(m, i))]
    vocab_bytes, head_bytes = m.vocab_size * m.dim / tp * wbytes, head_params(m, tp) * wbytes
    b_again = [x + y for x, y in zip(b, again)]  # model.recompute runs (part of) the forward again
    out = []
    for s, ids in enumerate(stage_layers(m.n_layers, stages, par.pp_layers)):
        first, last, n = s == 0, s == stages - 1, len(ids)
        span = slice(ids.start, ids.stop)  # a stage's blocks are consecutive: slices sum in the same order
        colls_f, colls_b = sum(tp_f[span]), sum(tp_b[span])  # the blocks' collectives (exposed)
        c = {"f_compute": sum(f[span]) + (head_f if last else 0.0)}
        c["b_compute"] = sum(b_again[span]) + (head_b if last else 0.0)
        c["f_tp"] = colls_f + tp_one * first + (head_tp_f if last else 0.0)  # the embedding's, the head's
        c["b_tp"] = colls_b + (head_tp_b if last else 0.0) + (colls_f if m.recompute == "full" else 0.0)
        c["f_cp"] = n * ring_f * (2 if m.recompute == "full" else 1)  # full: the forward's ring runs again
        c["b_cp"] = n * ring_b
        moe = sum(map(m.is_moe, ids))  # full recompute: the forward's all-to-alls run again in backward
        c["f_ep"], c["b_ep"] = moe * a2a, moe * a2a * (2 if m.recompute == "full" else 1)
        if terms.frozen_forwards:  # the reference's scoring forward: whole under ZeRO, no adapters
            fm = terms.frozen_model or m  # a distillation teacher: its own shape, its layers split over the stages
            f_ids = ids if fm is m else stage_layers(fm.n_layers, stages, None)[s]
            frozen_f = sum(_block_s(fm, seq, i, tokens, tp, ep, rate, curve)[0] for i in f_ids)
            if attention and fm is m:  # the policy's core by the kernel's curve (a teacher's stays at the rate)
                frozen_f += len(f_ids) * (att_f - attention_f)
            head = head_s(fm, tokens, tp, par.sequence_parallel, rate, curve)[0] if last else 0.0
            if kc:  # its blocks' elementwise kernels, and its log-probs read the logits as the loss does
                frozen_f += sum(pass_s(block_passes(fm, i, tokens, tp, par.sequence_parallel, act, kc.compiled)[0],
                                       kc) for i in f_ids)
                head += loss_s(fm, tokens, tp, act, kc)[0] if last else 0.0
            c["f_compute"] += terms.frozen_forwards * (frozen_f + head)
            for k in ("f_tp", "f_cp", "f_ep"):
                c[k] *= 1 + terms.frozen_forwards
        c["f_zero"] = c["b_zero"] = 0.0
        if par.zero == 3 and dp > 1:  # prefetch hides a block's gather behind the previous block's compute
            ends = gather_s(vocab_bytes, dp, dp_link) * first + gather_s(head_bytes, dp, dp_link) * last
            ag = [zero_s(gather_s, params[i], experts[i], wbytes) for i in ids]
            agrs = [a + zero_s(gather_s, params[i], experts[i], gbytes) for a, i in zip(ag, ids)]
            c["f_zero"] = ag[0] + sum(max(0.0, ag[j] - f[ids[j - 1]]) for j in range(1, n)) + ends
            # backward runs the blocks last to first: each hides behind the one after it
            c["b_zero"] = agrs[-1] + sum(max(0.0, agrs[j] - 2 * f[ids[j + 1]]) for j in range(n - 1)) + 2 * ends
        elif par.zero == 2 and dp > 1:  # every micro-batch reduce-scatters its grads during backward
            if lora:
                count = sum(trained[span]) + (head_adapters if last else 0)
            else:
                # the embedding and an LM head (once on a stage holding both), or the score
                count = sum(params[span]) + (m.vocab_size * m.dim / tp if first or (last and not m.score_head) else 0)
                count += head_params(m, tp) if last and m.score_head else 0
            grads = count * gbytes
            bucket = gather_s(min(par.bucket_mb * MIB, grads), dp, dp_link)
            c["b_zero"] = max(bucket, zero_s(gather_s, count, sum(experts[span]), gbytes) - c["b_compute"])
        out.append(c)
    return out


@dataclass
class _Layout:
    """What the pipeline replay and the terms need of one config: per virtual stage f/b seconds."""

    cfg: object
    dp: int
    micro: int
    stages: list
    f: tuple
    b: tuple
    p2p: float = 0.0
    schedule: tuple = ()  # (name, pp, vpp, micro-batches) when pp > 1


def _layout(cfg, cluster, world_size: int) -> _Layout:
    cfg = with_score_head(cfg)  # a reward model's scalar head in place of the LM head (megaft.perf.head)
    m, par = cfg.model, cfg.parallel
    dp, micro, schedule = _schedule_of(cfg, world_size)
    stages = _stage_costs(cfg, cluster, dp)
    f = tuple(c["f_compute"] + c["f_tp"] + c["f_cp"] + c["f_ep"] + c["f_zero"] for c in stages)
    b = tuple(c["b_compute"] + c["b_tp"] + c["b_cp"] + c["b_ep"] + c["b_zero"] for c in stages)
    out = _Layout(cfg, dp, micro, stages, f, b)
    if par.pp > 1:
        tokens = objective_terms(cfg).rows * cfg.train.micro_batch_size * cfg.data.seq_len // par.cp
        seq_share = par.tp if par.sequence_parallel else 1
        nbytes = tokens / seq_share * m.dim * p2p_bytes(str(cfg.precision))
        out.p2p = p2p_s(nbytes, group_link(cluster, par.pp, par.tp * par.cp * dp))
        out.schedule = schedule
    return out


def _schedule_of(cfg, world_size: int) -> tuple[int, int, tuple]:
    """(dp, micro-batches per step, the pipeline schedule's key: (name, pp, vpp, micro), () at pp = 1)."""
    par = cfg.parallel
    dp = resolve_dp(par, world_size)
    micro = max(accumulation_steps(cfg.train, dp), 1)
    return dp, micro, (("interleaved" if par.vpp > 1 else par.schedule, par.pp, par.vpp, micro) if par.pp > 1 else ())


def _pipelines(lays: list[_Layout]) -> list[tuple[float, tuple]]:
    """(makespan, busy per rank) of each layout: one replay per schedule for all layouts
    that share it (megaft.pipeline.simulate.replay_many), pp = 1 in closed form."""
    out: list = [None] * len(lays)
    groups: dict = {}
    for i, lay in enumerate(lays):
        if lay.schedule:
            groups.setdefault(lay.schedule, []).append(i)
        else:
            out[i] = (lay.micro * (lay.f[0] + lay.b[0]), (lay.micro * (lay.f[0] + lay.b[0]),))
    for (name, pp, vpp, micro), idx in groups.items():
        makespan, busy = replay_many(build_schedule(name, pp, micro, vpp), np.array([lays[i].f for i in idx]),
                                     np.array([lays[i].b for i in idx]), np.array([lays[i].p2p for i in idx]))
        for j, i in enumerate(idx):
            out[i] = (float(makespan[j]), tuple(float(x) for x in busy[j]))
    return out


def step_costs(cfgs: list, cluster, world_size: int, workers: int = 1) -> list[StepCost]:
    """The predicted step of each validated config (megaft.config.Config) on `world_size`
    ranks of `cluster` (megaft.config.cluster.ClusterConfig); the planner costs its layouts
    together so that configs sharing a pipeline schedule share one replay. `workers` > 1:
    the schedules' groups are shared out over that many processes (megaft.forks), with the
    same numbers: a layout's cost does not depend on the others costed with it."""
    if workers > 1 and len(cfgs) > 1:
        parts = _share_out(cfgs, world_size, workers)
        out: list = [None] * len(cfgs)
        costed = fork_map(lambda idx: step_costs([cfgs[i] for i in idx], cluster, world_size), parts)
        for idx, costs in zip(parts, costed):
            for i, cost in zip(idx, costs):
                out[i] = cost
        return out
    lays = [_layout(cfg, cluster, world_size) for cfg in cfgs]
    return [_step(lay, cluster, world_size, makespan, busy)
            for lay, (makespan, busy) in zip(lays, _pipelines(lays))]


def _share_out(cfgs: list, world_size: int, workers: int) -> list[list[int]]:
    """Indices of `cfgs` in at most `workers` parts of about equal work, each schedule's
    layouts in one part (they share a replay): the largest groups first, each to the part
    with the least work so far. Work, in microseconds measured on a 2-core EPYC: ~100 per
    layout, ~5 per action of a replay (4 per micro-batch and virtual stage)."""
    groups: dict = {}
    for i, cfg in enumerate(cfgs):
        groups.setdefault(_schedule_of(cfg, world_size)[2] or i, []).append(i)  # pp = 1: no replay to share
    work = {key: 100 * len(idx) + (20 * key[1] * key[2] * key[3] if isinstance(key, tuple) else 0)
            for key, idx in groups.items()}
    parts: list[list[int]] = [[] for _ in range(min(workers, len(groups)))]
    load = [0] * len(parts)
    for key in sorted(groups, key=lambda k: -work[k]):  # stable: ties keep the layouts' order
        p = load.index(min(load))
        parts[p] += groups[key]
        load[p] += work[key]
    return [sorted(idx) for idx in parts if idx]


def step_cost(cfg, cluster, world_size: int) -> StepCost:
    """The predicted step of one config (step_costs of one)."""
    return step_costs([cfg], cluster, world_size)[0]


def _step(lay: _Layout, cluster, world_size: int, makespan: float, busy: tuple) -> StepCost:
    cfg, par, micro = lay.cfg, lay.cfg.parallel, lay.micro
    rank = max(range(par.pp), key=lambda r: busy[r])
    mine = [lay.stages[s] for s in range(rank, len(lay.stages), par.pp)]
    terms = dict.fromkeys(TERMS, 0.0)
    terms["compute"] = micro * sum(c["f_compute"] + c["b_compute"] for c in mine)
    terms["tp_comm"] = micro * sum(c["f_tp"] + c["b_tp"] for c in mine)
    terms["cp_comm"] = micro * sum(c["f_cp"] + c["b_cp"] for c in mine)
    terms["ep_comm"] = micro * sum(c["f_ep"] + c["b_ep"] for c in mine)
    terms["zero_comm"] = micro * sum(c["f_zero"] + c["b_zero"] for c in mine)
    terms["pp_bubble"] = makespan - busy[rank]
    terms["overhead"] = cluster.step_overhead_s  # outside every phase: data, logging (calibrated)
    _add_dp_terms(terms, cfg, cluster, lay.dp * par.cp, lay)  # gradients reduce over dp×cp
    rows = objective_terms(cfg).rows
    return StepCost(terms=terms, tokens_per_step=rows * cfg.train.global_batch_size * cfg.data.seq_len,
                    world_size=world_size,
                    flops_per_token=flops_per_token(cfg.model, cfg.data.seq_len, cfg.lora),
                    peak_tflops=cluster_peak_tflops(cluster, str(cfg.precision)))


def _add_dp_terms(terms: dict, cfg, cluster, dp: int, lay: _Layout) -> None:
    """dp_comm, param_gather, optimizer and offload of the fullest pp rank (`dp`: the dp×cp replicas)."""
    par = cfg.parallel
    ranks = trainable_rank_params(cfg.model, par, cfg.lora)  # under LoRA: the adapters
    r = max(range(par.pp), key=lambda i: ranks[i])  # the fullest pp rank
    # one micro-batch's backward and forward on that rank (its virtual stages r, r + pp, ...)
    last_backward, first_forward = (sum(x[r::par.pp]) for x in (lay.b, lay.f))
    params = ranks[r]
    # its routed experts (ep > 1), whose grads reduce and shards span the dp×cp/ep expert replicas
    expert = 0 if par.ep == 1 or cfg.lora.rank > 0 else rank_expert_params(
        cfg.model, tp=par.tp, pp=par.pp, vpp=par.vpp, pp_layers=par.pp_layers, ep=par.ep)[r]
    wbytes = 2 if cfg.optim.master_weights else 4
    gbytes = 2 if par.grad_compression == "bf16" else 4
    link = group_link(cluster, dp, par.tp)
    if dp > 1 and par.zero in (0, 1):
        reduce = _over_replicas(all_reduce_s if par.zero == 0 else gather_s, params, expert, gbytes, cluster, par, dp)
        bucket = (all_reduce_s if par.zero == 0 else gather_s)(min(par.bucket_mb * MIB, params * gbytes), dp, link)
        hidden = par.pp == 1 or cluster.dp_overlap  # megaft reduces after the schedule at pp > 1
        terms["dp_comm"] = max(bucket, reduce - last_backward) if hidden else reduce
    terms["dp_comm"] += tied_grad_s(cfg, cluster, dp)
    if dp > 1 and par.zero in (1, 2):
        terms["param_gather"] = _over_replicas(gather_s, params, expert, wbytes, cluster, par, dp)
        if cluster.dp_overlap:  # behind the next step's first forward, bucket by bucket
            bucket = gather_s(min(par.bucket_mb * MIB, params * wbytes), dp, link)
            terms["param_gather"] = max(bucket, terms["param_gather"] - first_forward)
    owned = params / (dp if par.zero >= 1 else 1)
    if expert and par.zero >= 1:  # the experts' Adam state is sharded over their own replicas
        owned = (params - expert) / dp + expert / max(dp // par.ep, 1)
    if par.offload == "cpu":
        pcie = owned * 4 / (cluster.pcie_gbps * 1e9)  # grads down and masters up, one direction each
        host = owned * ADAM_BYTES / (cluster.host_memory_gbps * 1e9 / cluster.gpus_per_node)
        terms["offload"] = max(pcie, host)
    else:
        terms["optimizer"] = owned * ADAM_BYTES / (cluster_hbm_tbps(cluster) * 1e12) * cluster.optimizer_scale
    if cfg.optim.name == "muon":
        _add_muon_terms(terms, cfg, cluster, dp, r)


def tied_grad_s(cfg, cluster, dp: int) -> float:
    """Seconds of the tied embedding's gradient all-reduce between its copies on the first and the last pp
    rank (megaft.pipeline.stage.sync_tied_grads): this tp rank's vocab/tp × dim slice, at the gradient bytes
    the dp reduction moves, over two ranks (pp−1)·tp·dp apart (`dp`: the dp×cp replicas); 0 at pp = 1,
    untied, with a score head (no tied head) or under LoRA (the frozen embedding has no gradient)."""
    m, par = cfg.model, cfg.parallel
    if par.pp <= 1 or not m.tie_embeddings or m.score_head or cfg.lora.rank > 0:
        return 0.0
    gbytes = 2 if par.grad_compression == "bf16" else 4
    link = group_link(cluster, 2, (par.pp - 1) * par.tp * dp)
    return all_reduce_s(-(-m.vocab_size // par.tp) * m.dim * gbytes, 2, link)


def _add_muon_terms(terms: dict, cfg, cluster, dp: int, r: int) -> None:
    """optim.name=muon on pp rank `r` (megaft.perf.muon): the Newton-Schulz FLOPs in the optimizer
    term, the updates' all-gather over tp in tp_comm, ZeRO's extra all-gather in param_gather, and under
    offload the updates' trip to the device and back in offload."""
    m, par = cfg.model, cfg.parallel
    ids = rank_layer_ids(m, pp=par.pp, vpp=par.vpp, pp_layers=par.pp_layers)[r]
    share = dp if par.zero >= 1 and dp > 1 else 1  # under ZeRO a rank orthogonalises the matrices its chunk holds
    rate = compute_rates(cluster, "bf16").rate  # Newton-Schulz runs in bf16
    steps = cfg.optim.muon.ns_steps
    lora = cfg.lora if cfg.lora.rank else None  # only the adapters train (and take Muon)
    terms["optimizer"] += sum(block_ns_flops(m, steps, i, par.ep, lora) for i in ids) / share / rate
    if par.tp > 1:
        link = group_link(cluster, par.tp)
        terms["tp_comm"] += sum(gather_s(rows * cols * 4, par.tp, link)
                                for i in ids for rows, cols in tp_gathered(m, i, par.ep, lora, par.tp)) / share
    elements = sum(block_matrix_elements(m, i, par.ep, lora) for i in ids)
    if share > 1:
        terms["param_gather"] += gather_s(elements // par.tp * 4, dp, group_link(cluster, dp, par.tp))
    if par.offload == "cpu":  # the host's momentum updates go up (fp32), the orthogonalised come back (bf16)
        terms["offload"] += muon_offload_bytes(elements // par.tp // share) / (cluster.pcie_gbps * 1e9)
