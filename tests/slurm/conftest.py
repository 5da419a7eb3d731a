"""A real single-host Slurm for the tests in this folder (slurm/cluster.sh).

`slurm_cluster` (session) uses a cluster that already answers (`make test` starts one
first), else runs `slurm/cluster.sh up` and stops the cluster again at the end. It
skips, with the reason, only where the cluster cannot exist: not root, or the Debian
packages cannot be installed (cluster.sh exit codes 4 and 5). Any other failure of
`up` is a test error carrying the daemons' log tails.
"""
import os
import shutil
import subprocess
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLUSTER_SH = os.path.join(ROOT, "slurm", "cluster.sh")
PYTHON = os.path.join(ROOT, ".venv", "bin", "python")  # Slurm tasks need an absolute interpreter
NOT_ROOT, NO_PACKAGES = 4, 5


def _node_ready() -> bool:
    if not shutil.which("sinfo"):
        return False
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True, timeout=30)
    return out.returncode == 0 and any(s in out.stdout for s in ("idle", "mixed", "allocated"))


def _job_env() -> dict:
    """What sbatch passes on to the job: this environment minus a surrounding torchrun's
    rendezvous, which would otherwise take precedence over Slurm's (launch/env.py)."""
    drop = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}
    return {k: v for k, v in os.environ.items() if k not in drop}


@pytest.fixture(scope="session")
def slurm_cluster():
    """Yields the environment for Slurm client commands and jobs (see _job_env, plus SLURM_CONF)."""
    if not os.path.exists(PYTHON):
        pytest.skip(reason=f"{PYTHON} missing: the Slurm tests run the project's venv (make install)")
    if _node_ready():
        yield _job_env()
        return
    if os.geteuid() != 0:
        pytest.skip(reason="no Slurm cluster answers and starting one needs root: run `sudo slurm/cluster.sh up`")
    started = time.monotonic()
    out = subprocess.run([CLUSTER_SH, "up"], capture_output=True, text=True, timeout=900)
    if out.returncode == NOT_ROOT:
        pytest.skip(reason=f"slurm/cluster.sh up: {out.stderr.strip()}")
    if out.returncode == NO_PACKAGES:
        pytest.skip(reason=f"Slurm's Debian packages cannot be installed here: {out.stderr.strip()[-1500:]}")
    if out.returncode != 0:
        pytest.fail(f"slurm/cluster.sh up failed ({out.returncode}):\n{out.stdout}\n{out.stderr}", pytrace=False)
    env = _job_env()
    for line in out.stdout.splitlines():  # "export SLURM_CONF=..." lines
        if line.startswith("export ") and "=" in line:
            key, value = line[len("export "):].split("=", 1)
            env[key] = value
    print(f"\nslurm/cluster.sh up: {time.monotonic() - started:.1f}s")
    try:
        yield env
    finally:
        subprocess.run([CLUSTER_SH, "down"], capture_output=True, text=True, timeout=120)
