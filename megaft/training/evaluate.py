"""Evaluation: token-weighted eval loss on whole lines, and a task's exact-match accuracy.

Eval batches are split round-robin over dp ranks; sums are all-reduced, so the
result does not depend on the parallel config. Under expert parallelism every MoE layer
exchanges tokens over ranks of several dp replicas, so each dp rank runs the same number
of forwards: a rank short of a batch runs the first one again and counts nothing.
"""
from __future__ import annotations

from typing import Optional

import torch
from tokenizers import Tokenizer

from megaft.data.batches import count_targets
from megaft.data.tasks import Task
from megaft.inference.generate import greedy_generate, pipeline_greedy_generate
from megaft.models.decoder import Decoder
from megaft.parallel.comm import all_reduce
from megaft.parallel.grid import ParallelGrid


def _share(batches: list, grid: ParallelGrid) -> list[tuple[tuple[torch.Tensor, torch.Tensor], bool]]:
    """This dp rank's (batch, counted) pairs: round-robin, padded under ep > 1 (see the module doc)."""
    mine = [(b, True) for b in batches[grid.dp_rank::grid.dp_size]]
    if grid.ep_size > 1:
        mine += [(batches[0], False)] * (-(-len(batches) // grid.dp_size) - len(mine))
    return mine


@torch.no_grad()
def eval_loss(model: Decoder, batches: list[tuple[torch.Tensor, torch.Tensor]], grid: ParallelGrid,
              autocast) -> Optional[float]:
    """Mean next-token cross-entropy over every target token of the eval lines."""
    if not batches:
        return None
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=grid.device)  # loss sum, targets
    for (inputs, labels), counted in _share(batches, grid):
        with autocast():
            loss = model.loss_sum(inputs.to(grid.device), labels.to(grid.device))
        if counted:
            totals[0] += loss.double()
            totals[1] += count_targets(labels)
    model.train(was_training)
    all_reduce(totals, grid.dp_group)
    return (totals[0] / totals[1]).item() if totals[1] > 0 else None


@torch.no_grad()
def pipeline_eval_loss(runtime, batches: list[tuple[torch.Tensor, torch.Tensor]], grid: ParallelGrid,
                       autocast) -> Optional[float]:
    """`eval_loss` under pipeline parallelism: each batch goes forward stage after stage
    (`PipelineRuntime.forward_loss`); the last stage's sum is shared over pp, then dp."""
    if not batches:
        return None
    model = runtime.model
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=grid.device)  # loss sum, targets
    for (inputs, labels), counted in _share(batches, grid):
        loss = runtime.forward_loss(inputs, labels, autocast)
        if counted:
            totals[0] += loss
            totals[1] += count_targets(labels)
    model.train(was_training)
    all_reduce(totals[:1], grid.pp_group)
    all_reduce(totals, grid.dp_group)
    return (totals[0] / totals[1]).item() if totals[1] > 0 else None


@torch.no_grad()
def eval_accuracy(model, task: Task, tok: Tokenizer, eos_id: Optional[int], grid: ParallelGrid,
                  autocast) -> float:
    """Exact-match accuracy of greedy completions of the task's held-out prompts.
    `model` is a `Decoder`, or a `PipelineRuntime` under pp > 1 (generation through the
    stages; every pp rank gets the same completions)."""
    examples = task.eval[grid.dp_rank::grid.dp_size]
    prompts = [tok.encode(ex["prompt"]).ids for ex in examples]
    if isinstance(model, Decoder):
        with autocast():
            outs = greedy_generate(model, prompts, max_new_tokens=task.max_new_tokens, eos_id=eos_id,
                                   device=grid.device)
    else:
        outs = pipeline_greedy_generate(model, prompts, max_new_tokens=task.max_new_tokens, eos_id=eos_id,
                                        autocast=autocast)
    preds = [tok.decode(ids) for ids in outs]
    correct = torch.tensor([task.score(preds, examples) * len(examples), len(examples)],
                           dtype=torch.float64, device=grid.device)
    all_reduce(correct, grid.dp_group)
    return (correct[0] / correct[1]).item() if correct[1] > 0 else 0.0
