"""`megaft-plan ... plan.probe=K`: run the top K layouts for a few steps and re-rank them.

The K layouts become one Hydra multirun of megaft-train (megaft.plan.multirun: one
generated `plan_probe/rankN` option per layout) submitted through megaft's Slurm
launcher. They all have the planned world size (cluster.nodes x cluster.gpus_per_node,
`launcher.nodes=cluster.nodes`), so they form ONE job array. Each point trains
`plan.probe_steps` steps with no checkpoints, no HF export and no progress bar; the
launcher preset and its settings are megaft-plan's own `hydra/launcher=...` and
`hydra.launcher.*` overrides (default `hydra/launcher=slurm`), passed on as given.
megaft-plan waits (`hydra.launcher.wait=true`, at most `plan.probe_timeout_min`, then the
arrays are cancelled), reads every run's metrics and summary.json (megaft.plan.multirun.measured:
medians after the warm-up step), re-ranks by measured tokens/s per GPU and prints the
cost model's error per term.

The training phases megaft measures (megaft.training.phases) are coarser than the
model's terms, so the error is per group of terms: forward+backward (compute and the
collectives inside forward/backward: tp, cp, ZeRO-3's gathers), optimizer (the update,
ZeRO's parameter all-gather, offload) and exposed comm (the dp reduction nothing hides
and the pipeline's receive waits, i.e. dp_comm + pp_bubble), plus the whole step. The
part of a measured step outside every phase (data, logging) is shown as "not modeled", beside the
model's `overhead` term (cluster.step_overhead_s: 0 unless plan.calibrate set it, megaft.plan.calibrate).
"""
from __future__ import annotations

import os
import time

from megaft.plan.calibrate import TERM_GROUPS  # (name, the model's terms, the measured phases)
from megaft.plan.multirun import measured, multirun_command, override_key, points_by_name, run_multirun, write_group
from megaft.plan.report import format_table

GROUP = "plan_probe"
# What every probe point sets; the user's own values for these are dropped.
PROBE_KEYS = ("train.max_steps", "train.save_every", "train.save_final", "train.export_hf",
              "train.progress", "train.tensorboard", "launcher.nodes")
COLUMNS = ("#", "plan#", "layout", "pred step s", "meas step s", "pred tok/s/GPU", "meas tok/s/GPU", "step error")


def launcher_overrides(hydra_overrides: list[str]) -> list[str]:
    """megaft-plan's hydra/launcher=... and hydra.launcher.* overrides, for the multirun."""
    return [o for o in hydra_overrides if o.startswith(("hydra/launcher=", "hydra.launcher."))]


def term_errors(cost, meas: dict) -> dict:
    """{group: {predicted_s, measured_s, ratio}} for TERM_GROUPS and the step."""
    out = {}
    for name, terms, phases in TERM_GROUPS:
        values = [meas.get(p) for p in phases]
        if any(v is None for v in values):
            continue
        pred, got = sum(cost.terms[t] for t in terms), sum(values)
        out[name] = {"predicted_s": pred, "measured_s": got, "ratio": pred / got if got > 0 else None}
    phases = [meas.get(p) for _, _, keys in TERM_GROUPS for p in keys]
    if meas.get("step_s") and all(v is not None for v in phases):
        out["not modeled"] = {"predicted_s": cost.terms["overhead"],  # cluster.step_overhead_s (calibrated)
                              "measured_s": max(meas["step_s"] - sum(phases), 0.0), "ratio": None}
    if meas.get("step_s"):
        out["step"] = {"predicted_s": cost.step_s, "measured_s": meas["step_s"], "ratio": cost.step_s / meas["step_s"]}
    return out


def run_probe(cands: list, cluster, run_dir: str, user: list[str], launcher: list[str], plan) -> dict:
    """Probe `cands` (megaft.plan.space.Candidates, planned order) as one multirun under
    run_dir/probe; prints the re-ranked table and the errors, returns plan.json's "probe"."""
    sweep_dir = os.path.join(run_dir, "probe")
    names = [f"rank{i + 1}" for i in range(len(cands))]
    write_group(os.path.join(run_dir, "probe_conf"), GROUP,
                {n: [*c.layout.overrides(), f"launcher.nodes={cluster.nodes}"] for n, c in zip(names, cands)})
    # a probe runs plan.probe_steps steps: a recipe's train.epochs beside them would be refused
    user = [o for o in user if override_key(o) != "train.epochs"] + ["train.epochs=null"]
    # The command line wins over the points' files: leave out what a layout sets (model.recompute, ...).
    point_keys = {override_key(o) for c in cands for o in c.layout.overrides()} | set(PROBE_KEYS)
    common = [o for o in user if override_key(o) not in point_keys]
    common += [f"train.max_steps={plan.probe_steps}", "train.save_every=0", "train.save_final=false",
               "train.export_hf=false",
               "train.progress=false", "train.tensorboard=false"]
    cmd = multirun_command(group=GROUP, names=names, conf_root=os.path.join(run_dir, "probe_conf"),
                           sweep_dir=sweep_dir, launcher=launcher, common=common)
    print(f"megaft-plan: probing the top {len(cands)} layouts for {plan.probe_steps} steps each as one Slurm "
          f"array; sweep {sweep_dir}", flush=True)
    started = time.monotonic()
    status, tail = run_multirun(cmd, sweep_dir, plan.probe_timeout_min * 60)
    points = points_by_name(sweep_dir, GROUP)
    runs = []
    for i, (name, cand) in enumerate(zip(names, cands)):
        point = points.get(name, {})
        meas = measured(point["run_dir"]) if point.get("status") == "submitted" else None
        runs.append({"plan_rank": i + 1, "layout": cand.layout.short(), "overrides": cand.layout.overrides(),
                     "job_id": point.get("job_id"), "run_dir": point.get("run_dir"),
                     "status": "measured" if meas else point.get("status", "not submitted"),
                     "problems": point.get("problems", []),
                     "predicted": {"step_s": cand.cost.step_s, "tokens_per_s_per_gpu": cand.cost.tokens_per_s_per_gpu,
                                   "terms_s": cand.cost.terms},
                     "measured": meas, "errors": term_errors(cand.cost, meas) if meas else {}})
    done = sorted((r for r in runs if r["measured"]), key=lambda r: -r["measured"]["tokens_per_s_per_gpu"])
    arrays = sorted({r["job_id"].split("_")[0] for r in runs if r["job_id"]})
    record = {"sweep_dir": sweep_dir, "command": cmd, "exit_status": status, "steps": plan.probe_steps,
              "array_job_ids": arrays, "wall_s": time.monotonic() - started,
              "ranking": [r["plan_rank"] for r in done], "runs": runs}
    print(f"megaft-plan: probe array(s) {', '.join(arrays) or '-'}: {len(done)} of {len(runs)} layouts measured "
          f"in {record['wall_s']:.0f} s (megaft-train -m exit status {status})")
    if len(done) < len(runs):
        for r in runs:
            if not r["measured"]:
                print(f"  plan #{r['plan_rank']} {r['status']}: {'; '.join(r['problems']) or r['run_dir'] or ''}")
        print("megaft-train -m said (tail):\n" + tail)
    if done:
        print("re-ranked by measured tokens/s per GPU:\n" + format_table(
            [[str(i + 1), str(r["plan_rank"]), r["layout"], f"{r['predicted']['step_s']:.3g}",
              f"{r['measured']['step_s']:.3g}", f"{r['predicted']['tokens_per_s_per_gpu']:.4g}",
              f"{r['measured']['tokens_per_s_per_gpu']:.4g}", ratio_cell(r["errors"].get("step", {}))]
             for i, r in enumerate(done)], header=COLUMNS))
        print(format_errors(done))
    return record


def ratio_cell(err: dict) -> str:
    ratio = err.get("ratio")
    return "-" if ratio is None else f"{100 * (ratio - 1):+.0f}%"


def format_errors(done: list[dict]) -> str:
    """The model's error per term group: predicted/measured seconds and the relative error."""
    groups = [g for g, _, _ in TERM_GROUPS] + ["not modeled", "step"]
    rows = []
    for g in groups:
        cells = []
        for r in done:
            e = r["errors"].get(g)
            cells.append("-" if e is None else f"{e['predicted_s']:.3g}/{e['measured_s']:.3g} ({ratio_cell(e)})")
        rows.append([g, *cells])
    header = ["model error per term (pred/meas s)", *(f"plan#{r['plan_rank']}" for r in done)]
    return format_table(rows, header=header)
