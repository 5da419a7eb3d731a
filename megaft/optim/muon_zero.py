"""Muon under ZeRO 1-3 (optim.name=muon, parallel.zero>=1): the flat chunks mapped back to matrices.

A rank owns one chunk of every bucket (megaft.optim.zero), and a bucket holds whole parameters,
so a Muon matrix lies in one bucket, possibly across several ranks' chunks. Each step:

  AdamW on the owned chunk's non-Muon element ranges (one multi-tensor call)
  -> the owned Muon elements' momentum and (nesterov) update, elementwise, as one process
  -> one all-gather of each bucket holding Muon matrices: every rank sees every whole update
  -> each rank orthogonalises only the matrices its chunk intersects (tp shards gathered
     whole first: megaft.optim.muon.orthogonalise) and applies its owned elements of the result
  -> stages 1, 2: the usual all-gather of the params (stage 3 gathers per layer).

So no matrix is orthogonalised from a shard and none falls back to AdamW; the cost is one
extra all-gather of the Muon buckets (the same bytes as the params' all-gather) and the
Newton-Schulz of a matrix that straddles two chunks computed on both owners.
"""
from __future__ import annotations

import torch

from megaft.config.optim import OptimConfig
from megaft.optim.muon import adamw_pieces_, apply_update_, host_pieces, momentum_only_ids, orthogonalise, update_scale
from megaft.optim.zero import ShardedAdamW
from megaft.parallel.comm import Group, all_gather_single, group_size
from megaft.parallel.tensor.shard import shard_of


class ShardedMuon(ShardedAdamW):
    """ShardedAdamW with `split["muon"]`'s matrices (megaft.optim.muon.muon_split) on Muon: their
    momentum in the owned exp_avg elements, the update as the module docstring says."""

    def __init__(self, flat, cfg: OptimConfig, dp_group: Group, *, split: dict[str, dict], tp_group: Group = None,
                 **kw):
        super().__init__(flat, cfg, dp_group, **kw)
        self.tp_group = tp_group
        muon = momentum_only_ids(flat, split)
        # per chunk: its fp32 master (master weights; the host master under offload) and host grad copy
        masters = self.host.masters if self.host is not None else self.master_chunks
        self.chunk_state = [(masters[i] if masters else None, self.host.host_grads[i] if self.host else None)
                            for i in range(len(self.chunks))]
        self.pieces, self.matrices = [], []  # AdamW ranges; per chunk: its bucket's Muon matrices
        for (b, param, grad, m, v), (lo, hi), (master, host_grad) in zip(self.chunks, self.ranges, self.chunk_state):
            decay = flat.groups[b.group].weight_decay
            mats = [(off, p.shape, shard_of(p)) for p, off in zip(b.params, b.offsets) if id(p) in muon]
            self.matrices.append(mats)
            cuts = [0]  # the chunk's element ranges between its Muon pieces
            for off, shape, _ in sorted(mats, key=lambda x: x[0]):
                a, z = max(off, lo) - lo, min(off + shape.numel(), hi) - lo
                if a < z:
                    cuts += [a, z]
            cuts.append(hi - lo)
            if flat.groups[b.group].momentum_only:  # its padding is zero and stays so: no AdamW, no exp_avg_sq
                continue
            self.pieces += [(param[a:z], grad[a:z], m[a:z], v[a:z], decay, None if master is None else master[a:z],
                             None if host_grad is None else host_grad[a:z])
                            for a, z in zip(cuts[::2], cuts[1::2]) if z > a]
        self.host_pieces = host_pieces(self.pieces, cfg) if self.host is not None else None

    @torch.no_grad()
    def step(self, lr: float) -> None:
        self.step_count += 1
        adamw_pieces_(self.pieces, self.host_pieces, self.cfg, step=self.step_count, lr=lr)
        mu = self.cfg.muon
        decay = self.cfg.weight_decay if mu.weight_decay is None else mu.weight_decay
        for (b, param, grad, m, _), group, (lo, hi), mats, (master, host_grad) in zip(
                self.chunks, self.groups, self.ranges, self.matrices, self.chunk_state):
            if not mats:
                continue
            send = torch.zeros_like(param, dtype=torch.float32)  # on the device: the all-gather's
            owned = []
            for off, shape, spec in mats:  # the owned elements' momentum and update, elementwise
                a, z = max(off, lo) - lo, min(off + shape.numel(), hi) - lo
                if a < z:
                    g = grad[a:z].float()  # bf16 under master weights
                    if host_grad is not None:  # offload: the momentum is on the host
                        g = host_grad[a:z].copy_(g)
                    m[a:z].lerp_(g, 1 - mu.momentum)
                    send[a:z] = g.lerp(m[a:z], mu.momentum) if mu.nesterov else m[a:z]
                    owned.append((off, shape, spec, a, z))
            whole = send
            if group_size(group) > 1:
                whole = torch.empty(b.numel, dtype=send.dtype, device=send.device)
                all_gather_single(whole, send, group=group)
            for off, shape, spec, a, z in owned:  # orthogonalised whole, the owned elements applied
                update = whole[off - b.start:off - b.start + shape.numel()].view(shape)
                out, full = orthogonalise(update, spec, self.tp_group, mu)
                piece = out.reshape(-1)[a + lo - off:z + lo - off]
                apply_update_(param[a:z], None if master is None else master[a:z], piece, lr=lr, decay=decay,
                              scale=update_scale(full, mu.scale))
        if self.stage < 3:
            self.gather_params()
