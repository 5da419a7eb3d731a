"""Greedy decoding and user-visible logits over a vocabulary-parallel model, whole
(`greedy_generate`) or split into pipeline stages (`pipeline_greedy_generate`)."""
from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megaft.models.decoder import Decoder
from megaft.parallel.comm import all_gather, group_size
from megaft.parallel.tensor.comm import gather_from_tp


def full_logits(model: Decoder, input_ids: torch.Tensor) -> torch.Tensor:
    """[batch, seq, vocab_size] logits as a user sees them: gathered, padding dropped.
    (For inspection and tests; training never gathers the vocabulary.)"""
    local = model(input_ids)
    return gather_from_tp(local, model.group)[..., : model.cfg.vocab_size]


def _argmax(model, logits: torch.Tensor) -> torch.Tensor:
    """Vocab-parallel argmax of [batch, V_local] without gathering the vocabulary:
    each rank sends its best (value, id); ties go to the lowest id like torch.argmax.
    `model` is a `Decoder` or the last pipeline stage (`cfg`, `vocab_start`, `group`)."""
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


def _decode(prompts: list[list[int]], max_new_tokens: int, eos_id: Optional[int], device: torch.device,
            next_tokens: Callable[[torch.Tensor], torch.Tensor]) -> list[list[int]]:
    """The greedy loop: prompts batched by length (no padding or masks needed);
    `next_tokens(ids)` gives each row's next id. Returns the new ids (eos excluded)."""
    by_len: dict[int, list[int]] = defaultdict(list)
    for i, p in enumerate(prompts):
        by_len[len(p)].append(i)
    out: list[list[int]] = [[] for _ in prompts]
    for idxs in by_len.values():
        ids = torch.tensor([prompts[i] for i in idxs], dtype=torch.long, device=device)
        done = [False] * len(idxs)
        for _ in range(max_new_tokens):
            nxt = next_tokens(ids)
            for j, token in enumerate(nxt.tolist()):  # one host copy per step, not per row
                done[j] = done[j] or token == eos_id
                if not done[j]:
                    out[idxs[j]].append(token)
            if all(done):
                break
            ids = torch.cat([ids, nxt.unsqueeze(1)], dim=1)
    return out


@torch.no_grad()
def greedy_generate(model: Decoder, prompts: list[list[int]], *, max_new_tokens: int,
                    eos_id: Optional[int], device: torch.device) -> list[list[int]]:
    """Continue each prompt greedily until eos or `max_new_tokens`; returns the new ids
    (eos excluded)."""
    was_training = model.training
    model.eval()
    out = _decode(prompts, max_new_tokens, eos_id, device, lambda ids: _argmax(model, model(ids)[:, -1]))
    model.train(was_training)
    return out


@torch.no_grad()
def pipeline_greedy_generate(runtime, prompts: list[list[int]], *, max_new_tokens: int, eos_id: Optional[int],
                             autocast: Callable = None) -> list[list[int]]:
    """`greedy_generate` through pipeline stages (a `PipelineRuntime`); collective over
    the pp and tp groups, same result on every rank.

    Each step runs the whole sequence through the stages one after the other
    (no KV cache, like `greedy_generate`); the last stage picks the next tokens
    (vocab-parallel argmax over tp) and broadcasts them over the pp group, so every
    stage extends the same sequences.
    """
    model, grid = runtime.model, runtime.grid
    autocast = autocast or contextlib.nullcontext
    src = runtime.peer_rank(model.last_stage)

    def next_tokens(ids: torch.Tensor) -> torch.Tensor:
        logits = runtime.forward_logits(ids, autocast)
        nxt = torch.empty(ids.shape[0], dtype=torch.long, device=ids.device)
        if logits is not None:
            nxt = _argmax(model, logits[:, -1])
        dist.broadcast(nxt, src, group=grid.pp_group)
        return nxt

    was_training = model.training
    model.eval()
    out = _decode(prompts, max_new_tokens, eos_id, grid.device, next_tokens)
    model.train(was_training)
    return out
