"""What every Slurm task of a submitted sweep runs: one rank of one point.

submitit pickles a `SlurmRankTask` per point; in the job, each task (one per rank) calls
it. Rank, local rank, world size and the master host come from Slurm through submitit's
JobEnvironment, the port from the job's own id (megaft.launch.submit.task_port), so
nothing is set by hand and two jobs on one node never meet on one port.

Preemption: the task's interpreter starts with SIGUSR1/2 blocked (submit.task_python), so
a warning during start-up stays pending, and submitit's own SIGUSR2 handler (checkpoint,
`scontrol requeue`, exit), installed before it calls the task, never fires: megaft's
PreemptFlag takes both over in `run_rank` (USR1 is the presets' `--signal=USR1@N`, USR2
submitit's). Every rank saves at the next step boundary, rank 0 requeues the job, and the
task then ends without a result, as submitit's own requeue does, so the job counts as
unfinished until the requeued attempt (the same pickled task) resumes from the
checkpoint and returns the finished summary. `checkpoint()` covers a task started some
other way, where submitit's handler may still see a USR2 before training.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any, Callable, Optional

from megaft.config import Config
from megaft.fileio import write_json_atomic
from megaft.launch.elastic import adapt
from megaft.launch.env import DistEnv
from megaft.launch.preempt import restart_count
from megaft.launch.runlock import run_lock
from megaft.launch.submit import task_port

RENDEZVOUS_FILE = "slurm.json"  # in the run dir: which job ran it and where its ranks met


class SlurmRankTask:
    """Train `cfg` in `run_dir` as the rank this Slurm task is (submitit callable).
    `body(cfg, run_dir, env, threads) -> dict` replaces training (run_rank) for another
    entry point's sweep, e.g. megaft-verify's (megaft.verify.run.slurm_body)."""

    def __init__(self, cfg: Config, run_dir: str, body: Optional[Callable[..., dict]] = None):
        self.cfg, self.run_dir, self.body = cfg, run_dir, body

    def __call__(self) -> dict[str, Any]:
        import submitit

        from megaft.launch.rank import run_rank

        job = submitit.JobEnvironment()
        # SLURM_JOB_ID is this array task's own id; submitit's job_id is "<array>_<task>".
        port = task_port(os.environ.get("SLURM_JOB_ID", job.raw_job_id))
        env = DistEnv(rank=job.global_rank, world_size=job.num_tasks, local_rank=job.local_rank,
                      init_method=f"tcp://{job.hostnames[0]}:{port}")
        os.makedirs(self.run_dir, exist_ok=True)
        if env.rank == 0:
            write_json_atomic(os.path.join(self.run_dir, RENDEZVOUS_FILE), {
                "job_id": job.job_id, "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
                "array_job_id": job.array_job_id, "array_task_id": job.array_task_id,
                "hostnames": list(job.hostnames), "world_size": env.world_size,
                "init_method": env.init_method, "port": port, "start_time": time.time()})
        # torch threads per rank = the cores Slurm gave the task, not every core of the node.
        threads = int(os.environ.get("SLURM_CPUS_PER_TASK") or 1)
        adapt(self.cfg, env.world_size, self.run_dir)  # launcher.elastic: dp follows this allocation
        with run_lock(self.run_dir, enabled=env.rank == 0):  # a requeued job takes over its own lock
            summary = (self.body or run_rank)(self.cfg, self.run_dir, env, threads)
        # The run is over (finished, or saved for a requeue): a late warning has nothing left to save,
        # and submitit's USR2 handler would requeue a finished run.
        for sig in (signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_IGN)
        if summary.get("requeue") and os.environ.get("SLURM_JOB_ID") and \
                restart_count() < self.cfg.launcher.max_requeue:
            # Rank 0 requeued the job (megaft.launch.preempt.requeue): no result file for this attempt.
            sys.exit(0)
        return summary

    def checkpoint(self) -> Optional[Any]:
        """submitit's SIGUSR2 handler (rank 0, outside run_rank) asks what to requeue: this same
        task, which resumes from the run dir's newest checkpoint; None past launcher.max_requeue
        (submitit then ends the job with an error instead of requeueing)."""
        from submitit.helpers import DelayedSubmission

        if restart_count() >= self.cfg.launcher.max_requeue:
            return None
        return DelayedSubmission(self)
