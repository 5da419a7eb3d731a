"""Expert parallelism's all-to-all as a training step runs it: the model's sizes, the split
sizes of a balanced and of a skewed routing, and the cost model's price.

One mixture-of-experts block's dispatch (megaft.parallel.expert.dispatch): each ep rank sends
every one of its tokens' top_k rows to the ep rank holding the row's expert (rank r holds
experts [r E/ep, (r+1) E/ep)); the combine sends them back the same way, and backward does
both again. A rank's tokens are train.micro_batch_size x data.seq_len / parallel.cp, a row
is model.dim wide in the compute dtype (2 bytes under precision=bf16 or fp16, 4 under fp32),
so every rank's send buffer is S = tokens x top_k x dim x bytes: nccl-tests' size column.
busbw = S / t x (ep-1)/ep (each rank sends (ep-1)/ep of S to the others at balanced
splits), and 2 S (ep-1)/ep is megaft.perf.counts.a2a_bytes, what megaft-plan's ep_comm
prices per block and pass. The rows travel as float32 words (row bytes rounded up to 4,
as in every commbench buffer), so the same bytes move and every result is checked.

Split sizes, [source][destination] rows of the group:

- balanced (`ep_all_to_all`): tokens x top_k / ep rows to every rank, the remainder to the
  first ones: the uniform routing the cost model assumes;
- routed (`ep_all_to_all_routed`): each source draws its tokens x top_k rows' experts from
  a multinomial over the experts seeded with ROUTING_SEED + 1 + its group rank, where expert
  e's popularity is (1 + p_e)^-ZIPF_EXPONENT for its place p_e in a permutation seeded with
  ROUTING_SEED (a router that favours some experts). Every rank still sends S, but the ranks
  holding popular experts receive more, and a rank keeps more or fewer of its rows at home,
  so ranks send different amounts over the network. Every rank computes every source's draw
  (no count exchange), so each knows what it must receive.

The cost model's price of one of these all-to-alls (ep_comm is a sum of them) is
megaft.perf.time.all_to_all_s(S (ep-1)/ep, ep, cluster, tp): the config's cluster= preset,
with the links of cluster.measured when it names a commbench run (as megaft-plan prices it);
none without a preset.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megaft.commbench.busbw import ELEMENT_BYTES
from megaft.config import Config
from megaft.config.commbench import Collective, EpCollective
from megaft.config.model import ModelConfig
from megaft.perf.counts import a2a_bytes
from megaft.perf.time import all_to_all_s
from megaft.plan.measured import apply_measured

ROUTING_SEED = 0
# expert popularity ~ 1/sqrt(1 + place): with 8 ep ranks the busiest receives ~1.8x the mean rows
# with 1 expert each, ~1.2x with 8 each (more experts per rank average the skew out)
ZIPF_EXPONENT = 0.5


def model_shape(cfg: Config) -> ModelConfig:
    """The model's shape: config.json's under model.init_from (as megaft-train resolves it), else model.*."""
    if cfg.model.init_from:
        from megaft.models.hf.config import hf_model_config

        return hf_model_config(cfg.model.init_from, base=cfg.model)
    return cfg.model


def compute_bytes(precision: str) -> int:
    """Bytes of one element of the compute dtype, in which the dispatched rows travel."""
    return 2 if str(precision) in ("bf16", "fp16") else 4


def ep_problems(cfg: Config) -> list[str]:
    """What keeps commbench from sizing the ep all-to-all of parallel.ep > 1, each with its fix."""
    ep = cfg.parallel.ep
    if ep <= 1:
        return []
    try:
        m = model_shape(cfg)
    except (OSError, ValueError) as exc:  # HFCheckpointError is a ValueError
        return [f"model.init_from={cfg.model.init_from!r}: {exc}; fix: point it at a Hugging Face checkpoint "
                "directory (config.json), or describe the model with model.* instead"]
    if m.n_experts <= 0:
        return [f"parallel.ep={ep} splits the experts of a mixture of experts, and model.arch={m.arch} is dense "
                "(model.n_experts=0): there is no expert all-to-all to measure; fix: parallel.ep=1, or the "
                "mixture of experts training will run (model.n_experts/top_k, or model.init_from)"]
    problems = []
    if m.n_experts % ep:
        problems.append(f"parallel.ep={ep} does not divide model.n_experts={m.n_experts}: each ep rank holds "
                        f"n_experts/ep experts; fix: parallel.ep among the divisors of {m.n_experts}")
    if not 1 <= m.top_k <= m.n_experts:
        problems.append(f"model.top_k={m.top_k} must be between 1 and model.n_experts={m.n_experts}; "
                        f"fix: model.top_k <= {m.n_experts}")
    if m.dim < 1:
        problems.append(f"model.dim={m.dim} must be >= 1")
    if tokens_per_rank(cfg) < 1:
        problems.append(f"train.micro_batch_size x data.seq_len / parallel.cp = {cfg.train.micro_batch_size} x "
                        f"{cfg.data.seq_len} / {cfg.parallel.cp} leaves no token per rank to dispatch; fix: "
                        "train.micro_batch_size >= 1 and data.seq_len >= parallel.cp")
    return problems


def tokens_per_rank(cfg: Config) -> int:
    """Tokens of one micro-batch on one rank: its share of each row under cp (as megaft.perf.time)."""
    return cfg.train.micro_batch_size * cfg.data.seq_len // cfg.parallel.cp


def balanced_splits(rows: int, ep: int) -> list[list[int]]:
    """[source][destination] rows: `rows` per source spread evenly, the remainder to the first ranks."""
    share = [rows // ep + (1 if j < rows % ep else 0) for j in range(ep)]
    return [list(share) for _ in range(ep)]


def expert_popularity(n_experts: int, seed: int = ROUTING_SEED) -> torch.Tensor:
    """Expert e's (unnormalized) routing probability: (1 + its place in a seeded permutation)^-ZIPF_EXPONENT."""
    place = torch.randperm(n_experts, generator=torch.Generator().manual_seed(seed))
    return (1.0 + place.double()) ** -ZIPF_EXPONENT


def routed_splits(rows: int, n_experts: int, ep: int, seed: int = ROUTING_SEED) -> list[list[int]]:
    """[source][destination] rows of a skewed routing: each source's `rows` drawn over the experts
    (expert_popularity), summed over each destination's n_experts/ep contiguous experts."""
    weights = expert_popularity(n_experts, seed)
    out = []
    for source in range(ep):
        draw = torch.multinomial(weights, rows, replacement=True,
                                 generator=torch.Generator().manual_seed(seed + 1 + source))
        out.append(torch.bincount(draw, minlength=n_experts).view(ep, -1).sum(1).tolist())
    return out


def off_rank(splits: list[list[int]]) -> tuple[list[int], list[int]]:
    """(rows each group rank sends to the others, rows each receives from the others)."""
    n = len(splits)
    sent = [sum(splits[i]) - splits[i][i] for i in range(n)]
    received = [sum(splits[j][i] for j in range(n)) - splits[i][i] for i in range(n)]
    return sent, received


@dataclass(frozen=True)
class EpPlan:
    """One MoE block's dispatch all-to-all on the ep group, sized from the config."""

    ep: int
    tp: int  # the ep group's ranks are tp apart in megaft's rank order (the cost model's stride)
    n_experts: int
    top_k: int
    tokens: int  # per rank and micro-batch
    dim: int
    elem_bytes: int  # the compute dtype's

    @property
    def rows(self) -> int:
        """Rows each rank sends (its tokens' top_k copies), its own included."""
        return self.tokens * self.top_k

    @property
    def row_bytes(self) -> int:
        return self.dim * self.elem_bytes

    @property
    def row_elems(self) -> int:
        """float32 words of a row as sent (the row's bytes rounded up to a word)."""
        return -(-self.row_bytes // ELEMENT_BYTES)

    @property
    def send_bytes(self) -> int:
        """S: every rank's send buffer as measured, nccl-tests' size column."""
        return self.rows * self.row_elems * ELEMENT_BYTES

    @property
    def a2a_bytes(self) -> float:
        """megaft.perf.counts.a2a_bytes: bytes a rank sends per block and pass (dispatch + combine)."""
        return a2a_bytes(self.tokens, self.top_k, self.dim, self.elem_bytes, self.ep)

    def splits(self, collective: str) -> list[list[int]]:
        if EpCollective(collective) == EpCollective.balanced:
            return balanced_splits(self.rows, self.ep)
        return routed_splits(self.rows, self.n_experts, self.ep)

    def describe(self) -> dict:
        return {"ep": self.ep, "n_experts": self.n_experts, "top_k": self.top_k, "tokens": self.tokens,
                "dim": self.dim, "elem_bytes": self.elem_bytes, "row_bytes": self.row_bytes,
                "send_bytes": self.send_bytes, "a2a_bytes": self.a2a_bytes, "routing_seed": ROUTING_SEED,
                "zipf_exponent": ZIPF_EXPONENT, "splits": {c.value: self.splits(c) for c in EpCollective}}


def ep_plan(cfg: Config) -> Optional[EpPlan]:
    """The ep all-to-all to measure; None without expert parallelism (or without experts)."""
    if cfg.parallel.ep <= 1:
        return None
    m = model_shape(cfg)
    if m.n_experts <= 0:
        return None
    return EpPlan(ep=cfg.parallel.ep, tp=cfg.parallel.tp, n_experts=m.n_experts, top_k=m.top_k,
                  tokens=tokens_per_rank(cfg), dim=m.dim, elem_bytes=compute_bytes(cfg.precision))


def measures_ep(cfg: Config) -> bool:
    """Whether the run measures the ep all-to-alls: parallel.ep > 1 and all_to_all among the collectives."""
    return cfg.parallel.ep > 1 and Collective.all_to_all in cfg.commbench.collectives


def model_time(cfg: Config, plan: EpPlan) -> tuple[Optional[float], str]:
    """(seconds the cost model gives one of these all-to-alls, how it was priced, or why not)."""
    cluster = cfg.cluster
    if cluster.gpus_per_node < 1:
        return None, ("no cluster= preset: nothing to price it with; fix: cluster=<preset> (conf/cluster/), "
                      "optionally with cluster.measured=<a commbench run dir>")
    cluster, notes, problems = apply_measured(cluster)
    if problems:
        return None, problems[0]
    bad = [k for k in ("nvlink_gbps", "ib_gbps", "comm_fraction") if getattr(cluster, k) <= 0]
    if bad:
        return None, f"cluster={cluster.name} has {', '.join(f'{k}={getattr(cluster, k)}' for k in bad)}: no link"
    sent = plan.a2a_bytes / 2
    how = (f"megaft.perf.time.all_to_all_s({sent:g} B sent, ep={plan.ep}, cluster={cluster.name}, "
           f"ranks tp={plan.tp} apart)")
    return all_to_all_s(sent, plan.ep, cluster, plan.tp), "; ".join([how] + notes)


def annotate(rows: list[dict], plan: EpPlan, model_s: Optional[float]) -> None:
    """Add the cost model's side to the ep rows: a2a_bytes, model_time_s and measured / model."""
    for r in rows:
        if r["collective"] in set(EpCollective):
            r.update(a2a_bytes=plan.a2a_bytes, model_time_s=model_s,
                     model_ratio=r["time_s"] / model_s if model_s and r["correct"] else None)
