"""The optional per-pair `margin` of preference records (TRL's RewardTrainer subtracts it from
r_chosen - r_rejected). The prepared store keeps token ids only, so the margins are read from
the same files in the store's order (data.path or data.sources, each source's files in order):
one float per pair, held in memory."""
from __future__ import annotations

from typing import Optional

import numpy as np

from megaft.data.errors import DataError
from megaft.data.jsonl import where
from megaft.data.sources import scan_file, source_files


def _margin(obj) -> object:
    return obj.get("margin") if isinstance(obj, dict) else None


def read_margins(paths: list[str]) -> Optional[np.ndarray]:
    """Every record's margin [pairs] (float64) of the files of `paths`, in order; None when no
    record has one. Raises DataError "FILE:LINE: problem; fix: ..." for a margin that is not a
    number, or a record without one when others have one (TRL's collator reads the column of all)."""
    values, first_missing, first_given = [], None, None
    for path in paths:
        for file in source_files(path):
            for line, margin, problem in scan_file(file, parse=_margin, what="pairs"):
                if problem is not None:
                    raise DataError(f"{where(file, line)}: {problem}")
                if margin is None:
                    first_missing = first_missing or where(file, line)
                    values.append(0.0)
                    continue
                if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not np.isfinite(margin):
                    raise DataError(f"{where(file, line)}: 'margin' is {margin!r}, not a finite number; fix: "
                                    "write it as a number (the reward difference the pair must exceed), or drop it")
                first_given = first_given or where(file, line)
                values.append(float(margin))
    if first_given is None:
        return None
    if first_missing is not None:
        raise DataError(f"{first_missing}: the pair has no 'margin' and others have one ({first_given}); fix: give "
                        "every pair a margin (0 for none) or none of them")
    return np.asarray(values, dtype=np.float64)
