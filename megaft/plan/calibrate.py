"""`megaft-plan plan.calibrate=RUN_DIR`: the cluster's correction factors from one finished run.

A megaft-train run logs, per step, the seconds of four phases (megaft.training.phases: forward,
backward, the optimizer step, communication nothing hid) and its step time (metrics.jsonl), and
writes the config it ran (config.yaml). The planner prices that same config, on the run's world
size and the plan's cluster, and sets four factors of the cluster (megaft.perf.rates) so that
each phase group it predicts equals the run's mean over its steady steps (the first step, the
warm-up, left out):

* `compute_scale` from forward + backward (the model's compute, tp/cp/ep collectives and ZeRO-3's
  exposed gathers): every compute second scales, so what the run measured of its GEMMs, attention
  and elementwise kernels moves the whole curve and not one row;
* `comm_scale` from the exposed communication (the model's dp_comm + pp_bubble): every collective's
  and message's time scales; a run with nothing exposed to price (dp·cp = 1 and pp = 1) leaves it
  at 1 and says so;
* `optimizer_scale` from the optimizer step (the AdamW update, ZeRO's parameter gather, offload);
* `step_overhead_s`: what the measured step spends outside the model's terms once the three are set
  (data, logging, the loss's read-back; a phase the model could not reach), at least 0.

Those four because they are what the run measures apart: one factor per measured phase, each
applied where that phase's time comes from, plus the rest of the step. They are calibrated, not
fitted: one run sets them and every layout of the plan is priced with them, shapes and links
still by the preset's curves. The groups share terms (tp collectives sit inside forward, the
gathers inside the optimizer step), so the three are solved in turn, a few rounds, each by
bisection on the factor (every group grows with its factor).

The run must match the plan: the same model family (model.arch: its kernels), the same device
(the run's GPU name against the cluster's gpu_type; a CPU run only a CPU cluster, one without
gpu_type) and the same precision. Otherwise it is refused with the fix. megaft-plan prints the
factors, writes them to its run directory's calibration.json (schema megaft.calibration/1) and
plan.json, and prints them as `cluster.*` overrides: `plan.calibrate=<that calibration.json>`
or the overrides reuse them without the run.
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
from dataclasses import dataclass, field
from typing import Optional

from megaft.fileio import read_json, read_jsonl
from megaft.perf.hardware import device, device_match
from megaft.perf.time import step_cost
from megaft.run_dir import METRICS
from megaft.training.run_config import read_run_config
from megaft.training.summary import RunSummary

SCHEMA = "megaft.calibration/1"
FILE = "calibration.json"
TERM_GROUPS = (  # (name, the cost model's terms, the measured phase keys: megaft.training.phases.PHASE_KEYS)
    ("forward+backward", ("compute", "tp_comm", "cp_comm", "ep_comm", "zero_comm"), ("forward_s", "backward_s")),
    ("optimizer", ("optimizer", "param_gather", "offload"), ("optimizer_s",)),
    ("exposed comm", ("dp_comm", "pp_bubble"), ("comm_s",)),
)
FACTORS = {"forward+backward": "compute_scale", "exposed comm": "comm_scale", "optimizer": "optimizer_scale"}
UNCALIBRATED = {"compute_scale": 1.0, "comm_scale": 1.0, "optimizer_scale": 1.0, "step_overhead_s": 0.0}
ROUNDS = 4  # solving each factor in turn: the groups share a few terms; 4 rounds settle them here
BOUNDS = (1e-4, 1e4)  # a factor outside them is a run the model cannot describe: clamped, and said


@dataclass
class Calibration:
    """Where the factors came from, the factors, and the run's groups before and after."""

    source: str  # the run directory (or the calibration.json they were read from)
    run: dict  # arch, model, layout, world_size, device, device_name, precision, steps
    factors: dict = field(default_factory=lambda: dict(UNCALIBRATED))
    measured: dict = field(default_factory=dict)  # seconds per group and the step, the run's means
    before: dict = field(default_factory=dict)  # the model's prediction with the preset's figures
    after: dict = field(default_factory=dict)  # ... with the factors
    notes: list = field(default_factory=list)

    def overrides(self) -> list[str]:
        return [f"cluster.{k}={v:.6g}" for k, v in self.factors.items()]

    def to_json(self) -> dict:
        return {"schema": SCHEMA, **dataclasses.asdict(self), "overrides": self.overrides()}


def measured_means(run_dir: str) -> tuple[Optional[dict], Optional[RunSummary], list[str]]:
    """({step_s, forward_s, ...: mean over the steady steps, steps}, summary, problems) of a finished run."""
    summary = RunSummary.read(run_dir)
    fix = "fix: point plan.calibrate at a finished megaft-train run directory (summary.json, metrics.jsonl)"
    if summary is None or not summary.steps:
        return None, summary, [f"plan.calibrate={run_dir!r}: no summary.json of a finished run; {fix}"]
    train = [r for r in read_jsonl(os.path.join(run_dir, METRICS)) if "loss" in r and r.get("tokens_per_s")]
    steady = train[1:]
    if not steady:
        return None, summary, [f"plan.calibrate={run_dir!r}: {len(train)} train step(s) logged, none after the "
                               "warm-up step; fix: calibrate from a run of 3 or more steps"]
    keys = [k for _, _, phases in TERM_GROUPS for k in phases]
    if any(k not in r for r in steady for k in keys):
        return None, summary, [f"plan.calibrate={run_dir!r}: its metrics lines lack the phase times "
                               f"({', '.join(keys)}); fix: rerun it with train.log_phases=true"]
    per_step = summary.tokens / summary.steps
    out = {"step_s": statistics.fmean(per_step / float(r["tokens_per_s"]) for r in steady), "steps": len(steady)}
    out.update({k: statistics.fmean(float(r[k]) for r in steady) for k in keys})
    return out, summary, []


def mismatch(run: dict, cfg, cluster, source: str) -> list[str]:
    """Why a run (Calibration.run) cannot calibrate the plan of `cfg` on `cluster`, each with its fix."""
    problems = []
    if run["arch"] != cfg.model.arch:
        problems.append(f"plan.calibrate={source!r}: the run trained model.arch={run['arch']} ({run['model']}), this "
                        f"plan model.arch={cfg.model.arch}: one family's kernels say nothing of another's; fix: "
                        f"calibrate from a few steps of a {cfg.model.arch} model on this cluster, or drop "
                        "plan.calibrate")
    row = device(cluster.gpu_type) if cluster.gpu_type else None
    on_cpu = not str(run["device"]).startswith("cuda")
    if on_cpu != (not cluster.gpu_type) or (row is not None and device_match(run["device_name"]) != row.match):
        ran = "CPU" if on_cpu else (run["device_name"] or run["device"])
        plans = f"gpu_type={cluster.gpu_type}" if cluster.gpu_type else "CPU ranks"
        problems.append(f"plan.calibrate={source!r}: the run ran on {ran}, this plan is for cluster={cluster.name} "
                        f"({plans}); fix: calibrate from a run on this cluster's devices, or plan for the run's "
                        f"(a CPU run: cluster=cpu)")
    if run["precision"] != str(cfg.precision):
        problems.append(f"plan.calibrate={source!r}: the run ran precision={run['precision']}, this plan "
                        f"precision={cfg.precision}; fix: precision={run['precision']}, or calibrate from a "
                        f"{cfg.precision} run")
    return problems


def _groups(cost) -> dict:
    out = {name: sum(cost.terms[t] for t in terms) for name, terms, _ in TERM_GROUPS}
    out["overhead"], out["step_s"] = cost.terms["overhead"], cost.step_s
    return out


def _solve(f, target: float) -> float:
    """x in BOUNDS with f(x) = target for an increasing f (geometric bisection), else the bound nearer."""
    lo, hi = BOUNDS
    if f(lo) >= target:
        return lo
    if f(hi) <= target:
        return hi
    for _ in range(60):  # (hi/lo) ** (2 ** -60): far below a float's resolution of the factor
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
    return (lo * hi) ** 0.5


def from_run(run_dir: str, cfg, cluster) -> tuple[Optional[Calibration], list[str]]:
    """The factors of `cluster` (the plan's, links measured) from the run in `run_dir`, for the plan of `cfg`."""
    meas, summary, problems = measured_means(run_dir)
    ran = read_run_config(run_dir)
    if ran is None and not problems:
        problems = [f"plan.calibrate={run_dir!r}: no config.yaml (the config the run ran); fix: calibrate from a "
                    "run of this megaft version"]
    if problems:
        return None, problems
    rcfg = ran.config
    run = {"arch": rcfg.model.arch, "model": rcfg.model.name, "world_size": ran.world_size,
           "device": summary.device, "device_name": summary.device_name, "precision": str(rcfg.precision),
           "layout": f"tp={rcfg.parallel.tp} cp={rcfg.parallel.cp} pp={rcfg.parallel.pp} dp={rcfg.parallel.dp} "
                     f"zero={rcfg.parallel.zero} mbs={rcfg.train.micro_batch_size}", "steps": meas["steps"]}
    problems = mismatch(run, cfg, cluster, run_dir)
    if problems:
        return None, problems
    # the plan's cluster (device facts and measured links in) on the run's ranks; config.yaml holds the
    # run's resolved shapes, so its config is priced as it is
    world = ran.world_size
    base = dataclasses.replace(cluster, nodes=-(-world // cluster.gpus_per_node), **UNCALIBRATED)
    shaped = dataclasses.replace(rcfg, model=dataclasses.replace(rcfg.model, init_from=None), cluster=base)
    cal = Calibration(run_dir, run, measured={name: sum(meas[k] for k in keys) for name, _, keys in TERM_GROUPS})
    cal.measured["step_s"] = meas["step_s"]
    cal.before = _groups(step_cost(shaped, base, world))
    factors = {k: v for k, v in UNCALIBRATED.items() if k != "step_overhead_s"}
    active = []
    for name, terms, _ in TERM_GROUPS:
        if cal.before[name] > 0 and cal.measured[name] > 0:
            active.append((name, terms))
        else:
            cal.notes.append(f"{FACTORS[name]} stays 1: the run's {name} measured {cal.measured[name]:.3g} s, the "
                             f"model prices {cal.before[name]:.3g} s of it for this layout (nothing to scale); what "
                             "it measured counts in the step overhead")
    def group(factor: str, x: float, terms: tuple) -> float:
        c = dataclasses.replace(base, **{**factors, factor: x})
        return sum(step_cost(shaped, c, world).terms[t] for t in terms)

    for _ in range(ROUNDS):
        for name, terms in active:
            factor = FACTORS[name]
            x = _solve(lambda y, t=terms: group(factor, y, t), cal.measured[name])
            # no other group past its measurement (a collective in the optimizer step bounds the comm_scale
            # the exposed comm asks for): what stays unexplained goes to the overhead instead
            for other, others in active:
                if other != name and group(factor, x, others) > cal.measured[other] * (1 + 1e-9) > group(
                        factor, BOUNDS[0], others):
                    x = min(x, _solve(lambda y, t=others: group(factor, y, t), cal.measured[other]))
            factors[factor] = x
    rest = cal.measured["step_s"] - step_cost(shaped, dataclasses.replace(base, **factors), world).step_s
    cal.factors = {**factors, "step_overhead_s": max(rest, 0.0)}
    cal.after = _groups(step_cost(shaped, dataclasses.replace(base, **cal.factors), world))
    for name, _ in active:
        factor, got, want = FACTORS[name], cal.after[name], cal.measured[name]
        if factors[factor] in BOUNDS or abs(got / want - 1) > 1e-6:
            cal.notes.append(f"{factor}={factors[factor]:.4g} prices the run's {name} at {got:.3g} s of the "
                             f"{want:.3g} s measured: the factor cannot reach it without another group past its "
                             "own measurement (or its bound); the difference counts in the step overhead")
    return cal, []


def from_file(path: str, cfg, cluster) -> tuple[Optional[Calibration], list[str]]:
    """A calibration megaft-plan wrote (calibration.json), checked against this plan as its run would be."""
    doc = read_json(path)
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        return None, [f"plan.calibrate={path!r} is not a {SCHEMA} file (got {type(doc).__name__}); fix: point it at "
                      f"a finished run directory or at the {FILE} a megaft-plan run wrote"]
    fields = {f.name for f in dataclasses.fields(Calibration)}
    cal = Calibration(**{k: v for k, v in doc.items() if k in fields})
    problems = mismatch(cal.run, cfg, cluster, path)
    return (None, problems) if problems else (cal, [])


_DONE: dict = {}  # (source, its mtime, the plan's shape, the cluster) -> (Calibration, problems)
_LATEST: dict = {}  # source -> the Calibration last applied


def calibrate(cfg, cluster) -> tuple[object, Optional[Calibration], list[str]]:
    """(cluster with plan.calibrate's factors, the Calibration, problems); unchanged without plan.calibrate."""
    source = cfg.plan.calibrate
    if not source:
        return cluster, None, []
    path = source if os.path.isfile(source) else os.path.join(source, METRICS)
    if not os.path.exists(path):
        return cluster, None, [f"plan.calibrate={source!r}: neither a run directory with {METRICS} nor a "
                               f"{FILE}; fix: point it at a finished megaft-train run directory"]
    key = (source, os.path.getmtime(path), cfg.model.arch, str(cfg.precision), json.dumps(
        dataclasses.asdict(cluster), sort_keys=True, default=str))
    if key not in _DONE:
        _DONE[key] = (from_file if os.path.isfile(source) else from_run)(source, cfg, cluster)
    cal, problems = _DONE[key]
    if problems:
        return cluster, None, problems
    _LATEST[source] = cal
    return dataclasses.replace(cluster, **cal.factors), cal, []


def latest(source: str) -> Optional[Calibration]:
    """The Calibration planning_config last applied from `source` (what megaft-plan prints and writes)."""
    return _LATEST.get(source)


def format_calibration(cal: Calibration) -> str:
    """What megaft-plan prints: the source, the factors, the run's groups measured and predicted."""
    r = cal.run
    lines = [f"megaft-plan: calibrated from {cal.source}: {r['model']} ({r['arch']}) {r['layout']} on "
             f"{r['world_size']} rank(s) of {r['device_name'] or r['device']}, {r['precision']}, mean of {r['steps']} "
             "steady steps"]
    lines += [f"  {name:<17} measured {cal.measured.get(name, 0):.4g} s, predicted {cal.before.get(name, 0):.4g} s "
              f"-> {cal.after.get(name, 0):.4g} s" for name in [*(n for n, _, _ in TERM_GROUPS), "step_s"]]
    lines.append("  factors: " + " ".join(cal.overrides()) + "  (every layout below is priced with them)")
    lines += [f"  note: {n}" for n in cal.notes]
    return "\n".join(lines)
