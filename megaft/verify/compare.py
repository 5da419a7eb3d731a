"""Comparing two runs: per-step loss and grad norm, and every parameter's step-1 gradient.

The step-1 gradient is read back from each run's step-1 checkpoint: after one AdamW
step the first moment is exactly (1 - beta1) × the clipped gradient, and the
checkpoint machinery reassembles it by parameter name from any tp/pp/dp/ZeRO layout
(megaft.checkpoint.reshard.named_moments). So the comparison covers the gradient the
optimizer really used, after every reduction, for every layout megaft trains.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass
class StepRow:
    step: int
    loss: float
    ref_loss: float
    grad_norm: float
    ref_grad_norm: float
    aux: Optional[float] = None  # a mixture of experts' load-balancing loss (metrics aux_loss)
    ref_aux: Optional[float] = None

    @property
    def loss_rel(self) -> float:
        return rel(self.loss, self.ref_loss)

    @property
    def aux_rel(self) -> float:
        return 0.0 if self.ref_aux is None else rel(math.nan if self.aux is None else self.aux, self.ref_aux)

    @property
    def grad_norm_rel(self) -> float:
        return rel(self.grad_norm, self.ref_grad_norm)


@dataclass
class Report:
    rows: list[StepRow]
    grads: list[tuple[str, float]]  # (parameter, max|Δg| / max|g|), worst first
    tolerances: tuple[float, float, float]
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what the comparison changed in the user's config

    @property
    def passed(self) -> bool:
        return not self.failures

    def format(self) -> str:
        loss_tol, norm_tol, grad_tol = self.tolerances
        lines = [f"{'step':>5} {'loss':>12} {'reference':>12} {'rel diff':>9}   {'grad_norm':>12} "
                 f"{'reference':>12} {'rel diff':>9}"]
        moe = any(r.ref_aux is not None for r in self.rows)
        if moe:
            lines[0] += f"   {'aux_loss':>12} {'reference':>12} {'rel diff':>9}"
        for r in self.rows:
            lines.append(f"{r.step:>5} {r.loss:>12.6f} {r.ref_loss:>12.6f} {r.loss_rel:>9.2e}   "
                         f"{r.grad_norm:>12.6f} {r.ref_grad_norm:>12.6f} {r.grad_norm_rel:>9.2e}"
                         + (f"   {r.aux or math.nan:>12.6f} {r.ref_aux or math.nan:>12.6f} {r.aux_rel:>9.2e}"
                            if moe else ""))
        if self.grads:
            name, worst = self.grads[0]
            lines.append(f"step-1 gradients: largest relative difference {worst:.2e} in {name} "
                         f"({len(self.grads)} parameters compared)")
        lines.append(f"tolerances: loss {loss_tol:g}, grad_norm {norm_tol:g}, gradients {grad_tol:g} (relative)")
        lines += [f"note: {n}" for n in self.notes]
        lines += [f"FAIL: {f}" for f in self.failures] or ["PASS: the layout equals the single process"]
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"passed": self.passed, "failures": self.failures, "notes": self.notes,
                "tolerances": list(self.tolerances),
                "steps": [dict(step=r.step, loss=r.loss, ref_loss=r.ref_loss, loss_rel=r.loss_rel,
                               grad_norm=r.grad_norm, ref_grad_norm=r.ref_grad_norm,
                               grad_norm_rel=r.grad_norm_rel,
                               **({} if r.ref_aux is None else dict(aux_loss=r.aux, ref_aux_loss=r.ref_aux,
                                                                     aux_loss_rel=r.aux_rel)))
                          for r in self.rows],
                "grads": [{"name": n, "rel": d} for n, d in self.grads]}


def rel(a: float, b: float) -> float:
    if math.isnan(a) or math.isnan(b):
        return math.inf
    return abs(a - b) / max(abs(b), 1e-12)


def train_lines(metrics_path: str) -> dict[int, dict]:
    """step -> the train line of a run's metrics.jsonl."""
    out = {}
    with open(metrics_path) as f:
        for line in f:
            rec = json.loads(line)
            if "loss" in rec:
                out[rec["step"]] = rec
    return out


def grad_differences(user: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> list[tuple[str, float]]:
    """(name, max|Δ| / max|ref|) for every parameter of the reference, worst first; a
    parameter missing from `user` counts as infinitely different."""
    out = []
    for name, r in ref.items():
        u = user.get(name)
        if u is None or u.shape != r.shape:
            out.append((name, math.inf))
            continue
        scale = r.abs().max().item()
        out.append((name, (u.double() - r.double()).abs().max().item() / max(scale, 1e-30)))
    return sorted(out, key=lambda x: -x[1])


def compare(user_metrics: str, ref_metrics: str, user_grads: Optional[dict], ref_grads: Optional[dict],
            tolerances: tuple[float, float, float]) -> Report:
    """The report of two runs; failures name the first step and the worst parameter that differ."""
    loss_tol, norm_tol, grad_tol = tolerances
    user, ref = train_lines(user_metrics), train_lines(ref_metrics)
    rows = [StepRow(s, user[s]["loss"], ref[s]["loss"], user[s]["grad_norm"], ref[s]["grad_norm"],
                    user[s].get("aux_loss"), ref[s].get("aux_loss")) for s in sorted(ref) if s in user]
    report = Report(rows, grad_differences(user_grads, ref_grads) if ref_grads else [], tolerances)
    if len(rows) != len(ref):
        report.failures.append(f"the layout ran {len(user)} step(s), the reference {len(ref)}")
    bad = next((r for r in rows if not (r.loss_rel <= loss_tol and r.grad_norm_rel <= norm_tol
                                        and r.aux_rel <= loss_tol)), None)
    if bad is not None:
        report.failures.append(f"step {bad.step} differs: loss {bad.loss:.8g} vs {bad.ref_loss:.8g} "
                               f"(rel {bad.loss_rel:.2e}), grad_norm {bad.grad_norm:.8g} vs "
                               f"{bad.ref_grad_norm:.8g} (rel {bad.grad_norm_rel:.2e})"
                               + ("" if bad.ref_aux is None else f", aux_loss {bad.aux} vs {bad.ref_aux:.8g} "
                                                                 f"(rel {bad.aux_rel:.2e})"))
    if report.grads and report.grads[0][1] > grad_tol:
        name, worst = report.grads[0]
        report.failures.append(f"parameter {name} differs at step 1: max|Δgrad| / max|grad| = {worst:.2e} "
                               f"> {grad_tol:g}")
    return report
