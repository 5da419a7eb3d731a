"""A run stopped on a signal after saving (not a failure): its exit status and message. Kept apart
from megaft.launch.rank so that the local launcher and megaft-train's parent import no torch."""
from __future__ import annotations

# megaft-train's exit status for a run stopped by a signal after saving a checkpoint: not
# finished, so not 0 (a Slurm `afterok` chain must not start); run again to resume. 75 is
# sysexits' EX_TEMPFAIL, "try again later" (docs/tools.md's table).
EXIT_STOPPED = 75


class RunStoppedError(RuntimeError):
    """Training stopped before train.max_steps on a signal, with a checkpoint to resume from."""


def stopped_message(summary: dict) -> str:
    return (f"stopped by {summary['stopped_by']} after saving a checkpoint, before train.max_steps; run again in "
            f"the same directory to resume (exit status {EXIT_STOPPED})")
