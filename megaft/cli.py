"""The console scripts: Slurm's warning signals are blocked before the slow imports.

Slurm sends SIGUSR1 (`--signal=USR1@N`) or SIGUSR2 (submitit's choice) before a job's time
limit, and `scancel --signal` any time. Their default action kills the process, and importing
torch and Hydra takes seconds (tens on a loaded node), so one arriving then would end the job
without a checkpoint. Blocked from the first line, it stays pending until the handlers exist:
PreemptFlag.install() in a rank (megaft.training.stop) and the local launcher's forwarding
unblock it, and it is delivered then. Spawned ranks inherit the mask, so they are covered too.
"""
import importlib
import signal

from megaft.signals import WARNING_SIGNALS


def _run(module: str) -> None:
    """Block the warning signals, then import `module` (torch, Hydra) and run its main()."""
    signal.pthread_sigmask(signal.SIG_BLOCK, WARNING_SIGNALS)
    importlib.import_module(module).main()


def train() -> None:
    """`megaft-train`."""
    _run("megaft.train")


def verify() -> None:
    """`megaft-verify`: runs ranks like megaft-train."""
    _run("megaft.verify.app")


def commbench() -> None:
    """`megaft-commbench`: runs ranks like megaft-train."""
    _run("megaft.commbench.app")


def plan() -> None:
    """`megaft-plan`: starts no rank, but behaves like every other entry point."""
    _run("megaft.plan.app")


def scale() -> None:
    """`megaft-scale`: submits a scaling study (megaft-train -m) and reports it; starts no rank."""
    _run("megaft.scale.app")
