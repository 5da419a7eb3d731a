"""Preemption and time limits on Slurm: after every rank stopped and saved, rank 0 requeues.

Slurm warns a job before its time limit with `#SBATCH --signal=USR1@<seconds>` (or a
user sends `scancel --signal=USR1 <job>`), and preemption/scancel send SIGTERM. The
ranks agree on the strongest request at a step boundary and save
(megaft.training.stop); this module decides the job's fate:

- SIGUSR1/SIGUSR2 (REQUEUE): save, requeue, exit 75 (megaft.launch.rank.EXIT_STOPPED).
- SIGTERM (STOP): save and exit 75 without requeueing, so `scancel` still ends a job
  for good (Slurm's own preemption requeues by itself).

Requeueing is `scontrol requeue $SLURM_JOB_ID`, the route submitit's own checkpoint
handler takes too, so it also works for submitit-launched jobs. `launcher.max_requeue`
bounds it: SLURM_RESTART_COUNT (how often Slurm restarted this job) at or past it
means the job saves and ends with a message instead of requeueing forever.
"""
from __future__ import annotations

import logging
import os
import subprocess
from typing import Mapping, Optional

log = logging.getLogger("megaft")


def restart_count(environ: Optional[Mapping[str, str]] = None) -> int:
    env = os.environ if environ is None else environ
    value = env.get("SLURM_RESTART_COUNT", "0")
    return int(value) if value.isdigit() else 0


def requeue(max_requeue: int, environ: Optional[Mapping[str, str]] = None,
            run=subprocess.run, why: str = "stopped by a signal and saved a checkpoint") -> str:
    """Requeue this Slurm job unless max_requeue is reached; returns the message it logged.

    Call on one rank only, after every rank's checkpoint is published. Not under a
    Slurm job (no SLURM_JOB_ID) there is nothing to requeue: the message says how to
    resume by hand.
    """
    env = os.environ if environ is None else environ
    job = env.get("SLURM_JOB_ID")  # an array task has its own SLURM_JOB_ID too
    if not job:
        msg = f"megaft: {why}; not a Slurm job, so not requeued: " \
              "run the same command again to resume"
    elif restart_count(env) >= max_requeue:
        msg = (f"megaft: {why}; job {job} was already requeued "
               f"{restart_count(env)} time(s) (launcher.max_requeue={max_requeue}), so it is NOT requeued "
               "again: resubmit it to resume, or raise launcher.max_requeue")
    else:
        out = run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
        if out.returncode == 0:
            msg = (f"megaft: {why}; requeued Slurm job {job} "
                   f"(restart {restart_count(env) + 1} of at most {max_requeue}); it resumes from the checkpoint")
        else:
            msg = (f"megaft: {why}; `scontrol requeue {job}` failed "
                   f"({out.returncode}: {(out.stderr or out.stdout).strip()}): resubmit the job to resume")
    log.warning(msg)
    print(msg, flush=True)
    return msg


def _tasks_per_node(env: Mapping[str, str]) -> int:
    """SLURM_NTASKS_PER_NODE, else the first count of SLURM_TASKS_PER_NODE ("2(x2)" -> 2)."""
    value = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "1")
    digits = value.split("(")[0].split(",")[0]
    return int(digits) if digits.isdigit() else 1


def shrink_requeued(lost_hosts: list[str], environ: Optional[Mapping[str, str]] = None,
                    run=subprocess.run) -> Optional[str]:
    """After `requeue` of an elastic job that lost `lost_hosts`: ask for the nodes that remain.

    Slurm keeps the node and task counts of a requeued job's first allocation, so a job
    that ran on 2 nodes would wait for 2 again; this sets them to the remaining nodes
    (same tasks per node) and excludes the lost ones, which Slurm may not have marked
    DOWN yet. Returns the message logged, None when nothing is to be done.
    """
    from megaft.launch.env import expand_hostlist

    env = os.environ if environ is None else environ
    job, nodelist = env.get("SLURM_JOB_ID"), env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not job or not nodelist or not lost_hosts:
        return None
    remaining = [h for h in expand_hostlist(nodelist) if h not in set(lost_hosts)]
    if not remaining:
        return None
    tasks = len(remaining) * _tasks_per_node(env)
    cpus = tasks * int(env.get("SLURM_CPUS_PER_TASK", "1") or 1)
    args = ["scontrol", "update", f"JobId={job}", f"NumNodes={len(remaining)}", f"NumTasks={tasks}",
            f"NumCPUs={cpus}", f"ExcNodeList={','.join(sorted(set(lost_hosts)))}"]
    out = run(args, capture_output=True, text=True, timeout=60)
    msg = (f"megaft: job {job} asks for the {len(remaining)} node(s) that remain ({', '.join(remaining)}; "
           f"{tasks} tasks), without {', '.join(sorted(set(lost_hosts)))}" if out.returncode == 0 else
           f"megaft: `{' '.join(args)}` failed ({out.returncode}: {(out.stderr or out.stdout).strip()}): the "
           "requeued job waits for its old node count")
    log.warning(msg)
    print(msg, flush=True)
    return msg
