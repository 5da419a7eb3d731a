"""CPU AdamW step: torch.optim.AdamW (foreach, fused) against megaft._C.

    python -m benchmarks.kernels.adamw_cpu [--sizes 10e6,30e6,100e6] [--reps 20]
                                           [--threads N] [--json out.json]

The CPU part of ``python -m benchmarks.kernels.adamw`` (same flags, same table, see
its docstring), kept under this name for ``make bench``.
"""

from __future__ import annotations

import sys

from benchmarks.kernels import adamw


def main(argv: list[str] | None = None) -> int:
    return adamw.main(["--device", "cpu", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
