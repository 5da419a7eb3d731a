"""A step's router statistics on one rank (mixtures of experts, megaft.models.moe): the aux and
z values of its micro-batches and the tokens each expert got, per MoE layer; `record` turns
them into the metrics line's fields (megaft.models.moe.metrics)."""
from __future__ import annotations

from typing import Optional

import torch

from megaft.config.model import ModelConfig
from megaft.models.moe.router import RouterLosses
from megaft.parallel.comm import all_reduce, group_size


class StepRouterStats:
    """Sums a step's micro-batch router values on one rank (a pipeline stage: the counts of its
    MoE layers; the last stage: the values); `record` adds them over pp and averages over dp."""

    def __init__(self, cfg: ModelConfig, *, drops: bool = False):
        self.layers = [i for i in range(cfg.n_layers) if cfg.is_moe(i)]
        self.shape = (len(self.layers), max(cfg.n_experts, 0))
        self.drops = drops  # moe.capacity_factor set: report the dropped assignments per layer
        self.size = 3 + self.shape[0] * self.shape[1] + self.shape[0]
        # [aux, z, micro-batches, counts..., dropped per layer] (fp64), on the routers' device from the
        # first `add`: summing there spares a host sync per micro-batch; `record` reads it once.
        self.sums: Optional[torch.Tensor] = None
        # layer -> [experts] assignments over the whole global batch, once `record` summed them
        self.step_counts: dict[int, torch.Tensor] = {}

    @classmethod
    def of(cls, model) -> "StepRouterStats":
        """Empty statistics for `model` (a Decoder or a pipeline stage's)."""
        return cls(model.cfg, drops=model.routing.capacity_factor is not None)

    def add(self, router: RouterLosses, *, values: bool = True) -> None:
        """One micro-batch's counts; its aux and z values too unless `values` is false (a pipeline
        stage before the last, which does not know them)."""
        if self.sums is None:
            self.sums = torch.zeros(self.size, dtype=torch.float64, device=router.aux.device)
        if values:
            self.sums[0] += router.aux.detach().double()
            self.sums[1] += router.z.detach().double()
            self.sums[2] += 1
        counts, dropped = self._split(self.sums)
        rows, drop = router.counts.detach().double(), router.dropped.detach().double()
        first = self.layers.index(router.layers[0]) if router.layers else 0
        if self.layers[first:first + len(router.layers)] == list(router.layers):  # a run (model, stage): one add
            counts[first:first + len(router.layers)] += rows
            dropped[first:first + len(router.layers)] += drop
        else:
            for layer, row, d in zip(router.layers, rows, drop):
                counts[self.layers.index(layer)] += row
                dropped[self.layers.index(layer)] += d

    def _split(self, sums: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of `sums`: counts [layers, experts], dropped [layers]."""
        n = self.shape[0] * self.shape[1]
        return sums[3:3 + n].view(self.shape), sums[3 + n:]

    def record(self, dp_group, pp_group=None) -> dict[str, float]:
        """The step's metrics line fields; collective over pp and dp (every rank calls it)."""
        if not self.layers:
            return {}
        # a copy: the all-reduce works in place
        values = torch.zeros(self.size, dtype=torch.float64) if self.sums is None else self.sums.clone()
        for group in (pp_group, dp_group):
            if group_size(group) > 1:
                values = values.to(_device(group))
                all_reduce(values, group)
        values = values.cpu()
        counts, _ = self._split(values)
        self.step_counts = dict(zip(self.layers, counts))  # the global batch's, for the correction-bias update
        mean_aux, mean_z = (values[:2] / values[2]).tolist()
        out = {"aux_loss": mean_aux, "z_loss": mean_z}
        counts, dropped = self._split(values)
        for layer, row, drop in zip(self.layers, counts, dropped.tolist()):
            out.update(expert_load(layer, row))
            if self.drops:
                out[f"moe/{layer}/dropped"] = drop
        return out


def _device(group) -> torch.device:
    """The device collectives of `group` take (NCCL: the current CUDA device)."""
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else \
        torch.device("cpu")


def expert_load(layer: int, counts: torch.Tensor) -> dict[str, float]:
    """Tokens per expert of MoE layer `layer` (top-k assignments): min, median, max, and the
    imbalance max / mean (1 = perfectly balanced)."""
    mean = counts.mean().item()
    return {f"moe/{layer}/tokens_min": counts.min().item(), f"moe/{layer}/tokens_median": counts.median().item(),
            f"moe/{layer}/tokens_max": counts.max().item(),
            f"moe/{layer}/imbalance": counts.max().item() / mean if mean > 0 else 0.0}
