"""`parallel.offload=cpu` (ZeRO-Offload, Ren et al. 2021): the fp32 master weights of
this rank's shard and both Adam moments live in host memory (pinned when the model is
on a GPU) and are updated there by the C++ AdamW (megaft._C, `optim.fused=auto|cpu`).

One optimizer step, over the pieces of the shard (a bucket's chunk; a whole buffer at
zero=0), in bucket order:
  1. D2H: every piece's reduced and clipped gradient is queued for a non_blocking copy
     into its pinned host buffer, each copy followed by an event;
  2. the host waits for one piece's event only and runs AdamW on it, so the update of
     piece i overlaps the transfers of the pieces after it;
  3. H2D: the piece's updated master is queued (non_blocking) into the device params;
     the ZeRO all-gather or the next forward is queued after it on the same stream.
The global grad norm, the fp16 inf check and clipping need every reduced gradient before
any update, so they stay on the device, where the gradients already are. On CPU
devices the copies are plain memcpys, but the code path is the same.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from megaft.config.optim import OptimConfig
from megaft.kernels.adamw import adamw_step_

OFFLOADS = ("none", "cpu")
HOST_FUSED = ("auto", "cpu")  # kernels that run on host tensors (auto picks megaft._C when built)


def host_zeros(numel: int, device: torch.device) -> torch.Tensor:
    """fp32 zeros on the host, pinned when the params are on a GPU (async copies need it)."""
    return torch.zeros(numel, dtype=torch.float32, pin_memory=device.type == "cuda")


def _event(device: torch.device) -> Optional["torch.cuda.Event"]:
    if device.type != "cuda":
        return None  # CPU copies are synchronous: nothing to wait for
    event = torch.cuda.Event()
    event.record()
    return event


class HostAdamW:
    """Host masters, grads and moments for device pieces (flat fp32 tensors).

    `masters`, `host_grads`, `exp_avgs`, `exp_avg_sqs` are host tensors shaped like
    `params`; the optimizer owning them allocates them (as views into per-group flat
    buffers, so checkpoints keep their layout)."""

    def __init__(self, params: Sequence[torch.Tensor], masters: Sequence[torch.Tensor],
                 host_grads: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor],
                 exp_avg_sqs: Sequence[torch.Tensor], cfg: OptimConfig):
        self.params, self.masters, self.host_grads = list(params), list(masters), list(host_grads)
        self.exp_avgs, self.exp_avg_sqs, self.cfg = list(exp_avgs), list(exp_avg_sqs), cfg
        self.reload_masters()

    @torch.no_grad()
    def reload_masters(self) -> None:
        """Masters := the device params (at build time and after a checkpoint load)."""
        for master, param in zip(self.masters, self.params):
            master.copy_(param)

    @torch.no_grad()
    def step_(self, grads: Sequence[torch.Tensor], weight_decays: Sequence[float], *, step: int, lr: float) -> None:
        """D2H the grads, AdamW on the host piece by piece, H2D the params (see the module doc)."""
        events = []
        for host_grad, grad in zip(self.host_grads, grads):
            host_grad.copy_(grad, non_blocking=True)
            events.append(_event(grad.device))
        backend = "cpu" if self.cfg.fused == "cpu" else "auto"
        for i, (param, master) in enumerate(zip(self.params, self.masters)):
            if events[i] is not None:
                events[i].synchronize()
            adamw_step_(master, self.host_grads[i], self.exp_avgs[i], self.exp_avg_sqs[i], step=step, lr=lr,
                        beta1=self.cfg.beta1, beta2=self.cfg.beta2, eps=self.cfg.eps,
                        weight_decay=weight_decays[i], backend=backend)
            param.copy_(master, non_blocking=True)

    def host_bytes(self) -> dict[str, int]:
        """Host bytes: masters and moments are optimizer state (the paper's K=12), plus the grad copies."""
        moments = sum(t.nbytes for t in self.masters + self.exp_avgs + self.exp_avg_sqs)
        return {"params": 0, "grads": sum(t.nbytes for t in self.host_grads), "optimizer": moments}


NO_HOST = {"params": 0, "grads": 0, "optimizer": 0}
