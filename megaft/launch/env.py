"""Where a rank learns who it is: the one place that reads launcher environment."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    init_method: str  # torch.distributed init_method (env:// or file://...)


def external_env() -> Optional[DistEnv]:
    """The rank set up by torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT),
    or None when megaft must start the ranks itself."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    return DistEnv(rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                   local_rank=int(os.environ.get("LOCAL_RANK", 0)), init_method="env://")
