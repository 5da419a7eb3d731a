"""The prepared store every rank opens, agreed on in one collective before any trains."""
from __future__ import annotations

from typing import Callable

import torch

from megaft.data.errors import DataError
from megaft.data.prepare import prepare_dataset
from megaft.parallel.grid import ParallelGrid


def agreed_store(data, grid: ParallelGrid, prepare: Callable = prepare_dataset, **kwargs):
    """The prepared store of `data`, opened by every rank (verified, and rebuilt when damaged:
    megaft.data.prepare), with one collective in which the ranks agree on the verdict before
    any trains: when a rank could not open it, or ranks' stores hold different tokens (data
    files that differ between nodes), every rank raises instead of some waiting on a collective.
    `prepare`: megaft.data.prepare_dataset, or megaft.pref.store.prepare_pairs for pairs."""
    store, error = None, None
    try:
        store = prepare(data, progress=grid.rank == 0, **kwargs)
    except DataError as exc:
        error = exc
    if grid.world_size == 1:
        if error is not None:
            raise error
        return store
    key = int(store.manifest["arrays"]["tokens.bin"]["sha256"][:12], 16) if store is not None else 0
    verdict = torch.tensor([int(error is not None), key, -key], dtype=torch.int64, device=grid.device)
    torch.distributed.all_reduce(verdict, op=torch.distributed.ReduceOp.MAX)
    failed, high, low = (int(v) for v in verdict.tolist())
    if error is not None:
        raise error
    if failed:
        raise DataError("another rank could not open the prepared dataset (its error above names why); no rank "
                        "trains on a store the others did not verify")
    if high != -low:
        raise DataError(f"the ranks' prepared datasets hold different tokens (this rank's: {store.path}): the "
                        "data files differ between nodes; fix: give every node the same files (a shared file system)")
    return store
