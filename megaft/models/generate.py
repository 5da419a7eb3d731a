"""Greedy decoding and user-visible logits over a vocabulary-parallel model."""
from __future__ import annotations

from collections import defaultdict
from typing import Optional

import torch

from megaft.models.llama import Llama
from megaft.parallel.comm import all_gather, gather_from_tp, group_size


def full_logits(model: Llama, input_ids: torch.Tensor) -> torch.Tensor:
    """[batch, seq, vocab_size] logits as a user sees them: gathered, padding dropped.
    (For inspection and tests; training never gathers the vocabulary.)"""
    local = model(input_ids)
    return gather_from_tp(local, model.group)[..., : model.cfg.vocab_size]


def _argmax(model: Llama, logits: torch.Tensor) -> torch.Tensor:
    """Vocab-parallel argmax of [batch, V_local] without gathering the vocabulary:
    each rank sends its best (value, id); ties go to the lowest id like torch.argmax."""
    local = logits.float()
    real = model.cfg.vocab_size - model.vocab_start
    if real < local.shape[-1]:
        local = local.clone()
        local[:, max(real, 0):] = float("-inf")
    value, idx = local.max(dim=-1)
    if group_size(model.group) == 1:
        return idx
    pairs = torch.stack([value, (idx + model.vocab_start).float()], dim=-1)  # ids < 2^24: exact
    every = all_gather(pairs.unsqueeze(0), 0, model.group)  # [tp, batch, 2]
    best = every[..., 0].argmax(dim=0)  # first rank with the max = lowest id
    return every[best, torch.arange(every.shape[1]), 1].long()


@torch.no_grad()
def greedy_generate(model: Llama, prompts: list[list[int]], *, max_new_tokens: int,
                    eos_id: Optional[int], device: torch.device) -> list[list[int]]:
    """Continue each prompt greedily until eos or `max_new_tokens`; returns the new ids
    (eos excluded). Prompts are batched by length, so no padding or masks are needed."""
    by_len: dict[int, list[int]] = defaultdict(list)
    for i, p in enumerate(prompts):
        by_len[len(p)].append(i)
    out: list[list[int]] = [[] for _ in prompts]
    was_training = model.training
    model.eval()
    for idxs in by_len.values():
        ids = torch.tensor([prompts[i] for i in idxs], dtype=torch.long, device=device)
        done = [False] * len(idxs)
        for _ in range(max_new_tokens):
            nxt = _argmax(model, model(ids)[:, -1])
            for j, token in enumerate(nxt.tolist()):  # one host copy per step, not per row
                done[j] = done[j] or token == eos_id
                if not done[j]:
                    out[idxs[j]].append(token)
            if all(done):
                break
            ids = torch.cat([ids, nxt.unsqueeze(1)], dim=1)
    model.train(was_training)
    return out
