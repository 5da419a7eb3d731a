"""The `megaft-train` console script: Slurm's warning signals are blocked before the slow imports.

Slurm sends SIGUSR1 (`--signal=USR1@N`) or SIGUSR2 (submitit's choice) before a job's time
limit, and `scancel --signal` any time. Their default action kills the process, and importing
torch and Hydra takes seconds (tens on a loaded node), so one arriving then would end the job
without a checkpoint. Blocked from the first line, it stays pending until the handlers exist:
PreemptFlag.install() in a rank and the local launcher's forwarding unblock it, and it is
delivered then. Spawned ranks inherit the mask, so they are covered the same way.
"""
import signal

WARNING_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)


def train() -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, WARNING_SIGNALS)
    from megaft.train import main

    main()
