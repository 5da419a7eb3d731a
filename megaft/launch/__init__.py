"""Starting ranks: the local launcher, and the environment torchrun or srun sets (env.py)."""
