"""`train.then_eval=true` under the Slurm launcher: one `megaft-eval` job per training job,
queued with `--dependency=afterok:<training job id>`.

A sweep's training jobs are tasks of job arrays (`<array>_<task>`); each point's eval job
depends on its own array task, not on the whole array: it starts as soon as that point's
training succeeded, and a failed or cancelled point leaves only its own eval job pending
(Slurm marks it DependencyNeverSatisfied; `scancel` it or set the cluster's
kill_invalid_depend). The eval job is a plain single-task job (one GPU when the training
preset has GPUs, else none; eval.gpus overrides), named `<job_name>-eval`; its submitit logs
sit beside the training jobs' in the sweep's .submitit/.
"""
from __future__ import annotations

import os
from typing import Any, Mapping

from megaft.config.eval import EvalConfig


class EvalTask:
    """What the eval job runs (pickled by submitit): megaft-eval on a run dir."""

    def __init__(self, run_dir: str, cfg: EvalConfig):
        self.run_dir, self.cfg = run_dir, cfg

    def __call__(self) -> dict[str, Any]:
        from megaft.eval.model_dir import locate
        from megaft.eval.run import evaluate

        record = evaluate(locate(self.run_dir), self.cfg)
        return record.get("results", {})


def eval_parameters(cfg: EvalConfig, preset: Mapping[str, Any], train_job_id: str) -> dict[str, Any]:
    """submitit.SlurmExecutor parameters of the eval job of training job `train_job_id`."""
    gpus = cfg.gpus if cfg.gpus >= 0 else min(1, int(preset["gpus_per_node"] or 0))
    params: dict[str, Any] = dict(
        job_name=f"{preset['job_name']}-eval", nodes=1, ntasks_per_node=1, cpus_per_task=preset["cpus_per_task"],
        time=cfg.timeout_min, setup=list(preset["setup"]),
        additional_parameters={**preset["additional_parameters"], "dependency": f"afterok:{train_job_id}"})
    if preset["partition"]:
        params["partition"] = preset["partition"]
    if gpus:
        params["gpus_per_node"] = gpus
    if preset["mem_gb"]:
        params["mem"] = f"{preset['mem_gb']}GB"
    return params


def submit_eval(run_dir: str, cfg: EvalConfig, train_job_id: str, preset: Mapping[str, Any], python: str):
    """Queue the eval job of one training job; returns submitit's Job."""
    import submitit

    executor = submitit.SlurmExecutor(folder=str(preset["submitit_folder"]), python=python)
    executor.update_parameters(**eval_parameters(cfg, preset, train_job_id))
    return executor.submit(EvalTask(os.path.abspath(run_dir), cfg))
