"""VerifyConfig (`verify.*`): how `megaft-verify` checks a layout against the single process.
A config-layer leaf: the root Config composes it, so one set of overrides serves
megaft-train and megaft-verify alike."""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Optional

# Default tolerances per precision: (loss, grad_norm, step-1 gradients), each relative.
# fp32: a dense layout reproduces the single process to ~1e-7 per step (reduction order
# only), so 1e-5 leaves two decades of margin and still catches a wrong reduction. Adam
# divides a near-zero gradient element by sqrt(v) + eps, so at eps=1e-8 its rounding can
# grow to a visible weight difference within a few steps (issue 44: a mixture's packed
# layouts under a preference loss); raise optim.eps or verify fewer steps when a layout
# fails by that little.
# bf16/fp16: autocast rounds activations to 8/11 mantissa bits, and the layouts round
# at different places, so differences of ~1e-2 are rounding, not bugs.
TOLERANCES = {"fp32": (1e-5, 1e-4, 1e-4), "bf16": (3e-2, 5e-2, 1e-1), "fp16": (1e-2, 2e-2, 5e-2)}
VerifyPrecision = StrEnum("VerifyPrecision", [(p, p) for p in TOLERANCES])  # the root's Precision values


class Shrink(StrEnum):
    none = "none"  # the model as configured
    auto = "auto"  # fewer layers, a smaller hidden size; every divisibility of the layout kept


@dataclass
class VerifyConfig:
    steps: int = 5  # optimizer steps each run takes
    shrink: Shrink = Shrink.none  # auto: the smallest model with the same layout constraints (random init)
    # both runs' precision (fp32 | bf16 | fp16), whatever `precision` says
    precision: VerifyPrecision = VerifyPrecision.fp32
    loss_rtol: Optional[float] = None  # |Δloss| / |loss| per step; None = TOLERANCES[precision]
    grad_norm_rtol: Optional[float] = None  # |Δgrad_norm| / grad_norm per step; None = the table
    grad_rtol: Optional[float] = None  # max|Δg| / max|g| per parameter at step 1; None = the table

    def tolerances(self) -> tuple[float, float, float]:
        given = (self.loss_rtol, self.grad_norm_rtol, self.grad_rtol)
        loss, norm, grad = (d if g is None else g for g, d in zip(given, TOLERANCES[self.precision]))
        return loss, norm, grad


def check_verify(cfg: VerifyConfig) -> list[str]:
    problems = []
    if cfg.steps < 1:
        problems.append(f"verify.steps={cfg.steps} must be >= 1; fix: e.g. verify.steps=5")
    if cfg.precision not in TOLERANCES:
        problems.append(f"verify.precision={cfg.precision!r} is unknown; fix: fp32, bf16 or fp16")
    for name in ("loss_rtol", "grad_norm_rtol", "grad_rtol"):
        value = getattr(cfg, name)
        if value is not None and value <= 0:
            problems.append(f"verify.{name}={value} must be > 0; fix: a positive tolerance, or null for the default")
    return problems
