"""Many megaft-verify (and megaft-train) runs in one spawned process group per world size.

Starting a rank set costs seconds (interpreters, imports): `run_cases` spawns one set of
ranks per world size and each rank runs every case of that size in turn, as under
torchrun/srun (megaft.verify.run.run_verify / megaft.launch.rank.run_rank with a DistEnv:
a fresh process group per case, rendezvous through its own file); rank 0 also runs the
single-process reference and the comparison, and saves the Report. A case that fails
records each rank's traceback instead and the others still run, so the test that asserts
on a case (`report`, `check`) fails naming it. Spawns run in increasing world size and a
case may use what earlier cases of its own or a smaller world size wrote. `verify` is
run_verify for one case, on the pooled ranks (tests/multirank.py) instead of new ones.
"""
from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import traceback
from dataclasses import dataclass
from typing import Optional

from multirank import spawn

from megaft.config import Config, ConfigError
from megaft.validation import check_local_launch


@dataclass
class Case:
    name: str  # unique within a run_cases root (also the file names of its outcome)
    cfg: Config  # launcher.nproc is the world size it runs at
    run_dir: str
    verify: bool = True  # megaft-verify (the Report saved) or a plain training run (megaft-train's rank body)
    resume_from: Optional[tuple[str, int]] = None  # (run dir, step): start from a copy of it as of that step
    spec: object = None  # the megaft.training.parts.TrainSpec of the layout's run (None: the default)


def resume_copy(saved_run: str, run: str, step: int) -> None:
    """`saved_run` as it was right after its step-`step` checkpoint (newer checkpoints dropped)."""
    shutil.copytree(saved_run, run)
    ckpts = os.path.join(run, "checkpoints")
    for entry in os.listdir(ckpts):
        if entry.startswith("step_") and int(entry.split("_")[1]) > step:
            shutil.rmtree(os.path.join(ckpts, entry))


def _rank_cases(rank: int, world: int, root: str, cases: list[Case]) -> None:
    from megaft.launch.env import DistEnv
    from megaft.launch.rank import run_rank
    from megaft.training.parts import TrainSpec
    from megaft.verify.run import run_verify

    threads = max(1, (os.cpu_count() or 1) // world)  # as megaft.launch.rank.local_worker
    for case in cases:
        env = DistEnv(rank, world, rank, f"file://{os.path.join(root, case.name + '.rendezvous')}")
        try:
            if case.verify:
                report = run_verify(case.cfg, case.run_dir, env=env, threads=threads, spec=case.spec or TrainSpec())
                if rank == 0:
                    with open(os.path.join(root, case.name + ".report"), "wb") as f:
                        pickle.dump(report, f)
            else:
                # the other ranks touch nothing before the rendezvous, which rank 0 reaches after this
                if rank == 0 and case.resume_from:
                    resume_copy(case.resume_from[0], case.run_dir, case.resume_from[1])
                elif rank == 0:
                    os.makedirs(case.run_dir, exist_ok=True)
                run_rank(case.cfg, case.run_dir, env, threads, spec=case.spec)
        except BaseException:
            with open(os.path.join(root, f"{case.name}.error{rank}"), "w") as f:
                f.write(traceback.format_exc())


def run_cases(root: str, cases: list[Case]) -> None:
    """Run every case, one spawn per world size (smallest first), each case in list order."""
    names = [c.name for c in cases]
    assert len(set(names)) == len(names), names
    os.makedirs(root, exist_ok=True)
    for world in sorted({c.cfg.launcher.nproc for c in cases}):
        spawn(world, _rank_cases, root, [c for c in cases if c.cfg.launcher.nproc == world], group=False)


def check(root: str, name: str) -> None:
    """Fail with every rank's error when case `name` failed (or never ran)."""
    errors = sorted(e for e in os.listdir(root) if e.startswith(name + ".error"))
    if errors:
        raise AssertionError(f"case {name} failed:\n" + "\n".join(
            f"--- rank {e[len(name) + 6:]} ---\n{open(os.path.join(root, e)).read()}" for e in errors))


def report(root: str, name: str):
    """Case `name`'s megaft.verify.compare.Report (its failure re-raised)."""
    check(root, name)
    path = os.path.join(root, name + ".report")
    assert os.path.exists(path), f"case {name} left no report"
    with open(path, "rb") as f:
        return pickle.load(f)


def verify(cfg: Config, run_dir: str, spec=None):
    """megaft.verify.run.run_verify(cfg, run_dir, spec=spec), its layout on launcher.nproc pooled ranks
    (as under torchrun: rank 0 also runs the reference and compares) rather than on newly launched
    ones, which cost seconds of imports per rank; the same checks of the config first."""
    problems = check_local_launch(cfg)  # what the local launch would refuse (run_verify's other checks run)
    if problems:
        raise ConfigError(problems)
    root = tempfile.mkdtemp(prefix="verify-", dir=os.path.dirname(os.path.abspath(run_dir)))
    run_cases(root, [Case("verify", cfg, run_dir, spec=spec)])
    return report(root, "verify")
