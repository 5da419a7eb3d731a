"""Fixtures the local-launcher tests share (each module opts in to `not_in_slurm` with
`pytestmark = pytest.mark.usefixtures("not_in_slurm")`)."""
import pytest

from megaft.launch.local import launch_local


@pytest.fixture
def not_in_slurm(monkeypatch):
    """A local run, even when pytest itself runs inside a Slurm job: no requeue, no restart count."""
    for key in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(key, raising=False)


@pytest.fixture(scope="module")
def straight(request, tmp_path_factory):
    """The uninterrupted run of the requesting test module's `config()` (small_config, 20 steps)
    through the same launcher, once per module: the curve the faulted runs are compared with."""
    run = str(tmp_path_factory.mktemp("straight"))
    launch_local(request.module.config(), run)
    return run
