"""ZeRO stages 1-3 (Rajbhandari et al. 2020): AdamW state sharded over dp.

Every FlatParams bucket is padded to a multiple of dp and split into dp equal
chunks; this rank owns chunk `dp_rank` of every bucket (Megatron's distributed
optimizer layout), so a bucket's reduce-scatter lands exactly on the owned chunk.

  stage 1: Adam moments (exp_avg, exp_avg_sq) only for the owned chunks; the
           full gradient buffer stays (the reduced chunk is copied into it).
  stage 2: also no full gradient buffer; gradients live as the owned chunks only
           (megaft.parallel.data.buckets moves each .grad into a scratch bucket).
  stage 3: also the parameters: the owned chunks are the only persistent copy, and
           each layer is gathered just while it runs (megaft.optim.zero3).
After the update (stages 1, 2) each bucket's params are all-gathered from their owners.

In fp32 the parameters are the master weights (no extra copy), so the bytes held
per parameter are: stage 0: 4 + 4 + 8; stage 1: 4 + 4 + 8/dp; stage 2: 4 + (4 + 8)/dp;
stage 3: (4 + 4 + 8)/dp
(params + grads + Adam moments; the paper's K = 12 becomes 8 without a separate
fp32 master copy). bf16 autocast keeps fp32 weights, so the same formula holds.

`optim.master_weights=true` (precision=bf16) is the paper's mixed precision: bf16
params and grads in the flat buffers, fp32 masters and moments (K = 12) for the owned
chunks: stage 0: 2 + 2 + 12; stage 1: 2 + 2 + 12/dp; stage 2: 2 + (2 + 12)/dp; stage 3:
(2 + 2 + 12)/dp (under offload the host masters are the masters). The dp reduction runs
in fp32 (megaft.parallel.data.buckets upcasts each bucket) and the reduced gradient is
rounded to bf16 once; micro-batches accumulate in the bf16 grads (ZeRO's 2 bytes).
After the update each owned chunk of params is its master rounded to nearest even,
then all-gathered (stage 3: gathered per layer) in bf16 as usual.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from megaft.config.optim import OptimConfig
from megaft.optim.adamw import adamw_update_, state_bytes
from megaft.optim.offload import HostAdamW, host_zeros
from megaft.parallel.comm import Group, all_gather_single, all_reduce, group_rank, group_size
from megaft.parallel.data.buckets import chunk_range
from megaft.parallel.data.flat import FlatParams
from megaft.parallel.tensor.shard import is_sequence_parallel, shard_of

# Kinds of gradient segments for the norm: tp-sharded (sum over tp), replicated
# over tp (count once), or left out (the last pp stage's tied embedding copy).
SHARDED, REPLICATED, SKIP = "tp", "rep", "skip"


class ShardedAdamW:
    """AdamW over this rank's chunks of every bucket (ZeRO stage 1 or 2)."""

    def __init__(self, flat: FlatParams, cfg: OptimConfig, dp_group: Group, *, stage: int,
                 norm_params: Optional[list] = None, offload: bool = False, expert_group: Group = None):
        self.flat, self.cfg, self.stage, self.group, self.step_count = flat, cfg, stage, dp_group, 0
        self.offload = offload  # masters and moments on the host (megaft.optim.offload)
        self.dp, self.dp_rank = group_size(dp_group), group_rank(dp_group)
        self.buckets = flat.buckets
        # each bucket's sharding group: routed experts split over ep are sharded over their replicas
        self.groups = [expert_group if flat.groups[b.group].expert else dp_group for b in self.buckets]
        self.scaler = None
        self.gatherer = None  # stage 3: megaft.optim.zero3.ParamGatherer (set by build_optimizer)
        counted = {id(p) for p in (flat.params if norm_params is None else norm_params)}
        # One flat moment (and, stage 2, grad) tensor per group; per-bucket chunk views into them.
        self.ranges = [chunk_range(b, group_size(g), group_rank(g)) for b, g in zip(self.buckets, self.groups)]
        sizes = [sum(hi - lo for (lo, hi), b in zip(self.ranges, self.buckets) if b.group == gi)
                 for gi in range(len(flat.groups))]
        device = self.device = flat.groups[0].data.device if flat.groups else torch.device("cpu")
        state = (lambda n: host_zeros(n, device)) if offload else (lambda n: torch.zeros(n, device=device))
        self.exp_avg = [state(n) for n in sizes]
        # a momentum-only group (Muon's matrices, megaft.parallel.data.flat) keeps no second moment
        self.exp_avg_sq = [state(0 if g.momentum_only else n) for g, n in zip(flat.groups, sizes)]
        dtype = flat.groups[0].data.dtype if flat.groups else torch.float32  # bf16 under master_weights
        self.shard_grads = [torch.zeros(n, dtype=dtype, device=device) for n in sizes] if stage >= 2 else []
        self.masters = [state(n) for n in sizes] if cfg.master_weights else []  # on the host under offload
        self.master_chunks = []  # per chunk: its fp32 master (a view into masters), laid out like the moments
        self.chunks = []  # (bucket, param view, grad view, exp_avg view, exp_avg_sq view)
        used, views = [0] * len(flat.groups), []
        for b, (lo, hi) in zip(self.buckets, self.ranges):
            g, at = flat.groups[b.group], used[b.group]
            view = slice(at, at + hi - lo)
            views.append(view)
            grad = self.shard_grads[b.group][view] if stage >= 2 else g.grad[lo:hi]
            # stage 3 frees the full buffers: the owned chunk is a tensor of its own (the master copy)
            param = g.data[lo:hi].clone() if stage == 3 else g.data[lo:hi]
            self.chunks.append((b, param, grad, self.exp_avg[b.group][view], self.exp_avg_sq[b.group][view]))
            if self.masters:
                self.master_chunks.append(self.masters[b.group][view])
                self.master_chunks[-1].copy_(param)  # the bf16 params upcast (exact)
            used[b.group] += hi - lo
        self.host = None
        if offload:  # host master and grad copies of the owned chunks, laid out like the moments
            masters = self.masters or [host_zeros(n, device) for n in sizes]
            grads = [host_zeros(n, device) for n in sizes]
            pieces = [(masters[b.group][v], grads[b.group][v]) for (b, *_), v in zip(self.chunks, views)]
            self.host = HostAdamW([c[1] for c in self.chunks], [m for m, _ in pieces], [g for _, g in pieces],
                                  [c[3] for c in self.chunks], [c[4] for c in self.chunks], cfg)
        self.segments = [self._segments(b, lo, hi, counted) for b, (lo, hi) in zip(self.buckets, self.ranges)]

    @staticmethod
    def _segments(bucket, lo: int, hi: int, counted: set) -> list[tuple[int, int, str, bool, float]]:
        """(start, stop within the chunk, norm kind, sequence-parallel, weight of its squares in the
        norm) of each param piece in [lo, hi); kv heads copied over tp count 1/copies each."""
        out = []
        for p, off in zip(bucket.params, bucket.offsets):
            a, z = max(off, lo), min(off + p.numel(), hi)
            if a < z:
                spec = shard_of(p)
                kind = SKIP if id(p) not in counted else (REPLICATED if spec is None else SHARDED)
                out.append((a - lo, z - lo, kind, is_sequence_parallel(p), 1.0 / getattr(spec, "replicas", 1)))
        return out

    @property
    def chunk_grads(self) -> list[torch.Tensor]:
        """Where each bucket's reduced chunk lands (megaft.parallel.data.buckets.GradReducer)."""
        return [c[2] for c in self.chunks]

    @property
    def grads(self) -> list[torch.Tensor]:
        """The gradients the step applies (owned chunks), for clipping and inf checks."""
        return self.chunk_grads

    @torch.no_grad()
    def sync_sequence_parallel(self, tp_group: Group) -> None:
        """Sum sequence-parallel params' partial grads over tp, on the owned chunks: the
        tp ranks of one dp rank share a layout, and the tp and dp sums commute."""
        if group_size(tp_group) == 1:
            return
        pieces = [c[2][a:z] for c, segs in zip(self.chunks, self.segments) for a, z, _, sp, _ in segs if sp]
        if not pieces:
            return
        flat = all_reduce(torch.cat(pieces).float(), tp_group)  # bf16 grads: summed in fp32, rounded once
        at = 0
        for piece in pieces:
            piece.copy_(flat[at:at + piece.numel()])
            at += piece.numel()

    @torch.no_grad()
    def grad_norm(self, tp_group: Group, pp_group: Group) -> torch.Tensor:
        """Global L2 norm: tp-sharded squares summed over tp, replicated ones once, then
        every chunk summed over dp×cp (each element is owned by one of those ranks: an expert
        split over ep by one of its replicas on one ep rank) and pp."""
        device = self.device  # the grads' (the moments may be on the host: offload)
        sq = {SHARDED: torch.zeros((), device=device), REPLICATED: torch.zeros((), device=device)}
        for c, segs in zip(self.chunks, self.segments):
            for a, z, kind, _, weight in segs:
                if kind != SKIP:
                    sq[kind] += c[2][a:z].float().pow(2).sum() * weight  # bf16 grads: squares summed in fp32
        total = all_reduce(sq[SHARDED], tp_group) + sq[REPLICATED]
        return all_reduce(all_reduce(total, self.group), pp_group).sqrt()

    @property
    def param_shards(self) -> list[torch.Tensor]:
        """The owned chunk of every bucket's parameters (stage 3's only persistent copy)."""
        return [c[1] for c in self.chunks]

    @torch.no_grad()
    def reload_param_shards(self) -> None:
        """After a checkpoint load: stage 3 takes the owned chunks from the (gathered) full buffers;
        offload refreshes the host masters from them."""
        if self.stage == 3:
            for (b, param, *_), (lo, hi) in zip(self.chunks, self.ranges):
                param.copy_(self.flat.groups[b.group].data[lo:hi])
        if self.host is not None and not self.masters:  # master_weights: the checkpoint held the masters
            self.host.reload_masters()

    @contextlib.contextmanager
    def whole_params(self):
        """A context in which every parameter is whole on this rank (evaluation, export):
        ZeRO-3 gathers every layer for its duration (dp ranks may run unequal forwards)."""
        if self.gatherer is not None:
            self.gatherer.acquire_all()
        try:
            yield
        finally:
            if self.gatherer is not None:
                self.gatherer.release_all()

    def zero_grad(self) -> None:
        if self.stage >= 2:
            for g in self.shard_grads:
                g.zero_()
        else:
            self.flat.zero_grad()

    def memory_bytes(self) -> dict[str, int]:
        """Device bytes this rank holds between steps for params, grads and optimizer state;
        `host` the same kinds in host memory (parallel.offload=cpu)."""
        grads = self.shard_grads if self.stage >= 2 else [g.grad for g in self.flat.groups]
        params = self.param_shards if self.stage == 3 else [g.data for g in self.flat.groups]
        gathered = self.gatherer.held_bytes() if self.gatherer is not None else 0  # 0 unless a layer leaked
        out = state_bytes(params, grads, self.masters + self.exp_avg + self.exp_avg_sq, self.host)
        out["params"] += gathered
        return out

    @torch.no_grad()
    def step(self, lr: float) -> None:
        """AdamW on the owned chunks, then all-gather every bucket's params from their owners."""
        self.step_count += 1
        if self.host is not None:
            decays = [self.flat.groups[b.group].weight_decay for b, *_ in self.chunks]
            self.host.step_(self.chunk_grads, decays, step=self.step_count, lr=lr)
        else:
            adamw_update_([(param, grad, m, v, self.flat.groups[b.group].weight_decay)
                           for b, param, grad, m, v in self.chunks], self.cfg, step=self.step_count, lr=lr,
                          masters=self.master_chunks or None)
        if self.stage < 3:  # stage 3 gathers each layer when it runs (megaft.optim.zero3)
            self.gather_params()

    def gather_params(self) -> None:
        """All-gather every bucket's params from their owners (after a stage 1 or 2 update)."""
        gathers = [(c, g) for c, g in zip(self.chunks, self.groups) if group_size(g) > 1]
        sends = [param.clone() for (_, param, *_), _ in gathers]  # the output overlaps the input: copy it
        works = [all_gather_single(self.flat.groups[b.group].data[b.start:b.stop], send, group=g, async_op=True)
                 for ((b, *_), g), send in zip(gathers, sends)]
        for w in works:
            w.wait()


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, *, zero: int, bucket_mb: float, grid,
                    norm_params: Optional[list] = None, compression=None, offload: str = "none",
                    scaler=None, classes=None, momentum_only=()):
    """(FlatParams, optimizer, GradReducer) of one rank for ZeRO stage `zero` (0 to 3);
    stage 3 also installs the per-layer parameter gathering (`optimizer.gatherer`).

    `norm_params`: the params the grad norm counts (pp: all but a tied copy).
    `compression`: the ParallelConfig whose grad_compression/powersgd_* the reducer uses.
    `offload="cpu"`: masters and moments on the host (megaft.optim.offload).
    `scaler`: the fp16 LossScaler, kept by the optimizer so checkpoints save it with its state.
    `classes`: (stage 0's, stages 1-3's) optimizer in AdamW's and ShardedAdamW's place (optim.name=muon:
    megaft.optim.muon, megaft.optim.muon_zero). `momentum_only`: params in buffers of their own whose
    optimizer keeps one state buffer (optim.name=muon: the Muon matrices; megaft.parallel.data.flat)."""
    from megaft.optim.adamw import AdamW
    from megaft.optim.zero3 import ParamGatherer, model_units, unit_params
    from megaft.parallel.data.buckets import GradReducer

    # Gradients and ZeRO shards span the ranks holding the same parameters: dp×cp (cp replicates them),
    # for routed experts split over ep the dp×cp/ep ranks holding the same experts.
    experts = dict(expert_group=grid.expert_replica_group)
    numel = int(bucket_mb * 2 ** 20) // 4  # fp32 gradients (bf16 ones are reduced in fp32 too)
    options = {} if compression is None else dict(
        compression=compression.grad_compression, powersgd_rank=compression.powersgd_rank,
        powersgd_warmup_steps=compression.powersgd_warmup_steps)
    units = model_units(model) if zero == 3 else None
    flat = FlatParams(model, weight_decay=cfg.weight_decay, device=grid.device, bucket_numel=0 if units else numel,
                      multiple=grid.replica_size if zero else 1, keep_grads=zero < 2,
                      units=unit_params(units) if units else None,
                      dtype=torch.bfloat16 if cfg.master_weights else torch.float32,
                      expert_multiple=grid.expert_replicas if zero else 1, momentum_only=momentum_only)
    plain, sharded = classes or (AdamW, ShardedAdamW)
    if zero == 0:
        optimizer = plain(flat, cfg, norm_params=norm_params, offload=offload == "cpu")
        optimizer.scaler = scaler
        return flat, optimizer, GradReducer(flat, grid.replica_group, clock=lambda: optimizer.step_count,
                                            **options, **experts)
    optimizer = sharded(flat, cfg, grid.replica_group, stage=zero, norm_params=norm_params,
                        offload=offload == "cpu", **experts)
    optimizer.scaler = scaler
    reducer = GradReducer(flat, grid.replica_group, zero=min(zero, 2), chunk_grads=optimizer.chunk_grads,
                          clock=lambda: optimizer.step_count, **options, **experts)
    if units:
        optimizer.gatherer = ParamGatherer(flat, units, optimizer.param_shards, grid.replica_group, **experts)
        reducer.after_finish = optimizer.gatherer.end_backward
    return flat, optimizer, reducer
