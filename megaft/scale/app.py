"""`megaft-scale`: a strong or weak scaling study as one multirun of megaft-train, then its report.

    megaft-scale mode=strong nodes=[1,2,4,8] hydra/launcher=slurm model=1b parallel.tp=8 ...
    megaft-scale mode=strong nodes=[1,2] ranks_per_node=1 place_nodes=false \\
        hydra/launcher=slurm_cpu device=cpu parallel.tp=1 ...        # single-host CPU Slurm: 1 vs 2 ranks

Its own keys: `mode` (strong | weak), `nodes` (increasing node counts), `ranks_per_node`
(default 8) and `place_nodes` (default true); what they mean is megaft.scale.study's
docstring. Everything else is megaft-train's: the config overrides are composed here
with megaft-train's config tree (a bad one exits 2 before anything is queued) and passed
on; `hydra/launcher=...` (default slurm), `hydra.launcher.*` and `hydra.sweep.dir` (default
multirun/scale-<time>) go to the multirun. Each node count is one point
(`+scale_point=n<N>`, megaft.plan.multirun), submitted through megaft's Slurm launcher; the
command waits for the jobs, then runs `megaft-report` on the sweep dir (`python -m
megaft.report`, a process of its own, as megaft-train -m is), which adds
speedup, efficiency and communication share columns and scaling.png (megaft.scale.report).
Exit status: 0 when every point finished, 1 otherwise, 2 on a bad study or config.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Optional

from omegaconf import OmegaConf

from megaft.config import compose_config
from megaft.fileio import write_json_atomic
from megaft.plan.multirun import multirun_command, override_key, run_multirun, wait_dequeued, write_group
from megaft.scale.study import GROUP, POINT_KEYS, SCALE_FILE, study_points

OWN_KEYS = {"mode": "strong", "nodes": [1, 2, 4, 8], "ranks_per_node": 8, "place_nodes": True}


def split_args(argv: list[str]) -> tuple[dict, list[str], list[str], Optional[str]]:
    """(own keys, megaft-train's config overrides, launcher overrides, hydra.sweep.dir)."""
    own, task, launcher, sweep_dir = dict(OWN_KEYS), [], [], None
    for arg in argv:
        key = override_key(arg)
        if key in OWN_KEYS:
            own[key] = OmegaConf.from_dotlist([f"{key}={arg.split('=', 1)[1]}"])[key]
        elif key == "hydra.sweep.dir":
            sweep_dir = arg.split("=", 1)[1]
        elif arg.startswith(("hydra/launcher=", "hydra.launcher.")):
            launcher.append(arg)
        elif key.startswith(("hydra.", "hydra/")):
            raise ValueError(f"{arg}: megaft-scale passes on only hydra/launcher, hydra.launcher.* and "
                             "hydra.sweep.dir")
        else:
            task.append(arg)
    own["nodes"] = [int(n) for n in (own["nodes"] if isinstance(own["nodes"], (list, tuple)) or
                                     OmegaConf.is_list(own["nodes"]) else [own["nodes"]])]
    return own, task, launcher, sweep_dir


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        own, task, launcher, sweep_dir = split_args(argv)
        cfg = compose_config(task)
    except Exception as exc:  # a bad override or value: Hydra's and OmegaConf's errors alike
        print(f"megaft-scale: {exc}", file=sys.stderr)
        return 2
    points, problems = study_points(cfg, str(own["mode"]), own["nodes"], int(own["ranks_per_node"]),
                                    bool(own["place_nodes"]))
    if problems:
        print("megaft-scale: the study cannot run:\n" + "\n".join(f"  - {p}" for p in problems), file=sys.stderr)
        return 2
    sweep_dir = os.path.abspath(sweep_dir or os.path.join("multirun", time.strftime("scale-%Y-%m-%d_%H-%M-%S")))
    os.makedirs(sweep_dir, exist_ok=True)
    conf_root = os.path.join(sweep_dir, "scale_conf")
    write_group(conf_root, GROUP, {p["name"]: p["overrides"] for p in points})
    common = [o for o in task if override_key(o) not in POINT_KEYS]
    cmd = multirun_command(group=GROUP, names=[p["name"] for p in points], conf_root=conf_root,
                           sweep_dir=sweep_dir, launcher=launcher, common=common)
    write_json_atomic(os.path.join(sweep_dir, SCALE_FILE), {
        "mode": own["mode"], "nodes": own["nodes"], "ranks_per_node": own["ranks_per_node"],
        "place_nodes": own["place_nodes"], "tp": cfg.parallel.tp, "cp": cfg.parallel.cp, "pp": cfg.parallel.pp,
        "micro_batch_size": cfg.train.micro_batch_size, "points": points, "common_overrides": common,
        "command": cmd})
    print(f"megaft-scale: {own['mode']} scaling over nodes={own['nodes']} ({own['ranks_per_node']} rank(s) per "
          f"node): {len(points)} runs, sweep {sweep_dir}", flush=True)
    status, tail = run_multirun(cmd, sweep_dir, None)
    if status != 0:
        print(f"megaft-scale: megaft-train -m exited {status}; its output's tail:\n{tail}", file=sys.stderr)
    wait_dequeued(sweep_dir)  # so that megaft-report sees them done, not running
    return 1 if status != 0 or report(sweep_dir) != 0 else 0


def report(sweep_dir: str) -> int:
    """megaft-report on the sweep dir, as its own command (as the study ran megaft-train -m):
    megaft-report reads what megaft-scale wrote, never the reverse; its exit status."""
    sys.stdout.flush()
    return subprocess.run([sys.executable, "-m", "megaft.report", sweep_dir]).returncode


if __name__ == "__main__":
    sys.exit(main())
