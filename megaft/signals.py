"""Signal names shared by the console scripts, the ranks and the launchers (stdlib only,
so megaft.cli can block them before any heavy import)."""
import signal

# Slurm's warnings before a time limit: USR1 from `--signal=USR1@N` (or scancel --signal),
# USR2 from submitit's `--signal=USR2@N`. Both mean: stop, save and requeue.
WARNING_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)
# scancel and Slurm's own preemption: stop and save; Slurm decides the job's fate.
STOP_SIGNALS = (signal.SIGTERM,)
