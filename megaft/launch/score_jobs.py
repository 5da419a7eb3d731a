"""pref.scores and distill.scores under the Slurm launcher: the reference log-probs, or the
teacher's top-k, of a sweep scored once.

Before the training arrays are queued, the points whose reference is precomputed into
pref.scores (megaft.pref.scores) are grouped by fingerprint; for each fingerprint whose file
is not there yet, one scoring job runs the first such point's config with train.max_steps=0
(its Trainer scores the pairs and stores them, then stops) at that point's shape, in
SWEEP/.scores/<file name>/. The points whose teacher is stored into distill.scores
(distill.top_k, megaft.distill.stored) are grouped the same way by what their file's fingerprint
is made of that the config names (the teacher's and the student's checkpoints, the data files and
every data.* field, the tokenizer and chat template, k, the temperature, the precision, the
folder): the file's own name also hashes the prepared corpus, which the launcher does not build,
so one scoring job is queued per group whether or not its file is already there (a job that finds
it reads it and stops), in SWEEP/.scores/teacher-topk-config-<hash>/. Every array holding one of
those points is queued with `--dependency=afterok:<its scoring jobs>`, so its runs read the stored scores instead of
each scoring them; a failed scoring job leaves them pending (DependencyNeverSatisfied).
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
from typing import Any, Mapping, Sequence

from megaft.config.pref import needs_reference
from megaft.launch.submit import Shape, sbatch_parameters
from megaft.pref.scores import scores_path

SCORES_DIR = ".scores"  # under the sweep dir (megaft-report skips it)


def stores_scores(cfg) -> bool:
    """Whether a run of `cfg` precomputes its reference into pref.scores or its teacher's top-k into distill.scores."""
    return stores_reference(cfg) or stores_teacher(cfg)


def stores_reference(cfg) -> bool:
    return bool(cfg.pref.scores) and needs_reference(cfg.train.objective) and cfg.pref.reference_mode == "precompute"


def stores_teacher(cfg) -> bool:
    d = cfg.distill
    return cfg.train.objective == "distill" and bool(d.scores) and d.top_k is not None and not d.generates


def teacher_group(cfg) -> str:
    """The scoring folder's name of `cfg`'s stored top-k teacher: a sha256 of what its file's
    fingerprint (megaft.distill.stored.fingerprint_parts) holds that the config names."""
    from megaft.data.templates import tokenizer_dir_of
    from megaft.pref import scores as ref

    d, data = cfg.distill, cfg.data
    tokenizer_dir = tokenizer_dir_of(data.tokenizer, cfg.model.init_from)
    parts = {"teacher": {"checkpoint": os.path.abspath(d.teacher), **ref._checkpoint_identity(d.teacher)},
             "model": repr(dataclasses.replace(ref._resolved_model(cfg.model), **ref.NOT_NUMBERS)),
             "data_files": ref._pairs_identity(data), "data": repr(data),
             "tokenizer": ref._tokenizer_identity(tokenizer_dir),
             "chat_template": ref._template_identity(data.chat_template, tokenizer_dir),
             "top_k": d.top_k, "temperature": d.temperature, "precision": str(cfg.precision),
             "scores": os.path.abspath(d.scores)}
    return "teacher-topk-config-" + hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def scoring_config(cfg):
    """`cfg` as its scoring job runs it: build (which scores and stores), evaluate nothing, train nothing."""
    out = copy.deepcopy(cfg)
    out.train.epochs = None  # scoring trains no step, whatever sizes the training runs
    t = out.train
    t.max_steps, t.save_every, t.save_final, t.export_hf, t.then_eval, t.sample_every = 0, 0, False, False, False, 0
    return out  # data.eval_path stays: the held-out pairs are scored and stored with the training ones


def missing_scores(points: Sequence[Any]) -> dict[str, list[Any]]:
    """A scoring job's name -> the points (with .cfg) that read what it stores: the reference files
    not written yet (the file's name) and every stored teacher's group (`teacher_group`)."""
    out: dict[str, list[Any]] = {}
    for point in points:
        if stores_reference(point.cfg):
            path = scores_path(point.cfg)
            if not os.path.isfile(path):
                out.setdefault(os.path.basename(path).removesuffix(".safetensors"), []).append(point)
        elif stores_teacher(point.cfg):
            out.setdefault(teacher_group(point.cfg), []).append(point)
    return out


def submit_scoring(points: Sequence[Any], sweep_dir: str, preset: Mapping[str, Any], python: str) -> dict[int, str]:
    """Queue one scoring job per missing fingerprint; point.num -> the job id it waits for.
    Each point needs .cfg, .shape (megaft.launch.submit.Shape) and .num."""
    import submitit

    from megaft.launch.submit_task import SlurmRankTask

    waits: dict[int, str] = {}
    for name, group in missing_scores(points).items():
        first = group[0]
        shape: Shape = first.shape
        executor = submitit.SlurmExecutor(folder=str(preset["submitit_folder"]), python=python)
        params = sbatch_parameters(shape, preset)
        params["job_name"] = f"{preset['job_name']}-score"
        params.pop("array_parallelism", None)
        executor.update_parameters(**params)
        run_dir = os.path.join(sweep_dir, SCORES_DIR, name)
        job = executor.submit(SlurmRankTask(scoring_config(first.cfg), run_dir))
        for point in group:
            waits[point.num] = job.job_id
    return waits


def dependency(waits: Mapping[int, str], points: Sequence[Any]) -> dict[str, str]:
    """The additional sbatch parameter of an array of `points`: afterok on their scoring jobs."""
    jobs = sorted({waits[p.num] for p in points if p.num in waits})
    return {"dependency": "afterok:" + ":".join(jobs)} if jobs else {}
