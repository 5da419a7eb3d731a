"""megaft's Hydra launcher for Slurm sweeps (`hydra/launcher=slurm`): one submitit job
array per resource shape, every point validated before anything is queued.
Hydra finds it by scanning the `hydra_plugins` namespace package."""
