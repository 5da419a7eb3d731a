"""Sweeps on Slurm, the part without Slurm: a point's rank count, its resource shape,
grouping points into one job array per shape, and the rendezvous port of a job.

The Hydra launcher plugin (hydra_plugins/megaft_slurm_launcher) composes and validates
every multirun point in the submitting process, then uses these functions to decide
what to `sbatch`; megaft.launch.submit_task runs inside each Slurm task.
"""
from __future__ import annotations

import math
import shlex
import sys
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, NamedTuple, Optional

from megaft.config import Config
from megaft.launch.env import slurm_port
from megaft.perf.hardware import GIB, gpu_type_memory
from megaft.signals import WARNING_SIGNALS
from megaft.validation import validate

Budget = tuple[int, str]  # bytes per GPU, and where the number came from (for messages)


class Shape(NamedTuple):
    """What one Slurm job of a point asks for; points with equal shapes share one array."""

    nodes: int
    tasks_per_node: int  # one task per rank
    gpus_per_node: int  # 0 on CPU nodes
    cpus_per_task: int
    min_nodes: int = 0  # launcher.elastic + launcher.min_nodes: accept min_nodes..nodes (`--nodes=min-max`)

    @property
    def world_size(self) -> int:
        return self.nodes * self.tasks_per_node

    def tag(self) -> str:
        """Short folder-safe name: n1_t2_g0_c1."""
        elastic = f"_m{self.min_nodes}" if self.min_nodes else ""
        return f"n{self.nodes}{elastic}_t{self.tasks_per_node}_g{self.gpus_per_node}_c{self.cpus_per_task}"


@dataclass(frozen=True)
class NodeSpec:
    """The preset fields that shape a job (hydra.launcher.*); 0 means derive."""

    nodes: int = 0
    tasks_per_node: int = 0
    gpus_per_node: int = 0
    cpus_per_task: int = 1


def point_world_size(cfg: Config) -> int:
    """Ranks of a point: launcher.world_size when set, else tp * cp * pp * dp (dp unset counts as 1)."""
    par = cfg.parallel
    return cfg.launcher.world_size or par.tp * par.cp * par.pp * (par.dp or 1)


def resource_shape(cfg: Config, spec: NodeSpec) -> tuple[Optional[Shape], list[str]]:
    """(shape, problems) of one point: its world size spread over nodes.

    Nodes come from launcher.nodes, else the preset's `nodes`, else as few as fit:
    with GPUs, gpus_per_node ranks per node (one GPU per rank); on CPU nodes,
    tasks_per_node ranks per node (0 = all ranks on one node).
    """
    world = point_world_size(cfg)
    if world < 1:
        return None, [f"the point has {world} ranks; fix: positive parallel.tp/pp/dp or launcher.world_size"]
    per_node = spec.gpus_per_node or spec.tasks_per_node or world
    nodes = cfg.launcher.nodes or spec.nodes or math.ceil(world / per_node)
    if world % nodes:
        return None, [f"{world} ranks do not split evenly over {nodes} nodes; fix: launcher.nodes (or "
                      f"hydra.launcher.nodes) dividing {world}, or launcher.world_size a multiple of {nodes}"]
    tasks = world // nodes
    if spec.gpus_per_node and tasks > spec.gpus_per_node:
        return None, [f"{tasks} ranks per node but hydra.launcher.gpus_per_node={spec.gpus_per_node} (one GPU "
                      f"per rank); fix: launcher.nodes>={math.ceil(world / spec.gpus_per_node)} or fewer ranks"]
    if cfg.device == "cuda" and not spec.gpus_per_node:
        return None, ["device=cuda but the preset asks for no GPUs (hydra.launcher.gpus_per_node=0); fix: "
                      "hydra/launcher=slurm (GPU nodes), hydra.launcher.gpus_per_node=N, or device=cpu"]
    # An elastic job may start on fewer nodes (its ranks then set dp from the world they get,
    # megaft.launch.elastic); tp * pp must fit in what min_nodes hold, checked when it starts.
    min_nodes = cfg.launcher.min_nodes if cfg.launcher.elastic and cfg.launcher.min_nodes < nodes else 0
    return Shape(nodes, tasks, min(spec.gpus_per_node, tasks), spec.cpus_per_task, min_nodes), []


def preset_gpu_budget(preset: Mapping[str, Any]) -> tuple[Optional[Budget], list[str]]:
    """(budget, problems) of the GPUs a preset names: hydra.launcher.gpu_mem_gb (GiB) when
    set (a MIG slice, a GPU not in the table), else the memory of hydra.launcher.gpu_type;
    (None, []) when it names neither. An unknown gpu_type is a problem listing the known ones."""
    gpu_type, mem_gb = preset.get("gpu_type"), float(preset.get("gpu_mem_gb") or 0)
    gib, problems = gpu_type_memory(str(gpu_type)) if gpu_type else (None, [])
    if mem_gb < 0:
        problems.append(f"hydra.launcher.gpu_mem_gb={mem_gb:g} must be >= 0 (0 = from gpu_type); fix: the GiB "
                        "of one GPU, or 0")
    if problems:
        return None, problems
    if mem_gb > 0:
        return (int(mem_gb * GIB), f"hydra.launcher.gpu_mem_gb={mem_gb:g}"), []
    if gib is not None:
        return (int(gib * GIB), f"hydra.launcher.gpu_type={gpu_type}: {gib:g} GiB"), []
    return None, []


def check_point(cfg: Config, spec: NodeSpec, budget: Optional[Budget]) -> tuple[Optional[Shape], list[str]]:
    """(shape, every problem) of one point: validate() on its world size, then its shape.

    The memory check of a point that runs on the preset's GPUs (gpus_per_node > 0 and not
    device=cpu) uses the preset's `budget` unless the point sets launcher.gpu_mem_gb, so an
    oversized point is rejected even where the submitting machine sees no GPU (or another one).
    """
    on_gpus = spec.gpus_per_node > 0 and cfg.device != "cpu"
    problems = validate(cfg, point_world_size(cfg), gpu_budget=budget if on_gpus else None)
    shape, shape_problems = resource_shape(cfg, spec)
    return shape, problems + shape_problems


def group_by_shape(items: Iterable[tuple[Shape, Any]]) -> dict[Shape, list[Any]]:
    """{shape: items} in first-seen order of the shapes and, within one, of the items."""
    groups: dict[Shape, list[Any]] = {}
    for shape, item in items:
        groups.setdefault(shape, []).append(item)
    return groups


def task_port(slurm_job_id: str) -> int:
    """Rendezvous port of one job of an array: derived from its own SLURM_JOB_ID.

    Slurm gives every array task a job id of its own (SLURM_ARRAY_JOB_ID_SLURM_ARRAY_TASK_ID
    names it; SLURM_JOB_ID numbers it uniquely), so two array tasks, or jobs of two
    arrays, that share a node get different ports (see megaft.launch.env.slurm_port).
    It is the port a plain `srun` step 0 of that job would use.
    """
    return slurm_port(slurm_job_id, "0")


def task_python(executable: str = sys.executable) -> str:
    """The interpreter command of submitit's sbatch script (`<it> -u -m submitit.core._submit`):
    blocks SIGUSR1/2, then execs Python with the same arguments (the mask survives exec).

    A warning that arrives while the task imports torch stays pending instead of killing it
    (the default action), as under megaft-train (megaft.cli), and submitit's own
    USR2 handler never fires: PreemptFlag.install() in run_rank unblocks both and handles them.
    """
    blocked = ", ".join(f"signal.{sig.name}" for sig in WARNING_SIGNALS)
    code = (f"import os, signal, sys; signal.pthread_sigmask(signal.SIG_BLOCK, ({blocked},)); "
            "os.execv(sys.executable, [sys.executable] + sys.argv[1:])")
    return f"{shlex.quote(executable)} -c {shlex.quote(code)}"


def shape_dict(shape: Shape) -> dict[str, int]:
    return dict(shape._asdict(), world_size=shape.world_size)


def sbatch_parameters(shape: Shape, preset: Mapping[str, Any]) -> dict[str, Any]:
    """submitit.SlurmExecutor parameters of the array of `shape` (preset: hydra.launcher fields)."""
    params: dict[str, Any] = dict(
        job_name=f"{preset['job_name']}-{shape.tag()}", nodes=shape.nodes, ntasks_per_node=shape.tasks_per_node,
        cpus_per_task=shape.cpus_per_task, time=preset["timeout_min"], array_parallelism=preset["array_parallelism"],
        setup=list(preset["setup"]),
        # megaft's preemption path (megaft.launch.preempt) listens for USR1 (and USR2, submitit's, which it
        # takes over during training): save, requeue, exit. --requeue: `scontrol requeue` needs a requeueable
        # job where the cluster's JobRequeue=0, as slurm/train_srun.sbatch asks too.
        additional_parameters={"signal": f"USR1@{preset['signal_delay_s']}", "requeue": True,
                               **preset["additional_parameters"]})
    if shape.min_nodes:
        # The script's --nodes=min-max; submitit's own `nodes` (an int) still counts the tasks of a full job.
        params["additional_parameters"]["nodes"] = f"{shape.min_nodes}-{shape.nodes}"
    if preset["partition"]:
        params["partition"] = preset["partition"]
    if shape.gpus_per_node:
        params["gpus_per_node"] = shape.gpus_per_node
    if preset["mem_gb"]:
        params["mem"] = f"{preset['mem_gb']}GB"
    return params
