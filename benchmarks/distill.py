"""Memory of megaft's token-chunked distillation loss against the gathered one, on the CPU (issue 40).

    python -m benchmarks.distill [--tokens N] [--vocab V] [--hidden H] [--teacher-hidden H] [--beta B]
                                 [--temperature T] [--chunk C] [--json PATH]

The head and loss of one distillation micro-batch, forward and backward, on one process, fp32:
the student's hidden states [N, H] times its output head [V, H] (with grad) give its logits, the
teacher's hidden states [N, Ht] times the teacher's head (no grad) give the teacher's; then

- `gathered`: TRL 1.16's GKDTrainer.generalized_jsd_loss on the full [N, V] logits of both models
  (log-softmax, mixture and divergence terms all [N, V] fp32, held for the backward);
- `megaft`: megaft.distill.losses.token_divergence, which takes the same logits but computes the
  log-softmaxes and the divergence --chunk tokens at a time, recomputing each chunk in the backward
  (nothing of [N, V] beyond the logits themselves and their gradient).

Both are divided by the number of target tokens (TRL's batchmean; a tenth of the tokens are
masked with -100). Before the memory is reported the two must agree: the loss within 1e-5 and
the head's gradient within 1e-4 relative (max-abs difference over max-abs value), or the run exits
with status 1.

What is measured: the peak of the bytes the CPU allocator holds while the forward and backward
run, above what it held before (the inputs and weights), read from torch.profiler's allocation
records (profile_memory=True: every allocation and free with its size, in order; the peak is
the running sum's maximum). That counts every tensor the CPU allocator hands out (the logits,
saved activations, gradients, temporaries), not the Python objects. Under tp each rank holds
V/tp columns of each model's logits and megaft never gathers them; this benchmark runs one
process only.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch
from torch.profiler import ProfilerActivity, profile

VARIANTS = ("gathered", "megaft")  # the first: the ratio's reference
LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4


@dataclass
class Head:
    tokens: int = 4096
    vocab: int = 32000
    hidden: int = 256
    teacher_hidden: int = 384
    beta: float = 0.5
    temperature: float = 1.0
    chunk: int = 1024
    seed: int = 0


def head_inputs(h: Head) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(h.seed)
    labels = torch.randint(0, h.vocab, (1, h.tokens), generator=g)
    labels[torch.rand(1, h.tokens, generator=g) < 0.1] = -100
    return {"student": torch.randn(h.tokens, h.hidden, generator=g),
            "w_student": (torch.randn(h.vocab, h.hidden, generator=g) / h.hidden ** 0.5).requires_grad_(),
            "teacher": torch.randn(h.tokens, h.teacher_hidden, generator=g),
            "w_teacher": torch.randn(h.vocab, h.teacher_hidden, generator=g) / h.teacher_hidden ** 0.5,
            "labels": labels}


def gathered_loss(x: dict[str, torch.Tensor], h: Head) -> torch.Tensor:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.gkd import GKDTrainer

    student = (x["student"] @ x["w_student"].T)[None]
    with torch.no_grad():
        teacher = (x["teacher"] @ x["w_teacher"].T)[None]
    return GKDTrainer.generalized_jsd_loss(student, teacher, x["labels"], beta=h.beta, temperature=h.temperature)


def megaft_loss(x: dict[str, torch.Tensor], h: Head) -> torch.Tensor:
    from megaft.distill.losses import token_divergence

    student = (x["student"] @ x["w_student"].T)[None]
    with torch.no_grad():
        teacher = (x["teacher"] @ x["w_teacher"].T)[None]
    per_token = token_divergence(student, teacher, x["labels"], beta=h.beta, temperature=h.temperature,
                                 chunk=h.chunk)
    return per_token.sum() / (x["labels"] != -100).sum().clamp_min(1)


LOSSES: dict[str, Callable] = {"gathered": gathered_loss, "megaft": megaft_loss}


def peak_bytes(fn: Callable[[], object]) -> tuple[int, object]:
    """fn's result and the peak of the CPU allocator's bytes while it ran, above where it started:
    the running sum of torch.profiler's allocation records (frees negative), maximised."""
    from torch._C._profiler import _EventType

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    sizes = []

    def walk(node) -> None:
        if node.tag == _EventType.Allocation:
            sizes.append((node.start_time_ns, node.extra_fields.alloc_size))
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    running = peak = 0
    for _, size in sorted(sizes):
        running += size
        peak = max(peak, running)
    return peak, out


def measure(variant: str, h: Head) -> dict:
    """One variant's loss, head gradient and peak bytes over its forward and backward."""
    x = head_inputs(h)

    def step() -> float:
        loss = LOSSES[variant](x, h)
        loss.backward()
        return loss.item()

    peak, loss = peak_bytes(step)
    return {"loss": loss, "grad": x["w_student"].grad, "peak_bytes": peak}


def disagreements(runs: dict[str, dict]) -> list[str]:
    want, bad = runs["gathered"], []
    for name, got in runs.items():
        if abs(got["loss"] - want["loss"]) > LOSS_RTOL * abs(want["loss"]):
            bad.append(f"{name} loss {got['loss']:.8f} against the gathered {want['loss']:.8f}")
        diff = (got["grad"] - want["grad"]).abs().max().item()
        if diff > GRAD_RTOL * want["grad"].abs().max().item():
            bad.append(f"{name} head gradient differs by {diff:.3g} (max-abs) from the gathered one")
    return bad


def parse(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = Head()
    p.add_argument("--tokens", type=int, default=d.tokens)
    p.add_argument("--vocab", type=int, default=d.vocab)
    p.add_argument("--hidden", type=int, default=d.hidden, help="the student's hidden size")
    p.add_argument("--teacher-hidden", type=int, default=d.teacher_hidden)
    p.add_argument("--beta", type=float, default=d.beta)
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--chunk", type=int, default=d.chunk, help="megaft's tokens per chunk")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> None:
    a = parse(argv)
    h = Head(a.tokens, a.vocab, a.hidden, a.teacher_hidden, a.beta, a.temperature, a.chunk, a.seed)
    runs = {v: measure(v, h) for v in VARIANTS}
    logits_mib = h.tokens * h.vocab * 4 / 2 ** 20
    print(f"head and loss, forward + backward: {h.tokens} tokens, vocabulary {h.vocab}, student hidden {h.hidden}, "
          f"teacher hidden {h.teacher_hidden}, beta {h.beta}, T {h.temperature}, megaft chunk {h.chunk}; fp32 "
          f"(one [tokens x vocab] fp32 tensor: {logits_mib:.1f} MiB); torch {torch.__version__}")
    bad = disagreements(runs)
    for v, r in runs.items():
        print(f"  {v:<9} loss {r['loss']:.8f}")
    if bad:
        print("the variants disagree; no memory figure is valid:\n  " + "\n  ".join(bad))
        sys.exit(1)
    rows = {v: {"peak_mib": r["peak_bytes"] / 2 ** 20, "in_logits": r["peak_bytes"] / (logits_mib * 2 ** 20),
                "vs_gathered": r["peak_bytes"] / runs["gathered"]["peak_bytes"]} for v, r in runs.items()}
    print(f"\n{'variant':<9} {'peak MiB':>9} {'x [N,V]':>8} {'vs gathered':>12}")
    for v, row in rows.items():
        print(f"{v:<9} {row['peak_mib']:>9.1f} {row['in_logits']:>8.2f} {row['vs_gathered']:>11.3f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": "python -m benchmarks.distill " + " ".join(sys.argv[1:] if argv is None else argv),
                       "head": asdict(h), "results": rows, "loss": {v: r["loss"] for v, r in runs.items()}},
                      f, indent=1)


if __name__ == "__main__":
    main()
