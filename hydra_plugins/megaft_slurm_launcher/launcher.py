"""`hydra/launcher=slurm`: validate every multirun point here, then submit one submitit
job array per resource shape.

hydra-submitit-launcher gives every job of a sweep the same resources and blocks until
all end; a sweep over parallel degrees needs a different rank count per point. So each
point is composed and validated in the submitting process (an invalid point is
reported with its overrides and every problem, and not submitted; the memory check
uses the preset's GPU, hydra.launcher.gpu_type/gpu_mem_gb, as a login node has none),
its shape (nodes, tasks per node, GPUs) is derived from its ranks and the preset, and
points of equal shape go into one array (`executor.batch()`). `submitted.json` in the sweep dir lists
job ids, overrides, run dirs and shapes for `megaft-report`. A point with
train.then_eval=true also gets a megaft-eval job that waits for its training job
(`--dependency=afterok`, megaft.eval.submit).
"""
from __future__ import annotations

import copy
import inspect
import logging
import os
import sys
from typing import Any, Optional, Sequence

from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict

from megaft.config import Config
from megaft.launch.submit import (
    Budget,
    NodeSpec,
    Shape,
    check_point,
    group_by_shape,
    preset_gpu_budget,
    sbatch_parameters,
    shape_dict,
    task_python,
)
from megaft.launch.submit_record import SUBMITTED_FILE, merge_submitted

log = logging.getLogger(__name__)


class Point:
    """One multirun point: its overrides, run dir, validated config, shape and problems."""

    def __init__(self, num: int, overrides: Sequence[str], run_dir: str, sweep_config: DictConfig):
        self.num, self.overrides, self.run_dir, self.sweep_config = num, list(overrides), run_dir, sweep_config
        self.cfg: Optional[Config] = None
        self.shape: Optional[Shape] = None
        self.problems: list[str] = []
        self.job: Any = None  # submitit Job once submitted
        self.eval_job: Any = None  # the megaft-eval job of train.then_eval (megaft.eval.submit)
        self.score_job_id: Optional[str] = None  # the pref/distill.scores job it waits for (megaft.launch.score_jobs)

    @property
    def override_str(self) -> str:
        return " ".join(filter_overrides(self.overrides)) or "(no overrides)"

    def record(self, folder: str) -> dict[str, Any]:
        out: dict[str, Any] = {"num": self.num, "overrides": self.override_str, "run_dir": self.run_dir}
        if self.problems:
            return dict(out, status="invalid", problems=self.problems)
        out = dict(out, status="submitted", job_id=self.job.job_id, array_job_id=self.job.job_id.split("_")[0],
                   shape=shape_dict(self.shape), submitit_folder=folder.replace("%j", self.job.job_id))
        if self.eval_job is not None:
            out["eval_job_id"] = self.eval_job.job_id
        if self.score_job_id is not None:
            out["score_job_id"] = self.score_job_id
        return out


class MegaftSlurmLauncher(Launcher):
    def __init__(self, **params: Any) -> None:
        self.params = params  # the hydra.launcher node (SlurmLauncherConf fields)
        self.config: Optional[DictConfig] = None
        self.hydra_context: Optional[HydraContext] = None
        self.body = None  # the Slurm task body of the entry point (None: training)

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        # task_function is not called: each Slurm task runs megaft.launch.submit_task instead, with the
        # entry point's own task body when its module names one (megaft-verify: SLURM_TASK_BODY).
        self.config, self.hydra_context = config, hydra_context
        self.body = getattr(inspect.getmodule(task_function), "SLURM_TASK_BODY", None)

    def _compose(self, num: int, overrides: Sequence[str], spec: NodeSpec, budget: Optional[Budget]) -> Point:
        sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with open_dict(sweep_config):
            sweep_config.hydra.job.id = sweep_config.hydra.job.num = num
        HydraConfig.instance().set_config(sweep_config)  # for ${hydra:...} in the user's config
        run_dir = os.path.abspath(os.path.join(str(sweep_config.hydra.sweep.dir), str(sweep_config.hydra.sweep.subdir)))
        point = Point(num, overrides, run_dir, sweep_config)
        task_cfg = copy.deepcopy(sweep_config)
        with open_dict(task_cfg):
            del task_cfg["hydra"]
        try:
            point.cfg = OmegaConf.to_object(task_cfg)
        except Exception as exc:  # a bad value for a typed field: report it like any other problem
            point.problems = [str(exc).splitlines()[0]]
            return point
        point.shape, point.problems = check_point(point.cfg, spec, budget)
        return point

    def _write_hydra_files(self, point: Point) -> None:
        """The run dir's .hydra/ as Hydra writes it for a local job (config, hydra, overrides)."""
        hydra_dir = os.path.join(point.run_dir, ".hydra")
        os.makedirs(hydra_dir, exist_ok=True)
        task_cfg = copy.deepcopy(point.sweep_config)
        with open_dict(task_cfg):
            hydra_cfg = task_cfg.pop("hydra")
        OmegaConf.save(task_cfg, os.path.join(hydra_dir, "config.yaml"), resolve=True)
        OmegaConf.save(OmegaConf.create({"hydra": hydra_cfg}), os.path.join(hydra_dir, "hydra.yaml"))
        OmegaConf.save(OmegaConf.create(point.overrides), os.path.join(hydra_dir, "overrides.yaml"))

    def _submit(self, shape: Shape, points: list[Point], waits: dict[int, str]) -> None:
        import submitit

        from megaft.launch.score_jobs import dependency
        from megaft.launch.submit_task import SlurmRankTask

        executor = submitit.SlurmExecutor(folder=self.params["submitit_folder"], python=task_python())
        params = sbatch_parameters(shape, self.params)
        params["additional_parameters"].update(dependency(waits, points))  # pref.scores: after the scoring
        executor.update_parameters(**params)
        for point in points:
            point.score_job_id = waits.get(point.num)
        for point in points:
            self._write_hydra_files(point)
        with executor.batch():
            jobs = [executor.submit(SlurmRankTask(point.cfg, point.run_dir, self.body)) for point in points]
        for point, job in zip(points, jobs):
            point.job = job
        for point in points:  # train.then_eval: megaft-eval after each point's own job (afterok)
            if point.cfg.train.then_eval:
                from megaft.eval.submit import submit_eval

                point.eval_job = submit_eval(point.run_dir, point.cfg.eval, point.job.job_id, self.params,
                                             task_python())
                log.info("eval job %s runs after %s succeeds", point.eval_job.job_id, point.job.job_id)
        log.info("array %s (%s, %d job(s)): %s", jobs[0].job_id.split("_")[0], shape.tag(), len(jobs),
                 ", ".join(f"#{pt.num} {pt.override_str}" for pt in points))

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        sweep_dir = os.path.abspath(str(self.config.hydra.sweep.dir))
        os.makedirs(sweep_dir, exist_ok=True)
        spec = NodeSpec(nodes=self.params["nodes"], tasks_per_node=self.params["tasks_per_node"],
                        gpus_per_node=self.params["gpus_per_node"], cpus_per_task=self.params["cpus_per_task"])
        budget, preset_problems = preset_gpu_budget(self.params)  # the GPUs of the cluster, not of this machine
        points = [self._compose(initial_job_idx + i, o, spec, budget) for i, o in enumerate(job_overrides)]
        for pt in points:  # a bad preset makes every point invalid: nothing is submitted
            pt.problems = preset_problems + pt.problems
        invalid = [pt for pt in points if pt.problems]
        for pt in invalid:
            print(f"megaft-train: point #{pt.num} ({pt.override_str}) is invalid and was not submitted:\n"
                  + "\n".join(f"  - {problem}" for problem in pt.problems), file=sys.stderr)
        valid = [pt for pt in points if not pt.problems]
        waits = {}
        if valid:  # pref.scores, distill.scores: each missing fingerprint scored once, before the arrays
            from megaft.launch.score_jobs import submit_scoring

            waits = submit_scoring(valid, sweep_dir, self.params, task_python())
            for job in sorted(set(waits.values())):
                log.info("scoring job %s stores the scores of point(s) %s", job,
                         ", ".join(f"#{n}" for n, j in waits.items() if j == job))
        for shape, group in group_by_shape((pt.shape, pt) for pt in valid).items():
            self._submit(shape, group, waits)
        merge_submitted(sweep_dir, [pt.record(str(self.params["submitit_folder"])) for pt in points])
        log.info("%s written: %d submitted, %d invalid", os.path.join(sweep_dir, SUBMITTED_FILE),
                 len(points) - len(invalid), len(invalid))
        returns = [self._job_return(pt) for pt in points if not pt.problems]
        if invalid:
            print(f"megaft-train: {len(invalid)} of {len(points)} point(s) invalid (listed above); "
                  "the others were submitted", file=sys.stderr)
            sys.exit(2)
        return returns

    def _job_return(self, point: Point) -> JobReturn:
        ret = JobReturn(overrides=point.overrides, cfg=point.sweep_config, hydra_cfg=point.sweep_config,
                        working_dir=point.run_dir, task_name=str(point.sweep_config.hydra.job.name))
        if not self.params["wait"]:
            ret.status, ret._return_value = JobStatus.COMPLETED, {"job_id": point.job.job_id}
            return ret
        try:
            ret._return_value = point.job.results()[0]  # rank 0's summary
            ret.status = JobStatus.COMPLETED
        except Exception as exc:  # submitit re-raises the job's failure with its traceback
            ret._return_value, ret.status = exc, JobStatus.FAILED
        return ret
