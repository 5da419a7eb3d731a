"""Decoding from a vocabulary-parallel model, whole (`generate`) or split into pipeline
stages (`pipeline_generate`), greedy or sampled, with a KV cache; and user-visible logits.

With the cache, prompts of different lengths decode in one batch, left-padded (the pad slots
masked and each row's positions starting at its first real token, as transformers' generate with an
attention_mask: megaft.inference.kv_cache), each row stopping at its eos or its own token limit;
without it (or under an expert capacity, where pads would take experts' capacity) they are
batched by length. With the cache
(megaft.inference.kv_cache: every attention kind megaft builds) the prompt runs through the
model once and each new token alone after it; with `cache=False` every step reruns the
whole sequence (the reference the cache is tested against). Generation stops at eos, after
`max_new_tokens` or at model.max_seq_len tokens in all.

Sampling (`Sampling`, temperature > 0) follows transformers' `generate(do_sample=True)`
warpers: the logits divided by the temperature, then nucleus filtering as
TopPLogitsWarper does, then one multinomial draw per row. The draw uses the whole
(tp-gathered) logits and a generator on their device seeded by (seed, step), so every tp
rank draws the same token from the same bits without copying the logits to the host (the
loop reads only the chosen ids, once a step); under pp the last stage draws and broadcasts.
`step` may be a list, one per prompt (`Draws`): the rows of the prompts sharing a step draw
together from that step's generator, so a prompt's draws do not depend on the prompts batched
beside it (GRPO's rollouts: a prompt's G rows are one group, the same at every dp layout).
On the CPU the draws are those of a CPU generator as before; on a GPU, the GPU generator's.

Under expert parallelism every forward exchanges tokens with the other ranks of the ep group,
which decode their own prompts (other dp ranks): the group keeps in step (`_Lockstep`), a rank
with nothing left to decode running one-token forwards until every rank of the group is done.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Collection, Optional, Union

import torch
import torch.distributed as dist

from megaft.inference.kv_cache import kv_cache
from megaft.models.decoder import Decoder
from megaft.parallel.comm import all_gather, group_size
from megaft.parallel.tensor.comm import gather_from_tp


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: greedy (temperature 0) or drawn."""

    temperature: float = 0.0  # 0 = greedy (argmax)
    top_p: float = 1.0  # nucleus: keep the most likely tokens whose probabilities reach top_p
    seed: int = 0  # with the step: the draws' generator


GREEDY = Sampling()
Eos = Union[int, Collection[int], None]  # the id(s) that end a sequence (chat models often have several)
OnToken = Callable[[int, int], None]  # (prompt index, new id): streaming, called as each id is kept


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


def top_p_filter(scores: torch.Tensor, top_p: float, min_tokens_to_keep: int = 1) -> torch.Tensor:
    """transformers' TopPLogitsWarper: -inf for the least likely tokens whose cumulative
    probability (ascending, ties in torch.sort's order) stays at or below 1 - top_p, the
    `min_tokens_to_keep` most likely always kept (generate's sampling keeps 1). top_p = 1: the
    scores themselves (no sort, no copy)."""
    if top_p >= 1.0:
        return scores
    sorted_scores, order = torch.sort(scores, descending=False)
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    remove = cumulative <= (1 - top_p)
    remove[..., -min_tokens_to_keep:] = False
    return scores.masked_fill(remove.scatter(1, order, remove), float("-inf"))


def draw(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> torch.Tensor:
    """One token per row of the whole logits [batch, vocab] (fp32), drawn on the generator's
    device (`draw_generator(..., logits.device)`: no copy to the host); ids on the logits' device."""
    scores = logits.float().to(generator.device) / sampling.temperature
    probs = top_p_filter(scores, sampling.top_p).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1).to(logits.device)


def draw_generator(sampling: Sampling, step: int, device: Optional[torch.device] = None) -> torch.Generator:
    """The generator of one generation call at training step `step` on `device` (the logits'; the
    CPU when None), seeded alike on every rank. One device's draws are reproducible; a CUDA
    generator draws other tokens than the CPU's from the same seed."""
    device = torch.device(device if device is not None else "cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return torch.Generator(device=device).manual_seed((sampling.seed * 1_000_003 + step) % (2 ** 63))


class Draws:
    """The generators of a generation call whose prompts draw apart: prompt i's rows draw from the
    generator of steps[i] (draw_generator), the rows sharing a step as one multinomial in prompt
    order; `set_rows` names the prompts of the batch being decoded (the decoding loop's on_batch)."""

    def __init__(self, sampling: Sampling, steps: list[int], device: Optional[torch.device]):
        self.steps, self.device = steps, device
        self.generators = {s: draw_generator(sampling, s, device) for s in dict.fromkeys(steps)}
        self.set_rows(list(range(len(steps))))

    def set_rows(self, rows: list[int]) -> None:
        """The batch's prompts: each step's rows in it, found once a batch rather than once a token."""
        by_step: dict[int, list[int]] = defaultdict(list)
        for r, i in enumerate(rows):
            by_step[self.steps[i]].append(r)
        self.rows = rows
        self.groups = [(step, torch.tensor(at, device=self.device)) for step, at in by_step.items()]

    def draw(self, logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
        """One token per row of the whole logits [batch, vocab], as `draw` with each group's generator."""
        if logits.shape[0] != len(self.rows):  # an expert-parallel idle forward's row: discarded
            return draw(logits, sampling, next(iter(self.generators.values())))
        out = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
        for step, at in self.groups:
            at = at.to(logits.device)  # no copy where the call's device is the logits'
            out[at] = draw(logits.index_select(0, at), sampling, self.generators[step])
        return out


def _draws(sampling: Sampling, step: Union[int, list[int]], device) -> Union[torch.Generator, Draws]:
    return draw_generator(sampling, step, device) if isinstance(step, int) else Draws(sampling, step, device)


def choose(model, logits: torch.Tensor, sampling: Sampling, generator: Union[torch.Generator, Draws]) -> torch.Tensor:
    """The next token of each row from this tp rank's slice of the last position's logits
    [batch, V_local]; collective over tp, identical on every tp rank."""
    if sampling.temperature == 0:
        return _argmax(model, logits)
    whole = gather_from_tp(logits.float(), model.group)[:, :model.cfg.vocab_size]
    if isinstance(generator, Draws):
        return generator.draw(whole, sampling)
    return draw(whole, sampling, generator)


class _Lockstep:
    """Keeps the ranks of an expert-parallel group making the same number of forwards (each one
    runs the experts' all-to-alls): before each forward every rank says whether it has work (one
    small all-reduce); a rank without runs a one-token forward while another still has."""

    def __init__(self, group, device: torch.device):
        self.group, self.flag = group, torch.zeros(1, dtype=torch.long, device=device)

    def _any(self, working: bool) -> bool:
        self.flag.fill_(int(working))
        dist.all_reduce(self.flag, group=self.group)
        return bool(self.flag.item())

    def wrap(self, next_tokens: Callable) -> Callable:
        def step(ids: torch.Tensor) -> torch.Tensor:
            self._any(True)
            return next_tokens(ids)
        return step

    def drain(self, next_tokens: Callable, device: torch.device) -> None:
        idle = torch.zeros(1, 1, dtype=torch.long, device=device)
        while self._any(False):
            next_tokens(idle)


def expert_group(model: torch.nn.Module):
    """The ep group (> 1 rank) `model`'s experts exchange tokens in, or None."""
    for module in model.modules():
        group = getattr(module, "ep_group", None)
        if group is not None and group_size(group) > 1:
            return group
    return None


def _batches(prompts: list[list[int]], padded: bool) -> list[list[int]]:
    """The prompts decoded together (indices): all of them left-padded, or one batch per length."""
    if padded:
        return [list(range(len(prompts)))] if prompts else []
    by_len: dict[int, list[int]] = defaultdict(list)
    for i, p in enumerate(prompts):
        by_len[len(p)].append(i)
    return list(by_len.values())


def _decode(prompts: list[list[int]], *, max_new_tokens: Union[int, list[int]], eos_id: Eos, device: torch.device,
            max_len: int, next_tokens: Callable[[torch.Tensor], torch.Tensor], cache: Callable,
            on_token: Optional[OnToken] = None, keep_eos: bool = False, lockstep=None, padded: bool = False,
            on_batch: Optional[Callable[[list[int]], None]] = None) -> list[list[int]]:
    """The decoding loop: `next_tokens(ids)` gives each row's next id from the ids not yet seen by the
    model (all of them without a cache); `cache(capacity)` opens a KV cache for `capacity` positions,
    prompt and new tokens (yields its DecodeState, None without one); `on_token(i, id)` hears each new
    id of prompt i as it is kept (streaming). `max_new_tokens`: one limit, or one per prompt.
    `padded` (needs the cache): every prompt in one left-padded batch, else one batch per length;
    `on_batch(indices)` hears the prompts of each batch before it decodes.
    Returns the new ids (eos excluded unless `keep_eos`: then a row that stopped ends with its eos).
    `lockstep`: the ep group that must forward together (see _Lockstep), or None."""
    step_together = _Lockstep(lockstep, device) if lockstep is not None else None
    if step_together is not None:
        forward, next_tokens = next_tokens, step_together.wrap(next_tokens)
    stop = {eos_id} if isinstance(eos_id, int) else set(eos_id or ())
    limits = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompts)
    for p in prompts:
        if len(p) > max_len:
            raise ValueError(f"prompt of {len(p)} tokens exceeds model.max_seq_len={max_len}")
    out: list[list[int]] = [[] for _ in prompts]
    for idxs in _batches(prompts, padded):
        if on_batch is not None:
            on_batch(idxs)
        width = max(len(prompts[i]) for i in idxs)
        pads = [width - len(prompts[i]) for i in idxs]
        ids = torch.tensor([[0] * n + prompts[i] for n, i in zip(pads, idxs)], dtype=torch.long, device=device)
        room = [min(limits[i], max_len - len(prompts[i])) for i in idxs]  # each row's own limit
        done = [r <= 0 for r in room]
        steps = max(room)
        with cache(width + steps) as state:
            if state is not None and any(pads):
                state.pad = torch.tensor(pads, dtype=torch.long, device=device)
            new = ids
            for t in range(steps):
                if all(done):
                    break
                if state is not None:
                    state.real = new.shape[1]
                nxt = next_tokens(new if state is not None else ids)
                if state is not None:
                    state.advance()
                for j, token in enumerate(nxt.tolist()):  # one host copy per step, not per row
                    if done[j]:
                        continue
                    if token in stop:
                        done[j] = True
                        if keep_eos:
                            out[idxs[j]].append(token)
                        continue
                    out[idxs[j]].append(token)
                    if on_token is not None:
                        on_token(idxs[j], token)
                    done[j] = t + 1 >= room[j]
                new = nxt.unsqueeze(1)
                ids = torch.cat([ids, new], dim=1)
    if step_together is not None:  # no cache open: the idle forwards leave nothing behind
        step_together.drain(forward, device)
    return out


def _pads_allowed(model) -> bool:
    """Left padding keeps each row's tokens its own, except under an expert capacity (pads would
    take experts' capacity from the real tokens): then prompts batch by length."""
    routing = getattr(model, "routing", None)
    return routing is None or routing.capacity_factor is None


def _cache_of(model, cache: bool) -> Callable:
    """The cache to decode with, given its capacity: kv_cache(model, capacity), or none
    (recompute) when off."""
    if cache:
        return lambda capacity: kv_cache(model, capacity)
    return lambda capacity: contextlib.nullcontext()


def _rows_of(generator) -> Optional[Callable[[list[int]], None]]:
    """The decoding loop's `on_batch` for per-prompt draws (it names each batch's prompts), or None."""
    if not isinstance(generator, Draws):
        return None
    return generator.set_rows


@torch.no_grad()
def generate(model: Decoder, prompts: list[list[int]], *, max_new_tokens: Union[int, list[int]], eos_id: Eos,
             device: torch.device, sampling: Sampling = GREEDY, step: Union[int, list[int]] = 0, cache: bool = True,
             on_token: Optional[OnToken] = None, keep_eos: bool = False) -> list[list[int]]:
    """Continue each prompt until eos or `max_new_tokens` (one, or one per prompt); returns the new ids
    (eos excluded). Collective over tp; every tp rank gets the same ids. `step` seeds the draws with
    `sampling.seed` (a list: each prompt's, see `Draws`); `on_token(prompt_index, id)` is called for
    each kept id as it is chosen (megaft-chat streams so)."""
    generator = _draws(sampling, step, device)
    was_training = model.training
    model.eval()
    try:
        return _decode(prompts, max_new_tokens=max_new_tokens, eos_id=eos_id, device=device,
                       max_len=model.cfg.max_seq_len, cache=_cache_of(model, cache),
                       next_tokens=lambda ids: choose(model, model(ids)[:, -1], sampling, generator),
                       on_token=on_token, keep_eos=keep_eos, lockstep=expert_group(model),
                       padded=cache and _pads_allowed(model), on_batch=_rows_of(generator))
    finally:
        model.train(was_training)


def greedy_generate(model: Decoder, prompts: list[list[int]], *, max_new_tokens: int,
                    eos_id: Eos, device: torch.device, cache: bool = True) -> list[list[int]]:
    """`generate` greedily."""
    return generate(model, prompts, max_new_tokens=max_new_tokens, eos_id=eos_id, device=device, cache=cache)


@torch.no_grad()
def pipeline_generate(runtime, prompts: list[list[int]], *, max_new_tokens: Union[int, list[int]], eos_id: Eos,
                      autocast: Callable = None, sampling: Sampling = GREEDY, step: Union[int, list[int]] = 0,
                      cache: bool = True, keep_eos: bool = False) -> list[list[int]]:
    """`generate` through pipeline stages (a `PipelineRuntime`); collective over the pp and
    tp groups, same result on every rank.

    Each step runs the new positions (the whole sequence without a cache) through the
    stages one after the other, each rank's stages keeping their own layers' cache; the
    last stage picks the next tokens and broadcasts them over the pp group, so every
    stage extends the same sequences.
    """
    model, grid = runtime.model, runtime.grid
    autocast = autocast or contextlib.nullcontext
    src = runtime.peer_rank(model.last_stage)
    generator = _draws(sampling, step, grid.device)

    def next_tokens(ids: torch.Tensor) -> torch.Tensor:
        logits = runtime.forward_logits(ids, autocast)
        nxt = torch.empty(ids.shape[0], dtype=torch.long, device=ids.device)
        if logits is not None:
            nxt = choose(model, logits[:, -1], sampling, generator)
        dist.broadcast(nxt, src, group=grid.pp_group)
        return nxt

    was_training = model.training
    model.eval()
    try:
        return _decode(prompts, max_new_tokens=max_new_tokens, eos_id=eos_id, device=grid.device,
                       max_len=model.cfg.max_seq_len, next_tokens=next_tokens, cache=_cache_of(model, cache),
                       keep_eos=keep_eos, lockstep=expert_group(model), padded=cache and _pads_allowed(model),
                       on_batch=_rows_of(generator))
    finally:
        model.train(was_training)


def pipeline_greedy_generate(runtime, prompts: list[list[int]], *, max_new_tokens: int, eos_id: Eos,
                             autocast: Callable = None, cache: bool = True) -> list[list[int]]:
    """`pipeline_generate` greedily."""
    return pipeline_generate(runtime, prompts, max_new_tokens=max_new_tokens, eos_id=eos_id, autocast=autocast,
                             cache=cache)
