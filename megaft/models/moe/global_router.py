"""Global-batch load balancing (`moe.aux_scope=global_batch`, megaft.config.moe).

The load-balancing loss pools its statistics over the whole global batch (every dp×cp
replica and accumulation step) before the product: aux = E Σ_e (C_e / L T)(P_e / L T)
with C, P and T summed over the batch (Qiu et al. 2025, "Demons in the Detail"). Its
gradient reaches the routers through P alone, with C and T fixed, so each micro-batch
back-propagates exactly its part once C and T are known before its backward. They are
not, while micro-batches run forward and backward in turn: before the step every rank
runs its micro-batches forward without gradients (no head, no saved activations) to count
the assignments, and one all-reduce over pp and dp gives the batch's. That costs about a
third of a step; what it buys is a loss and gradients that do not depend on how the batch
is split over dp, accumulation and pp (a running sum over the micro-batches so far, as
Megatron's global aux loss keeps, would change with the split). The pass routes exactly as
the training pass does only without dropout, which validation requires.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from megaft.models.moe.router import GlobalCounts
from megaft.parallel.comm import all_reduce
from megaft.parallel.grid import ParallelGrid


def global_counts(count: Callable[[torch.Tensor, Optional[object]], torch.Tensor], inputs: Sequence[torch.Tensor],
                  docs: Optional[Sequence], grid: ParallelGrid, n_experts: int, autocast) -> GlobalCounts:
    """The global batch's GlobalCounts from this rank's micro-batches `inputs` (and their document
    layouts `docs`, or None); `count(ids, docs)`: one micro-batch's assignments per expert over
    this rank's MoE layers (Decoder.router_counts, PipelineRuntime.router_counts).
    Collective over pp and dp."""
    totals = torch.zeros(n_experts + 1, dtype=torch.float64, device=grid.device)
    for i, ids in enumerate(inputs):
        with autocast():
            totals[:n_experts] += count(ids.to(grid.device), docs[i] if docs else None).double()
        totals[n_experts] += ids.numel() * grid.cp_size  # under cp this rank holds 1/cp of each row
    all_reduce(totals[:n_experts], grid.pp_group)  # each stage counted its own layers
    all_reduce(totals, grid.dp_group)  # cp ranks share their micro-batches (counted whole already)
    return GlobalCounts(totals[:n_experts].float(), totals[n_experts].float(), len(inputs) * grid.dp_size)
