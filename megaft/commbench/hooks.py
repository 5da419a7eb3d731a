"""Fault injection for tests: a fake host map, a corrupted result, a slowed link.

Every field is optional and must pickle (top-level functions or functools.partial), since
the local launcher starts ranks with the spawn method. A real run uses `Hooks()`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch


@dataclass(frozen=True)
class Hooks:
    # rank -> host name, instead of socket.gethostname(): several "nodes" on one machine.
    hostname: Optional[Callable[[int], str]] = None
    # (collective, rank, output) after each call, before the check: a wrong result.
    corrupt: Optional[Callable[[str, int, torch.Tensor], None]] = None
    # (src, dst) -> seconds to sleep before each payload send (inside the timed region): a slow link.
    delay_send: Optional[Callable[[int, int], float]] = None

    def delay(self, src: int, dst: int) -> float:
        return self.delay_send(src, dst) if self.delay_send else 0.0
