"""pref.scores under the Slurm launcher: the reference log-probs of a sweep scored once.

Before the training arrays are queued, the points whose reference is precomputed into
pref.scores (megaft.pref.scores) are grouped by fingerprint; for each fingerprint whose file
is not there yet, one scoring job runs the first such point's config with train.max_steps=0
(its Trainer scores the pairs and stores them, then stops) at that point's shape, in
SWEEP/.scores/<file name>/. Every array holding one of those points is queued with
`--dependency=afterok:<its scoring jobs>`, so its runs read the stored scores instead of
each scoring them; a failed scoring job leaves them pending (DependencyNeverSatisfied).
"""
from __future__ import annotations

import copy
import os
from typing import Any, Mapping, Sequence

from megaft.config.pref import needs_reference
from megaft.launch.submit import Shape, sbatch_parameters
from megaft.pref.scores import scores_path

SCORES_DIR = ".scores"  # under the sweep dir (megaft-report skips it)


def stores_scores(cfg) -> bool:
    """Whether a run of `cfg` precomputes its reference into pref.scores."""
    return bool(cfg.pref.scores) and needs_reference(cfg.train.objective) and cfg.pref.reference_mode == "precompute"


def scoring_config(cfg):
    """`cfg` as its scoring job runs it: build (which scores and stores), evaluate nothing, train nothing."""
    out = copy.deepcopy(cfg)
    out.train.epochs = None  # scoring trains no step, whatever sizes the training runs
    t = out.train
    t.max_steps, t.save_every, t.save_final, t.export_hf, t.then_eval, t.sample_every = 0, 0, False, False, False, 0
    return out  # data.eval_path stays: the held-out pairs are scored and stored with the training ones


def missing_scores(points: Sequence[Any]) -> dict[str, list[Any]]:
    """Store path -> the points (with .cfg) that read it, for the paths not written yet."""
    out: dict[str, list[Any]] = {}
    for point in points:
        if stores_scores(point.cfg):
            path = scores_path(point.cfg)
            if not os.path.isfile(path):
                out.setdefault(path, []).append(point)
    return out


def submit_scoring(points: Sequence[Any], sweep_dir: str, preset: Mapping[str, Any], python: str) -> dict[int, str]:
    """Queue one scoring job per missing fingerprint; point.num -> the job id it waits for.
    Each point needs .cfg, .shape (megaft.launch.submit.Shape) and .num."""
    import submitit

    from megaft.launch.submit_task import SlurmRankTask

    waits: dict[int, str] = {}
    for path, group in missing_scores(points).items():
        first = group[0]
        shape: Shape = first.shape
        executor = submitit.SlurmExecutor(folder=str(preset["submitit_folder"]), python=python)
        params = sbatch_parameters(shape, preset)
        params["job_name"] = f"{preset['job_name']}-score"
        params.pop("array_parallelism", None)
        executor.update_parameters(**params)
        run_dir = os.path.join(sweep_dir, SCORES_DIR, os.path.basename(path).removesuffix(".safetensors"))
        job = executor.submit(SlurmRankTask(scoring_config(first.cfg), run_dir))
        for point in group:
            waits[point.num] = job.job_id
    return waits


def dependency(waits: Mapping[int, str], points: Sequence[Any]) -> dict[str, str]:
    """The additional sbatch parameter of an array of `points`: afterok on their scoring jobs."""
    jobs = sorted({waits[p.num] for p in points if p.num in waits})
    return {"dependency": "afterok:" + ":".join(jobs)} if jobs else {}
