"""AdamW over FlatParams (plain dp, ZeRO stage 0): one multi-tensor kernel call per step.

The flat buffers and the ZeRO stages that shard this optimizer's state are data
parallelism's (megaft.parallel.data: `build_optimizer` picks this class or ShardedAdamW)."""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from megaft.config.optim import OptimConfig
from megaft.kernels.adamw import adamw_multi_tensor_
from megaft.optim.clip import grad_norm
from megaft.optim.offload import NO_HOST, HostAdamW, host_zeros
from megaft.parallel.comm import Group
from megaft.parallel.tensor.grads import sync_sequence_parallel_grads


def adamw_update_(items, cfg: OptimConfig, *, step: int, lr: float, masters: Optional[list] = None) -> None:
    """AdamW on every (param, grad, exp_avg, exp_avg_sq, weight_decay) flat buffer or ZeRO
    chunk in ONE multi-tensor call (`optim.fused` picks its backend; weight decay per
    tensor): shared by the plain and the sharded optimizer. Empty chunks are left out
    (a ZeRO rank may own nothing of a bucket's padding-only tail). `masters`
    (optim.master_weights): one fp32 master per item; the update runs on it with the bf16
    grad upcast, and the bf16 param receives it rounded to nearest even."""
    items = [(*it, m) for it, m in zip(items, masters or [None] * len(items)) if it[0].numel()]
    if not items:
        return
    params, grads, exp_avgs, exp_avg_sqs, decays, fp32 = (list(col) for col in zip(*items))
    adamw_multi_tensor_(params, grads, exp_avgs, exp_avg_sqs, step=step, lr=lr, beta1=cfg.beta1, beta2=cfg.beta2,
                        eps=cfg.eps, weight_decay=decays, backend=cfg.fused,
                        master_params=fp32 if masters is not None else None)


def fp32_masters(tensors) -> list[torch.Tensor]:
    """optim.master_weights: fp32 copies of the (bf16) param buffers or chunks. The params
    are then always their masters rounded (at build time: the init rounded, as Megatron's
    bf16 optimizer copies the bf16 params)."""
    return [t.detach().float().clone() for t in tensors]


def state_bytes(params, grads, optimizer_state, host: Optional[HostAdamW]) -> dict[str, int]:
    """Device bytes for params, grads and optimizer state (none on the device under
    offload), plus `host`, the same kinds in host memory."""
    return {"params": sum(t.nbytes for t in params), "grads": sum(t.nbytes for t in grads),
            "optimizer": 0 if host else sum(t.nbytes for t in optimizer_state),
            "host": host.host_bytes() if host else dict(NO_HOST)}


class AdamW:
    """Decoupled-weight-decay Adam (Loshchilov & Hutter) with fp32 state.

    `flat`: the model's FlatParams (megaft.parallel.data.flat), whose buffers it updates.
    `optim.fused` picks the kernel (megaft.kernels.adamw): auto, torch, cpu, cuda, triton.
    `norm_params` are the parameters the grad norm counts (under pp: all but the
    last stage's tied copy); default: all. `scaler` (fp16) is saved in checkpoints.
    `offload`: fp32 masters and moments of the whole buffers on the host (megaft.optim.offload).
    `cfg.master_weights`: the buffers hold bf16 params and grads; `masters` their fp32 masters.
    """

    def __init__(self, flat, cfg: OptimConfig, *, norm_params: Optional[list] = None,
                 offload: bool = False):
        self.flat, self.cfg, self.step_count, self.offload = flat, cfg, 0, offload
        self.norm_params = flat.params if norm_params is None else norm_params
        device = flat.groups[0].data.device if flat.groups else torch.device("cpu")
        zeros = ((lambda n: host_zeros(n, device)) if offload else
                 (lambda n: torch.zeros(n, dtype=torch.float32, device=device)))

        def state(g):
            return zeros(g.data.numel())

        self.exp_avg = [state(g) for g in flat.groups]
        # a momentum-only group (Muon's matrices, megaft.parallel.data.flat) keeps no second moment
        self.exp_avg_sq = [zeros(0) if g.momentum_only else state(g) for g in flat.groups]
        self.host, self.masters = None, []  # masters: optim.master_weights (on the host under offload)
        if offload:
            masters = [state(g) for g in flat.groups]
            self.host = HostAdamW([g.data for g in flat.groups], masters, [state(g) for g in flat.groups],
                                  self.exp_avg, self.exp_avg_sq, cfg)
            self.masters = masters if cfg.master_weights else []
        elif cfg.master_weights:
            self.masters = fp32_masters(g.data for g in flat.groups)
        self.scaler = None

    @property
    def grads(self) -> list[torch.Tensor]:
        """The gradients the step applies (flat buffers), for clipping and inf checks."""
        return [g.grad for g in self.flat.groups]

    def sync_sequence_parallel(self, tp_group: Group) -> None:
        sync_sequence_parallel_grads(self.flat.params, tp_group)

    def grad_norm(self, tp_group: Group, pp_group: Group) -> torch.Tensor:
        return grad_norm(self.norm_params, tp_group, pp_group)

    def whole_params(self):
        """A context in which every parameter is whole on this rank (evaluation, export):
        always so without ZeRO-3."""
        return contextlib.nullcontext()

    def zero_grad(self) -> None:
        self.flat.zero_grad()

    def reload_param_shards(self) -> None:
        """After a checkpoint load: the host masters (offload) from the loaded buffers, unless
        they are the fp32 master weights, which the checkpoint held themselves."""
        if self.host is not None and not self.masters:
            self.host.reload_masters()

    def memory_bytes(self) -> dict[str, int]:
        """Device bytes this rank holds for params, grads and optimizer state (masters, if any,
        and moments); `host` the same kinds in host memory (offload)."""
        groups = self.flat.groups
        return state_bytes([g.data for g in groups], [g.grad for g in groups],
                           self.masters + self.exp_avg + self.exp_avg_sq, self.host)

    @torch.no_grad()
    def step(self, lr: float) -> None:
        self.step_count += 1
        if self.host is not None:
            self.host.step_(self.grads, [g.weight_decay for g in self.flat.groups], step=self.step_count, lr=lr)
            return
        adamw_update_([(g.data, g.grad, m, v, g.weight_decay)
                       for g, m, v in zip(self.flat.groups, self.exp_avg, self.exp_avg_sq)],
                      self.cfg, step=self.step_count, lr=lr, masters=self.masters or None)
