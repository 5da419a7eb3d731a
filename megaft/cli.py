"""The console scripts: Slurm's warning signals are blocked before the slow imports.

Slurm sends SIGUSR1 (`--signal=USR1@N`) or SIGUSR2 (submitit's choice) before a job's time
limit, and `scancel --signal` any time. Their default action kills the process, and importing
torch and Hydra takes seconds (tens on a loaded node), so one arriving then would end the job
without a checkpoint. Blocked from the first line, it stays pending until the handlers exist:
PreemptFlag.install() in a rank (megaft.training.stop) and the local launcher's forwarding
unblock it, and it is delivered then. Spawned ranks inherit the mask, so they are covered too.
"""
import gc
import importlib
import signal

from megaft.signals import WARNING_SIGNALS


def _run(module: str):
    """Block the warning signals, then import `module` (torch, Hydra) and run its main();
    its return value is the exit status (the console script passes it to sys.exit)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, WARNING_SIGNALS)
    return importlib.import_module(module).main()


def train():
    """`megaft-train`."""
    return _run("megaft.train")


def verify():
    """`megaft-verify`: runs ranks like megaft-train."""
    return _run("megaft.verify.app")


def commbench():
    """`megaft-commbench`: runs ranks like megaft-train."""
    return _run("megaft.commbench.app")


def plan():
    """`megaft-plan`: starts no rank, but behaves like every other entry point. A short-lived
    command that makes millions of small acyclic objects: the cycle collector's passes over
    them (imports, composition, search) find nothing, so it stays off."""
    gc.disable()
    return _run("megaft.plan.app")


def scale():
    """`megaft-scale`: submits a scaling study (megaft-train -m) and reports it; starts no rank."""
    return _run("megaft.scale.app")


def evaluate():
    """`megaft-eval`: lm-eval-harness on a run's model; starts no rank."""
    return _run("megaft.eval.cli")


def chat():
    """`megaft-chat`: a terminal chat with a run's or an HF checkpoint; tp over local ranks."""
    return _run("megaft.chat.cli")


def score():
    """`megaft-score`: megaft-train with train.max_steps=0, storing the reference log-probs (pref.scores)."""
    return _run("megaft.score")
