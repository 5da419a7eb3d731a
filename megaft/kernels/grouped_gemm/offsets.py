"""The group offsets the compiled backends read on the device, built from the CPU counts."""

from __future__ import annotations

import torch


def offsets(counts: torch.Tensor, device: torch.device, *, dtype: torch.dtype = torch.int64,
            start: bool = True) -> torch.Tensor:
    """[0, c0, c0 + c1, ..., N] ([G + 1]), or with ``start=False`` the G group ends
    (torch._grouped_mm's ``offs``), on ``device``. To CUDA through a pinned buffer and
    ``non_blocking``: a pageable copy would wait for all the work queued before it."""
    ends = counts.cumsum(0).to(dtype)
    host = torch.cat([ends.new_zeros(1), ends]) if start else ends
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
