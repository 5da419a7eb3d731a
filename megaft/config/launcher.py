"""LauncherConfig (`launcher.*`): how ranks are started, how long a collective may wait,
how often a preempted Slurm job is requeued
or a crashed local run restarted, and whether dp follows the world a restart gets. A config-layer leaf (stdlib only)."""
from __future__ import annotations

from dataclasses import dataclass

from megaft.config.checks import at_least


@dataclass
class LauncherConfig:
    name: str = "local"  # local: start nproc ranks here (torchrun/Slurm set their own env)
    nproc: int = 2  # ranks to start with the local launcher
    timeout_s: int = 300  # seconds: a collective waiting on a hung or dead rank fails after this
    max_requeue: int = 3  # Slurm requeues after a preemption signal (counted by SLURM_RESTART_COUNT)
    world_size: int = 0  # Slurm sweeps (hydra/launcher=slurm): ranks per job; 0 = tp*cp*pp*dp (dp unset = 1)
    nodes: int = 0  # Slurm sweeps: nodes per job; 0 = the preset's, else as few as hold the ranks
    gpu_mem_gb: float = 0.0  # GiB per GPU for the memory check; 0 = a sweep preset's gpu_type, else this machine's GPU
    max_restarts: int = 0  # local launcher: restart a crashed rank set this often (resuming the newest checkpoint)
    # Elastic restart (megaft.launch.elastic): dp follows the world a (re)started job gets, tp and pp stay,
    # gradient accumulation keeps train.global_batch_size; the checkpoint is resharded to the new dp.
    elastic: bool = False
    min_nodes: int = 0  # Slurm sweeps with elastic=true: accept min_nodes..nodes (`--nodes=min-max`); 0 = fixed


def check_launcher(cfg: LauncherConfig) -> list[str]:
    """Timeout and requeue bounds (megaft.launch.preempt, megaft.launch.health)."""
    problems = []
    for key in ("launcher.world_size", "launcher.nodes"):
        problems += at_least(cfg, key, 0, "(0 = derive)", "a positive count or 0")
    problems += at_least(cfg, "launcher.timeout_s", 1, "second", "e.g. launcher.timeout_s=300")
    problems += at_least(cfg, "launcher.max_requeue", 0, "(0 = never requeue)", "e.g. launcher.max_requeue=3")
    problems += at_least(cfg, "launcher.max_restarts", 0, "(0 = a crash ends the run)", "e.g. launcher.max_restarts=2")
    if cfg.min_nodes < 0 or (cfg.nodes and cfg.min_nodes > cfg.nodes):
        problems.append(f"launcher.min_nodes={cfg.min_nodes} must be in 0..launcher.nodes={cfg.nodes} (0 = a fixed "
                        "node count); fix: e.g. launcher.min_nodes=1")
    if cfg.min_nodes and not cfg.elastic:
        problems.append(f"launcher.min_nodes={cfg.min_nodes} needs launcher.elastic=true (a smaller allocation "
                        "changes dp); fix: add launcher.elastic=true, or launcher.min_nodes=0")
    return problems
