"""Body of one rank: device, process group, grid, then the trainer."""
from __future__ import annotations

import contextlib
import datetime
import os
import time
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from megaft.config import Config
from megaft.config.parallel import resolve_dp
from megaft.device import resolve_device
from megaft.launch import health
from megaft.launch.elastic import record_restarts, requeue_after_loss
from megaft.launch.env import DistEnv
from megaft.launch.preempt import requeue, restart_count
from megaft.launch.stopped import EXIT_STOPPED, RunStoppedError, stopped_message  # noqa: F401 (their old home)
from megaft.launch.trace import CollectiveTrace
from megaft.parallel.grid import ParallelGrid
from megaft.training.stop import PreemptFlag


def pick_device(setting: str, local_rank: int) -> torch.device:
    if resolve_device(setting) == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("device=cuda but torch sees no CUDA GPU; fix: device=cpu or a CUDA build of torch")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@contextlib.contextmanager
def process_group(cfg: Config, env: DistEnv, run_dir: str,
                  trace: Optional[CollectiveTrace] = None) -> Iterator[ParallelGrid]:
    """This rank's device, process group and grid, for the body of a rank (training, verify,
    commbench). A failed collective inside is re-raised as RankFailureError naming the dead
    or hung rank, after this rank's marker recorded what it was waiting for (`trace`, installed
    for the body); the process group is destroyed on the way out."""
    trace = trace or CollectiveTrace()
    device = pick_device(cfg.device, env.local_rank)
    backend = cfg.parallel.backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    # The one timeout of every collective, world and subgroups (gloo and NCCL alike): it bounds how
    # long a dead or hung rank can stall the others.
    timeout = datetime.timedelta(seconds=cfg.launcher.timeout_s)
    dist.init_process_group(backend, init_method=env.init_method, rank=env.rank, world_size=env.world_size,
                            timeout=timeout)
    try:
        grid = ParallelGrid.build(tp=cfg.parallel.tp, pp=cfg.parallel.pp, cp=cfg.parallel.cp, ep=cfg.parallel.ep,
                                  dp=resolve_dp(cfg.parallel, env.world_size), device=device, timeout=timeout)
        if env.world_size > 1:
            health.announce(run_dir, env.rank, grid.coords)
            trace.install()
        yield grid
    except Exception as exc:
        if env.world_size > 1 and health.is_comm_failure(exc):
            raise health.diagnose(exc, run_dir, env.rank, env.world_size, cfg.launcher.timeout_s,
                                  waiting=trace.snapshot()) from exc
        if env.world_size > 1:
            health.report_crash(exc, run_dir, env.rank)
        raise
    finally:
        trace.uninstall()
        dist.destroy_process_group()


def run_rank(cfg: Config, run_dir: str, env: DistEnv, threads: int = 0, spec=None) -> dict:
    """Initialize the process group of `env`, build the grid and train; returns the summary.

    The preemption handlers go in first, so a SIGUSR1 during start-up is not fatal.
    After a signal stopped training (every rank saved), rank 0 requeues the Slurm job; with
    launcher.elastic it also requeues it when a collective failed on a lost rank (node).
    `spec`: the TrainSpec whose builders compose the run (default: megaft.training.parts.TrainSpec()).
    """
    from megaft.training.loop import Trainer
    from megaft.training.parts import TrainSpec

    if threads:
        torch.set_num_threads(threads)
    trace, started = CollectiveTrace(), time.time()
    try:
        with PreemptFlag() as flag, process_group(cfg, env, run_dir, trace) as grid:
            trainer = Trainer(cfg, grid, run_dir, spec=spec or TrainSpec())
            trace.step_of = lambda: trainer.current_step  # the hang report's step and pipeline action
            trace.action_of = lambda: trainer.current_action
            summary = trainer.fit(flag=flag)
    except health.RankFailureError:
        if cfg.launcher.elastic and env.rank == 0 and os.environ.get("SLURM_JOB_ID"):
            requeue_after_loss(cfg.launcher.max_requeue, run_dir, env.world_size, since=started)
        raise
    if env.rank == 0 and "SLURM_JOB_ID" in os.environ:
        record_restarts(run_dir, restart_count())  # requeues so far, into summary.json when finished
    if summary.get("stopped_by") and "SLURM_JOB_ID" in os.environ:
        mark_stopped(run_dir)
    if summary.get("requeue") and env.rank == 0:
        requeue(cfg.launcher.max_requeue)
    elif summary.get("stopped_by") and env.rank == 0:
        print(f"megaft: stopped by {summary['stopped_by']} after saving a checkpoint; not requeued (SIGTERM: "
              "Slurm decides whether the job comes back); run again in the same directory to resume", flush=True)
    return summary


STOPPED_MARK = ".stopped"  # in the run directory: a rank stopped after a checkpoint (slurm/train_srun.sbatch)


def mark_stopped(run_dir: str) -> None:
    """Every rank notes that it stopped after saving: under `srun --kill-on-bad-exit` the first
    rank's exit 75 gets the others terminated (143), and the batch script then still reports 75."""
    try:
        with open(os.path.join(run_dir, STOPPED_MARK), "w") as f:
            f.write(os.environ.get("SLURM_JOB_ID", "") + "\n")
    except OSError:  # the exit status is then srun's own
        pass


def local_worker(local_rank: int, cfg: Config, run_dir: str, nproc: int, init_file: str, spec=None) -> None:
    """Entry of a rank started by the local launcher (torch.multiprocessing); bind `spec`
    with functools.partial to compose the run from other builders (megaft.verify)."""
    threads = max(1, (os.cpu_count() or 1) // nproc)
    summary = run_rank(cfg, run_dir, DistEnv(local_rank, nproc, local_rank, f"file://{init_file}"), threads, spec)
    if summary.get("stopped_by"):  # saved and stopped: the launcher tells it apart from a failure
        raise SystemExit(EXIT_STOPPED)
