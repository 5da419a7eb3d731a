"""The launcher's schema, registered as `hydra/launcher: base_slurm`; the presets in
conf/hydra/launcher/*.yaml start with `defaults: [base_slurm]` and set values."""
# No `from __future__ import annotations`: Hydra's plugin scan runs this module outside
# sys.modules, where dataclasses cannot resolve string annotations.
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore


@dataclass
class SlurmLauncherConf:
    _target_: str = "hydra_plugins.megaft_slurm_launcher.launcher.MegaftSlurmLauncher"
    partition: Optional[str] = None  # Slurm partition (--partition); null = the cluster's default
    nodes: int = 0  # nodes per job; 0 = derive from the point's ranks (launcher.nodes wins over this)
    gpus_per_node: int = 0  # GPUs per node, one per rank (--gpus-per-node); 0 = CPU nodes
    tasks_per_node: int = 0  # CPU nodes only: ranks per node; 0 = all of a point's ranks on one node
    cpus_per_task: int = 1  # cores per rank (--cpus-per-task); torch uses this many threads
    # The memory check's budget per GPU (megaft.perf.memory) for points without launcher.gpu_mem_gb:
    gpu_type: Optional[str] = None  # the nodes' GPU, e.g. h100, h200, a100-80g (megaft.perf.hardware)
    gpu_mem_gb: float = 0.0  # GiB per GPU, wins over gpu_type (a MIG slice, a GPU not in the table); 0 = gpu_type's
    mem_gb: int = 0  # memory per node in GB (--mem); 0 = don't ask (the partition's default)
    timeout_min: int = 60  # wall-clock limit per job in minutes (--time)
    signal_delay_s: int = 120  # SIGUSR1 this long before the limit: every rank saves, the job requeues
    array_parallelism: int = 256  # jobs of one array running at once (--array=...%N)
    job_name: str = "megaft"  # job name prefix; the shape is appended (megaft-n1_t2_g0_c1)
    setup: List[str] = field(default_factory=list)  # shell lines run in the sbatch script before srun
    additional_parameters: Dict[str, Any] = field(default_factory=dict)  # more #SBATCH options: {qos: high}
    wait: bool = False  # true: block until every job ends and return results; false: return after sbatch
    submitit_folder: str = "${hydra.sweep.dir}/.submitit/%j"  # submitit's pickles and logs, per job


ConfigStore.instance().store(group="hydra/launcher", name="base_slurm", node=SlurmLauncherConf, provider="megaft")
