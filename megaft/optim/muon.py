"""Muon (Keller Jordan 2024; torch.optim.Muon) on the hidden 2-D weights, AdamW on the rest.

Which parameters take Muon (`muon_split`): every 2-D weight of the decoder layers (attention
and MLP projections). AdamW keeps the embedding and the head (their rows are per-token
lookups and logits, not a linear map whose singular values Muon equalises; Moonlight and
torch.optim.Muon's docs keep them on AdamW), norms and biases (1-D: no matrix), and MoE
routers (a small logit map whose per-expert scale the load balance reads). Under LoRA only
the adapters train: each A and B is a Muon matrix (a column linear's B and a row linear's A are
tp shards, gathered whole as the weights are); on a mixture of experts each routed expert's A and
B in the [E, ...] adapter stacks (megaft.peft.experts: orthogonalised expert by expert, as the
expert weights), the router's adapter on AdamW with the router (a submodule of it).
Layouts: any dp at ZeRO 0 (every rank orthogonalises the same reduced gradient), ZeRO 1-3 (megaft.optim.muon_zero), tp
(`orthogonalise`: each shard's update all-gathered whole over tp, Newton-Schulz on every tp
rank, the rank's rows or columns kept; tp > n_kv_heads: the copied k/v heads once each, as one process
holds them), pp (each stage's matrices are whole), cp (replicated
weights, as dp), ep; optim.master_weights (bf16 params and grads: the fp32 master takes torch.optim.Muon's
update with the grad upcast, the momentum fp32, the param the master rounded: `apply_update_`);
parallel.offload=cpu (the momentum and masters on the host with AdamW's state: the grads come down, the
update goes up for Newton-Schulz on the device, the result comes back to the host master: `muon_update_`).

The update is torch.optim.Muon's, op for op (so fp32 runs equal it bitwise): the momentum
buffer B <- lerp(B, g, 1 - mu), nesterov U = lerp(g, B, mu) (else B), U orthogonalised by
`ns_steps` quintic Newton-Schulz iterations in bf16, then p <- p (1 - lr wd) - lr' U with
lr' = lr * sqrt(max(1, rows/cols)) (scale=original) or lr * 0.2 sqrt(max(rows, cols))
(scale=match_rms_adamw). optim.muon.ns_backend picks the Newton-Schulz kernel (megaft.kernels.newton_schulz):
torch (the default: torch.optim.Muon's ops, bitwise), triton (the symmetric products as half GEMMs), auto.

State layout: the Muon matrices lie in flat buffers of their own (FlatParams' `momentum_only`:
`flat_split`), whose optimizer state is one buffer, the momentum, in AdamW's exp_avg slot of the
same flat elements; their exp_avg_sq is empty (no bytes). Checkpoints (and their resharding) carry
the momentum as they carry exp_avg, by parameter name; a checkpoint saved before the Muon matrices
had buffers of their own (their momentum in exp_avg, a zero exp_avg_sq beside it) has another buffer
layout and loads through the resharding path (megaft.checkpoint.reshard), momentum included.
"""
from __future__ import annotations

import math
import sys

import torch

from megaft.config.optim import OptimConfig
from megaft.kernels.newton_schulz import newton_schulz
from megaft.kernels.newton_schulz.reference import zeropower_via_newtonschulz  # noqa: F401 (re-exported)
from megaft.optim.adamw import AdamW, adamw_update_
from megaft.optim.offload import HostAdamW
from megaft.parallel.comm import Group, all_gather, group_rank, group_size
from megaft.parallel.tensor.shard import shard_of

_ADAMW_PREFIXES = ("embed_tokens.", "lm_head.")  # the vocabulary-sized matrices


def takes_muon(name: str, param: torch.nn.Parameter) -> bool:
    """Whether parameter `name` is a hidden 2-D weight, or a 3-D stack of routed experts' matrices
    (`experts.gate_proj` [E, F, dim]...: each expert's matrix its own), module docstring."""
    if name.startswith(_ADAMW_PREFIXES) or "router" in name or "shared_expert_gate" in name:
        return False
    return param.dim() == 2 or (param.dim() == 3 and ".experts." in name)


def muon_split(model: torch.nn.Module) -> dict[str, dict]:
    """{"muon": {name: param}, "adamw": {name: param}} of the trainable parameters. A MoE router
    (megaft.models.moe.router.Router, `mlp.gate`) stays on AdamW."""
    from megaft.models.moe.router import Router

    routers = {id(p) for m in model.modules() if isinstance(m, Router) for p in m.parameters()}
    out = {"muon": {}, "adamw": {}}
    for name, p in model.named_parameters():
        if p.requires_grad:
            out["muon" if id(p) not in routers and takes_muon(name, p) else "adamw"][name] = p
    return out


def split_sizes(split: dict[str, dict]) -> dict[str, dict[str, int]]:
    """{"muon": {name: numel}, "adamw": {name: numel}} of a muon_split."""
    return {k: {n: p.numel() for n, p in v.items()} for k, v in split.items()}


def split_record(sizes: dict[str, dict[str, int]], pp_group: Group = None, *, log: bool = False) -> dict:
    """summary.json's `optimizer` from split_sizes, united over the pp stages (a tied copy once):
    counts, sizes and names of each side, the same at every layout (the peers' silent fallback
    to AdamW would show as fewer Muon matrices than at one process). `log`: print it to stderr."""
    if group_size(pp_group) > 1:
        stages = [None] * group_size(pp_group)
        torch.distributed.all_gather_object(stages, sizes, group=pp_group)
        sizes = {k: {n: m for st in stages for n, m in st[k].items()} for k in sizes}
    rec = {"name": "muon", **{f"{k}_params": len(v) for k, v in sizes.items()},
           **{f"{k}_numel": sum(v.values()) for k, v in sizes.items()}, **{k: sorted(v) for k, v in sizes.items()}}
    if log:
        print(f"optim.name=muon: {rec['muon_params']} matrices ({rec['muon_numel']} params) on Muon, "
              f"{rec['adamw_params']} tensors ({rec['adamw_numel']} params) on AdamW: {', '.join(rec['adamw'])}",
              file=sys.stderr, flush=True)
    return rec


def update_scale(shape: torch.Size, rule: str) -> float:
    """The factor on lr of a Muon update of a `shape` matrix (module docstring); a stack's: of its matrices."""
    rows, cols = shape[-2:]
    return math.sqrt(max(1, rows / cols)) if rule == "original" else 0.2 * math.sqrt(max(rows, cols))


def orthogonalise(update: torch.Tensor, spec, tp_group: Group, mu) -> tuple[torch.Tensor, torch.Size]:
    """(this rank's rows or columns of the whole matrix's Newton-Schulz result, the whole shape).
    A tp shard (`spec`, megaft.parallel.tensor.shard) is gathered over tp first: the
    orthogonalisation needs the whole matrix (every tp rank computes it; module docstring); a copied
    kv head's gather (megaft.models.attention.kv_heads) is deduplicated to each head once."""
    tp = group_size(tp_group)
    whole = all_gather(update, spec.dim, tp_group) if spec is not None and tp > 1 else update
    if whole is not update and getattr(spec, "replicas", 1) > 1:
        from megaft.models.attention.kv_heads import dedupe_gathered

        # copied kv heads (tp > n_kv_heads): the gather repeats each head's rows; the matrix one process
        # holds (and torch.optim.Muon orthogonalises) has each head once, and the rank keeps its head's rows
        whole = dedupe_gathered(whole, spec, tp)
    out = newton_schulz(whole, mu.ns_a, mu.ns_b, mu.ns_c, mu.ns_steps, mu.eps, backend=mu.ns_backend)
    if whole is not update:
        lo, hi = spec.bounds(group_rank(tp_group), tp)
        out = out.narrow(spec.dim, lo, hi - lo)
    return out, whole.shape


@torch.no_grad()
def apply_update_(param: torch.Tensor, master, update: torch.Tensor, *, lr: float, decay: float,
                  scale: float) -> None:
    """p <- p (1 - lr wd) - lr scale O on the fp32 master (`master`: optim.master_weights, or the host
    copy under offload; None: the param is its own), then the param := the master (bf16: rounded to
    nearest even, as AdamW's master path)."""
    target = param if master is None else master
    target.mul_(1 - lr * decay)
    target.add_(update.to(target.device), alpha=-lr * scale)
    if master is not None:
        param.copy_(master)


@torch.no_grad()
def muon_update_(items, cfg: OptimConfig, *, lr: float, tp_group: Group = None) -> None:
    """One Muon step on every (param, grad, momentum, TPShard, master) matrix (module docstring);
    tp shards are orthogonalised whole (`orthogonalise`). `master` None: an fp32 param updated in
    place; else the fp32 master is (torch.optim.Muon on it with the grad upcast: a bf16 grad, or its
    fp32 host copy under offload, where the momentum lives too) and Newton-Schulz runs on the param's
    device (under offload: the update goes up, the orthogonalised one comes back, apply_update_)."""
    mu = cfg.muon
    decay = cfg.weight_decay if mu.weight_decay is None else mu.weight_decay
    for param, grad, buf, spec, master in items:
        grad = grad.float()  # bf16 grads under master weights; fp32 ones: the same tensor
        buf.lerp_(grad, 1 - mu.momentum)
        update = grad.lerp(buf, mu.momentum) if mu.nesterov else buf
        update, shape = orthogonalise(update.to(param.device), spec, tp_group, mu)
        apply_update_(param, master, update, lr=lr, decay=decay, scale=update_scale(shape, mu.scale))


class MuonAdamW(AdamW):
    """AdamW's flat buffers and state (plain dp, ZeRO stage 0), with `split["muon"]`'s
    parameters (muon_split) updated by Muon: their momentum in exp_avg's elements, AdamW on
    every other element range of the buffers (one multi-tensor call, as AdamW's). Master weights
    and offload as AdamW's: the masters (host masters, host grad copies) cut like the buffers."""

    def __init__(self, flat, cfg: OptimConfig, *, split: dict[str, dict], tp_group: Group = None, **kw):
        super().__init__(flat, cfg, **kw)
        self.tp_group = tp_group
        muon = momentum_only_ids(flat, split)
        masters = self.host.masters if self.host is not None else self.masters  # [] for fp32 params on the device
        host_grads = self.host.host_grads if self.host is not None else []
        # (param, grad, momentum, TPShard, master) views; the (data, grad, m, v, decay, master, host grad)
        # ranges between them; (host grad, grad) of the Muon matrices under offload
        self.matrices, self.pieces, self.downloads = [], [], []
        for i, (g, m, v) in enumerate(zip(flat.groups, self.exp_avg, self.exp_avg_sq)):
            master = masters[i] if masters else None
            host_grad = host_grads[i] if host_grads else None
            cuts = [0]  # element ranges between the Muon matrices
            for p in sorted(g.params, key=lambda p: p.data.data_ptr()):
                lo = (p.data.data_ptr() - g.data.data_ptr()) // g.data.element_size()
                if id(p) in muon:
                    at = slice(lo, lo + p.numel())
                    grad = p.grad if host_grad is None else host_grad[at].view_as(p)
                    self.matrices.append((p.data, grad, m[at].view_as(p), shard_of(p),
                                          None if master is None else master[at].view_as(p)))
                    if host_grad is not None:
                        self.downloads.append((grad, p.grad))
                    cuts += [lo, lo + p.numel()]
            cuts.append(g.data.numel())
            self.pieces += [(g.data[a:z], g.grad[a:z], m[a:z], v[a:z], g.weight_decay,
                             None if master is None else master[a:z], None if host_grad is None else host_grad[a:z])
                            for a, z in zip(cuts[::2], cuts[1::2]) if z > a and not g.momentum_only]
        self.host_pieces = host_pieces(self.pieces, cfg) if self.host is not None else None

    @torch.no_grad()
    def step(self, lr: float) -> None:
        self.step_count += 1
        adamw_pieces_(self.pieces, self.host_pieces, self.cfg, step=self.step_count, lr=lr)
        for host_grad, grad in self.downloads:  # offload: the Muon grads to the host (blocking: used next)
            host_grad.copy_(grad)
        muon_update_(self.matrices, self.cfg, lr=lr, tp_group=self.tp_group)


def momentum_only_ids(flat, split: dict[str, dict]) -> set[int]:
    """The ids of split["muon"]'s parameters, checked to lie in FlatParams' momentum-only buffers
    (their one state buffer: module docstring), as `flat_split` builds them."""
    muon = {id(p) for p in split["muon"].values()}
    held = {id(p) for g in flat.groups if g.momentum_only for p in g.params}
    if muon != held:
        raise ValueError(f"{len(muon - held)} Muon matrices outside FlatParams' momentum-only buffers and "
                         f"{len(held - muon)} other params in them; fix: build FlatParams with "
                         "momentum_only=split['muon'].values() (megaft.optim.muon.flat_split)")
    return muon


def flat_split(split: dict[str, dict]) -> dict:
    """FlatParams' keyword for a muon_split: the Muon matrices in buffers of their own."""
    return {"momentum_only": list(split["muon"].values())}


def host_pieces(pieces, cfg: OptimConfig) -> HostAdamW:
    """parallel.offload=cpu: the host AdamW of the element ranges between the Muon matrices (their
    masters, host grads and moments: views into the optimizer's host buffers)."""
    return HostAdamW([p[0] for p in pieces], [p[5] for p in pieces], [p[6] for p in pieces],
                     [p[2] for p in pieces], [p[3] for p in pieces], cfg)


def adamw_pieces_(pieces, host: HostAdamW | None, cfg: OptimConfig, *, step: int, lr: float) -> None:
    """AdamW on the (param, grad, m, v, decay, master, host grad) ranges between the Muon matrices: on
    the host (offload), or one multi-tensor call on the device (on the masters under master weights)."""
    if host is not None:
        host.step_([p[1] for p in pieces], [p[4] for p in pieces], step=step, lr=lr)
        return
    masters = [p[5] for p in pieces]
    adamw_update_([p[:5] for p in pieces], cfg, step=step, lr=lr,
                  masters=masters if pieces and masters[0] is not None else None)
