"""A step's router statistics on one rank (mixtures of experts, megaft.models.moe): the aux and
z values of its micro-batches and the tokens each expert got, per MoE layer; `record` turns
them into the metrics line's fields (megaft.training.moe_metrics)."""
from __future__ import annotations

import torch

from megaft.models.config import ModelConfig
from megaft.models.moe import RouterLosses
from megaft.parallel.comm import all_reduce, group_size


class StepRouterStats:
    """Sums a step's micro-batch router values on one rank (a pipeline stage: the counts of its
    MoE layers; the last stage: the values); `record` adds them over pp and averages over dp."""

    def __init__(self, cfg: ModelConfig):
        self.layers = [i for i in range(cfg.n_layers) if cfg.is_moe(i)]
        self.aux = self.z = 0.0
        self.micro_batches = 0
        self.counts = torch.zeros(len(self.layers), max(cfg.n_experts, 0), dtype=torch.float64)

    def add(self, router: RouterLosses, *, values: bool = True) -> None:
        """One micro-batch's counts; its aux and z values too unless `values` is false (a pipeline
        stage before the last, which does not know them)."""
        if values:
            self.aux += float(router.aux)
            self.z += float(router.z)
            self.micro_batches += 1
        for layer, row in zip(router.layers, router.counts.detach().double().cpu()):
            self.counts[self.layers.index(layer)] += row

    def record(self, dp_group, pp_group=None) -> dict[str, float]:
        """The step's metrics line fields; collective over pp and dp (every rank calls it)."""
        if not self.layers:
            return {}
        values = torch.cat([torch.tensor([self.aux, self.z, float(self.micro_batches)], dtype=torch.float64),
                            self.counts.reshape(-1)])
        for group in (pp_group, dp_group):
            if group_size(group) > 1:
                values = values.to(_device(group))
                all_reduce(values, group)
        values = values.cpu()
        mean_aux, mean_z = (values[:2] / values[2]).tolist()
        out = {"aux_loss": mean_aux, "z_loss": mean_z}
        for layer, row in zip(self.layers, values[3:].view_as(self.counts)):
            out.update(expert_load(layer, row))
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
