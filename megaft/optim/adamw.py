"""AdamW over FlatParams (plain dp, ZeRO stage 0): one fused kernel call per buffer per step."""
from __future__ import annotations

from typing import Optional

import torch

from megaft.kernels.adamw import adamw_step_
from megaft.optim.clip import grad_norm
from megaft.optim.config import OptimConfig
from megaft.optim.flat import FlatParams
from megaft.optim.offload import NO_HOST, HostAdamW, host_zeros
from megaft.parallel.comm import Group
from megaft.parallel.grads import sync_sequence_parallel_grads


class AdamW:
    """Decoupled-weight-decay Adam (Loshchilov & Hutter) with fp32 state.

    `optim.fused` picks the kernel (megaft.kernels.adamw): auto, torch, cpu, cuda.
    `norm_params` are the parameters the grad norm counts (under pp: all but the
    last stage's tied copy); default: all. `scaler` (fp16) is saved in checkpoints.
    `offload`: fp32 masters and moments of the whole buffers on the host (megaft.optim.offload).
    """

    def __init__(self, flat: FlatParams, cfg: OptimConfig, *, norm_params: Optional[list] = None,
                 offload: bool = False):
        self.flat, self.cfg, self.step_count, self.offload = flat, cfg, 0, offload
        self.norm_params = flat.params if norm_params is None else norm_params
        device = flat.groups[0].data.device if flat.groups else torch.device("cpu")
        state = (lambda g: host_zeros(g.data.numel(), device)) if offload else (lambda g: torch.zeros_like(g.data))
        self.exp_avg = [state(g) for g in flat.groups]
        self.exp_avg_sq = [state(g) for g in flat.groups]
        self.host = None
        if offload:
            self.host = HostAdamW([g.data for g in flat.groups], [state(g) for g in flat.groups],
                                  [state(g) for g in flat.groups], self.exp_avg, self.exp_avg_sq, cfg)
        self.scaler = None

    @property
    def grads(self) -> list[torch.Tensor]:
        """The gradients the step applies (flat buffers), for clipping and inf checks."""
        return [g.grad for g in self.flat.groups]

    def sync_sequence_parallel(self, tp_group: Group) -> None:
        sync_sequence_parallel_grads(self.flat.params, tp_group)

    def grad_norm(self, tp_group: Group, pp_group: Group) -> torch.Tensor:
        return grad_norm(self.norm_params, tp_group, pp_group)

    def zero_grad(self) -> None:
        self.flat.zero_grad()

    def reload_param_shards(self) -> None:
        """After a checkpoint load: the host masters (offload) from the loaded buffers."""
        if self.host is not None:
            self.host.reload_masters()

    def memory_bytes(self) -> dict[str, int]:
        """Device bytes this rank holds for params, grads and optimizer state (fp32 throughout);
        `host` the same kinds in host memory (offload)."""
        return {"params": sum(g.data.nbytes for g in self.flat.groups),
                "grads": sum(g.grad.nbytes for g in self.flat.groups),
                "optimizer": 0 if self.host else sum(t.nbytes for t in self.exp_avg + self.exp_avg_sq),
                "host": self.host.host_bytes() if self.host else dict(NO_HOST)}

    @torch.no_grad()
    def step(self, lr: float) -> None:
        self.step_count += 1
        if self.host is not None:
            self.host.step_(self.grads, [g.weight_decay for g in self.flat.groups], step=self.step_count, lr=lr)
            return
        for g, m, v in zip(self.flat.groups, self.exp_avg, self.exp_avg_sq):
            adamw_step_(g.data, g.grad, m, v, step=self.step_count, lr=lr, beta1=self.cfg.beta1,
                        beta2=self.cfg.beta2, eps=self.cfg.eps, weight_decay=g.weight_decay,
                        backend=self.cfg.fused)
