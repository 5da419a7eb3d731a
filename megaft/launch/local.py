"""The local launcher: start `launcher.nproc` ranks on this machine."""
from __future__ import annotations

import os
import tempfile

import torch.multiprocessing as mp

from megaft.config import Config
from megaft.launch.rank import local_worker


def launch_local(cfg: Config, run_dir: str) -> None:
    """Spawn nproc ranks and wait; a rank's exception fails the launch with its traceback.

    Rendezvous goes through a file in a fresh temporary directory, so concurrent runs
    on one machine never race for a TCP port.
    """
    nproc = cfg.launcher.nproc
    with tempfile.TemporaryDirectory(prefix="megaft-rdzv-") as tmp:
        init_file = os.path.join(tmp, "init")
        mp.start_processes(local_worker, args=(cfg, run_dir, nproc, init_file), nprocs=nproc,
                           join=True, start_method="spawn")
