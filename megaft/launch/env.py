"""Where a rank learns who it is: the one place that reads launcher environment.

Three launchers can start megaft's ranks; `external_env()` decides which one did:

- torchrun (also torchrun inside an sbatch script): RANK, WORLD_SIZE, LOCAL_RANK and
  MASTER_ADDR/MASTER_PORT, rendezvous `env://`.
- Slurm, one task per rank (`srun`, `sbatch` + `srun`, submitit): SLURM_PROCID,
  SLURM_LOCALID and the step's task count; the master is the first host of the step's
  node list, the port is derived from the job and step ids (see `slurm_port`).
- neither: `external_env()` returns None and megaft-train starts `launcher.nproc`
  ranks on this machine itself (megaft.launch.local).

Modelled on submitit's TorchDistributedEnvironment and Lightning's SLURMEnvironment.
Run `python -m megaft.launch.env` (e.g. under `srun`) to print what a process sees.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
from dataclasses import dataclass
from typing import List, Mapping, Optional

# Rendezvous ports of Slurm jobs: [PORT_BASE, PORT_BASE + PORT_SPAN) is unprivileged and
# below Linux's default ephemeral range (32768-60999), so no outgoing connection holds one.
PORT_BASE = 20000
PORT_SPAN = 12000
STEPS_PER_JOB = 16  # steps of one job get neighbouring ports; 750 jobs cycle the range


@dataclass(frozen=True)
class DistEnv:
    """One rank's place in the world and how to meet the others (torch.distributed arguments)."""

    rank: int
    world_size: int
    local_rank: int
    init_method: str  # torch.distributed init_method (env://, tcp://host:port or file://...)


def external_env(environ: Optional[Mapping[str, str]] = None) -> Optional[DistEnv]:
    """This process's rank when a launcher started it, or None when megaft must start the ranks.

    Rules, first match wins:
    1. RANK and WORLD_SIZE are set: torchrun (or any env:// launcher) decided the world,
       even inside a Slurm job (torchrun under sbatch/srun).
    2. The process is a task of a Slurm job step (SLURM_PROCID and SLURM_STEP_ID set,
       i.e. started by srun) and the step has more than one task: Slurm rank
       SLURM_PROCID of SLURM_STEP_NUM_TASKS (SLURM_NTASKS on older Slurm), local rank
       SLURM_LOCALID, init_method tcp://MASTER_ADDR:MASTER_PORT.
    3. Otherwise None. In particular a single Slurm task (`srun -n 1`, or the batch
       script of `sbatch`, which runs once whatever --ntasks says and carries no
       SLURM_STEP_ID) is NOT a 1-rank world: megaft-train then starts launcher.nproc
       ranks itself, so `sbatch --wrap "megaft-train ..."` behaves as on a workstation.

    MASTER_ADDR / MASTER_PORT in the environment override the Slurm-derived address
    (first host of SLURM_STEP_NODELIST, else SLURM_JOB_NODELIST) and port (`slurm_port`).
    """
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistEnv(rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]),
                       local_rank=int(env.get("LOCAL_RANK", 0)), init_method="env://")
    if "SLURM_PROCID" not in env or "SLURM_STEP_ID" not in env:
        return None
    world = int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or 1)
    if world <= 1:
        return None
    addr = env.get("MASTER_ADDR") or _first_host(env)
    port = int(env.get("MASTER_PORT") or slurm_port(env.get("SLURM_JOB_ID", "0"), env.get("SLURM_STEP_ID", "0")))
    return DistEnv(rank=int(env["SLURM_PROCID"]), world_size=world,
                   local_rank=int(env.get("SLURM_LOCALID", 0)), init_method=f"tcp://{addr}:{port}")


def slurm_port(job_id: str, step_id: str = "0") -> int:
    """Rendezvous port of a job step: PORT_BASE + (job_id * 16 + step_id) % PORT_SPAN.

    Every task of the step computes the same port without talking to the others, and
    two jobs sharing a node differ unless their ids are 750 apart (as submitit and
    Lightning do, from the job id). Array jobs count by their own SLURM_JOB_ID.
    """
    job = int(job_id) if str(job_id).isdigit() else 0
    step = int(step_id) if str(step_id).isdigit() else 0  # "batch"/"extern" are not srun steps
    return PORT_BASE + (job * STEPS_PER_JOB + step % STEPS_PER_JOB) % PORT_SPAN


def _first_host(env: Mapping[str, str]) -> str:
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise RuntimeError("a Slurm task without SLURM_STEP_NODELIST/SLURM_JOB_NODELIST: "
                           "set MASTER_ADDR to the rank-0 host")
    try:
        return expand_hostlist(nodelist)[0]
    except ValueError as exc:
        # A hostlist form this parser does not know: ask Slurm itself.
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                                 text=True, check=True, timeout=30)
            return out.stdout.split()[0]
        except (OSError, subprocess.SubprocessError, IndexError):
            raise RuntimeError(f"cannot expand the Slurm node list {nodelist!r} ({exc}) and "
                               "`scontrol show hostnames` did not either: set MASTER_ADDR") from exc


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_hostlist(hostlist: str) -> List[str]:
    """Slurm's compressed host list as host names, in order.

    `node[01-03,07]` -> node01 node02 node03 node07 (zero padding kept from the low bound);
    `a[1-2]-ib[0-1]` -> a1-ib0 a1-ib1 a2-ib0 a2-ib1; `x1,y[2-3]` -> x1 y2 y3.
    Raises ValueError on a form it cannot parse (unbalanced brackets, a non-numeric range).
    """
    hosts: List[str] = []
    for item in _split_top_level(hostlist.strip()):
        hosts.extend(_expand_item(item))
    if not hosts:
        raise ValueError(f"empty host list {hostlist!r}")
    return hosts


def _split_top_level(hostlist: str) -> List[str]:
    """Split on the commas outside brackets: "a[1,2],b" -> ["a[1,2]", "b"]."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(hostlist):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"nested brackets in host list {hostlist!r}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in host list {hostlist!r}")
        elif ch == "," and depth == 0:
            items.append(hostlist[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unbalanced '[' in host list {hostlist!r}")
    items.append(hostlist[start:])
    return [item for item in items if item]


def _expand_item(item: str) -> List[str]:
    """One host pattern: every bracket group multiplies (first group varies slowest)."""
    if "[" not in item:
        if "]" in item:
            raise ValueError(f"unbalanced ']' in host {item!r}")
        return [item]
    prefix, rest = item.split("[", 1)
    body, suffix = rest.split("]", 1)
    tails = _expand_item(suffix) if suffix else [""]
    return [f"{prefix}{number}{tail}" for number in _expand_ranges(body, item) for tail in tails]


def _expand_ranges(body: str, item: str) -> List[str]:
    numbers = []
    for part in body.split(","):
        match = _RANGE.match(part.strip())
        if not match:
            raise ValueError(f"cannot parse range {part!r} in host {item!r}")
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise ValueError(f"descending range {part!r} in host {item!r}")
        numbers.extend(str(n).zfill(len(low)) for n in range(int(low), int(high) + 1))
    return numbers


if __name__ == "__main__":
    # One JSON line per process: what megaft-train would do here (used by the Slurm tests).
    found = external_env()
    print("megaft-rank " + json.dumps(dataclasses.asdict(found) if found else None), flush=True)
