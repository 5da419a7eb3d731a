"""`megaft-plan`: the Hydra app. Same config tree and overrides as megaft-train plus the
`cluster` group (conf/cluster/) and `plan.*`; prints the best layouts that fit, writes
plan.json in its run directory, and exits 0 when a layout fits, 1 when none does, 2 on
a bad config.

    megaft-plan model.init_from=/ckpt/Llama-3.1-70B cluster=h100 cluster.nodes=8 \\
        data.seq_len=8192 model.max_seq_len=8192 train.global_batch_size=128 precision=bf16

The checkpoint folder needs only config.json: the planner reads the architecture with
megaft.models.hf.hf_model_config and never the weights, the tokenizer or the data files
(megaft-train validates those when it runs). Every layout is then checked with
megaft.config's check_settings/check_resolved on that architecture, so a layout the
planner prints passes megaft-train's validation of the same shapes.
"""
from __future__ import annotations

import gc
import json
import os
import sys
import time

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from megaft.config import Config, ConfigError, compose_once, conf_dir, register_configs
from megaft.fileio import write_json_atomic
from megaft.forks import usable_cpus
from megaft.plan.calibrate import FILE as CALIBRATION_FILE
from megaft.plan.calibrate import format_calibration, latest
from megaft.plan.measured import apply_measured
from megaft.plan.report import (
    columns,
    explain_experts,
    explain_rule,
    format_experts,
    format_explanation,
    format_rejections,
    format_table,
    layout_row,
    plan_json,
)
from megaft.plan.shape import planning_config
from megaft.plan.space import rule_of_thumb, search
from megaft.plan.vision import TowerLoad, format_vision, vision_plan

register_configs()
# megaft-train's root config with a cluster preset (conf/train.yaml's `cluster` default is null).
ConfigStore.instance().store(name="megaft_plan", node={"defaults": ["train", {"override cluster": "h100"}, "_self_"]})

MAX_WORKERS = 8  # plan.workers=0: the usable CPUs, at most this many
LAYOUT_KEYS = ("parallel.tp", "parallel.cp", "parallel.pp", "parallel.dp", "parallel.ep", "parallel.vpp",
               "parallel.schedule", "parallel.sequence_parallel", "parallel.zero", "parallel.offload",
               "parallel.pp_layers", "train.micro_batch_size", "launcher.nproc", "launcher.world_size")


def user_overrides(overrides: list[str]) -> list[str]:
    """The command line's overrides that megaft-train needs too: not cluster/plan ones,
    and not the keys every layout sets."""
    out = []
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if key.split(".")[0] in ("cluster", "plan", "hydra") or key in LAYOUT_KEYS:
            continue
        out.append(o)
    return out


def run_plan(cfg: Config, run_dir: str, overrides: list[str], hydra_overrides: list[str] = ()) -> tuple[int, dict]:
    """Plan, print, write run_dir/plan.json; (exit status, the plan). Raises ConfigError.
    With plan.probe=K the top K then run on Slurm (megaft.plan.probe, launcher from
    `hydra_overrides`) and plan.json gains their measurements; status 1 when none was measured."""
    shaped, problems = planning_config(cfg)
    if problems:
        raise ConfigError(problems)
    cluster, plan = shaped.cluster, cfg.plan  # cluster.measured: the measured links (megaft.plan.measured)
    for note in apply_measured(cfg.cluster)[1]:
        print(f"megaft-plan: links: {note}")
    calibration = latest(cfg.plan.calibrate) if cfg.plan.calibrate else None  # applied by planning_config
    if calibration is not None:
        print(format_calibration(calibration))
    # the search allocates millions of small, acyclic objects (reference counting frees them):
    # the cycle collector's passes over them found nothing and cost a fifth of the search
    collecting = gc.isenabled()  # off already under the megaft-plan command (megaft.cli.plan)
    gc.disable()
    try:
        start = time.perf_counter()
        vision = vision_plan(cfg, shaped)  # a vision-language checkpoint: its tower (megaft.plan.vision)
        tower = None if vision is None else TowerLoad.of(vision)
        result = search(shaped, cluster, plan, workers=plan.workers or min(usable_cpus(), MAX_WORKERS), tower=tower)
        rule = rule_of_thumb(shaped, cluster)
        explanation = explain_rule(result, rule, shaped, cluster)
        experts = explain_experts(result, shaped, cluster)  # None for a dense model
        searched_s = time.perf_counter() - start
    finally:
        if collecting:
            gc.enable()
    out = plan_json(result, shaped, cluster, user_overrides=user_overrides(overrides), top_k=plan.top_k,
                    explanation=explanation, experts=experts)
    if calibration is not None:  # reusable without the run: plan.calibrate=<run_dir>/calibration.json
        out["calibration"] = calibration.to_json()
    if vision is not None:
        out["vision"] = vision
    m = shaped.model
    print(f"megaft-plan: {m.name} ({out['model']['params'] / 1e9:.2f}B params) on {cluster.name}: "
          f"{cluster.nodes} x {cluster.gpus_per_node} = {cluster.world_size} GPUs, seq_len {shaped.data.seq_len}, "
          f"global batch {shaped.train.global_batch_size}, {shaped.precision}, "
          f"budget {out['memory_budget_gib']:.1f} GiB/GPU")
    if vision is not None:
        print(format_vision(vision))
    if result.ranked:
        moe = m.n_experts > 0  # the table gains an ep column
        print(format_table([layout_row(i + 1, c, moe) for i, c in enumerate(result.ranked[:plan.top_k])],
                           header=columns(moe)))
        print("best: megaft-train " + " ".join(out["layouts"][0]["overrides"]))
    else:
        print("no layout fits; see the reasons below")
    print(format_rejections(result))
    print(f"megaft-plan: searched {result.considered} layouts in {searched_s:.2f} s")
    if plan.explain:
        print(format_explanation(explanation))
        if experts is not None:
            print(format_experts(experts))
    os.makedirs(run_dir, exist_ok=True)
    write_json_atomic(os.path.join(run_dir, "plan.json"), out)
    if calibration is not None:
        write_json_atomic(os.path.join(run_dir, CALIBRATION_FILE), out["calibration"])
        print(f"megaft-plan: factors in {json.dumps(os.path.join(run_dir, CALIBRATION_FILE))} (plan.calibrate= it, "
              f"or the overrides {' '.join(calibration.overrides())}, reuse them)")
    print(f"megaft-plan: {json.dumps(os.path.join(run_dir, 'plan.json'))}", flush=True)
    if plan.probe and result.ranked:
        from megaft.plan.probe import launcher_overrides, run_probe

        out["probe"] = run_probe(result.ranked[:plan.probe], cluster, run_dir, user_overrides(overrides),
                                 launcher_overrides(list(hydra_overrides)), plan)
        for run in out["probe"]["runs"]:
            if run["plan_rank"] <= len(out["layouts"]):
                out["layouts"][run["plan_rank"] - 1]["measured"] = run["measured"]
        write_json_atomic(os.path.join(run_dir, "plan.json"), out)
        return (0 if out["probe"]["ranking"] else 1), out
    return (0 if result.ranked else 1), out


@hydra.main(version_base="1.3", config_path=conf_dir(), config_name="megaft_plan")
def _hydra_main(dcfg: DictConfig) -> None:
    cfg: Config = OmegaConf.to_object(dcfg)
    hc = HydraConfig.get()
    try:
        status, _ = run_plan(cfg, hc.runtime.output_dir, list(hc.overrides.task), list(hc.overrides.hydra))
    except ConfigError as exc:
        print(f"megaft-plan: {exc}", file=sys.stderr)
        sys.exit(2)
    sys.exit(status)


def main() -> None:
    compose_once(_hydra_main, sys.argv[1:])


if __name__ == "__main__":
    main()
