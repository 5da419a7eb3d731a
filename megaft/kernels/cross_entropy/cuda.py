"""Cross-entropy statistics and gradient over megaft._cuda's ``torch.ops.megaft.cross_entropy_*``
(csrc/cuda/cross_entropy.cu): the CUDA C++ twin of triton.py, same functions and math.

One block per row: ``stats`` reads the logits once in their own dtype (online max and
sum-exp, warp reductions) and returns fp32 (m, s, t) per row, which chunked.py combines
over tp exactly as for Triton; ``grad`` writes ``g * (softmax - onehot)`` in the logits'
dtype, into a new tensor or, with ``inplace``, over the logits (the fused linear
cross-entropy's recomputed chunk, which nothing else holds). No fp32 copy of the logits.
Availability is checked by the caller (megaft.kernels.dispatch).
"""

from __future__ import annotations

import torch


def _ops():
    # Looked up per call: the ops exist only once megaft._cuda is imported (dispatch does).
    return torch.ops.megaft


def stats(x: torch.Tensor, labels: torch.Tensor, vocab_start: int, n_real: int):
    """(m, s, t) per row of x [N, V_local] (fp32 each); columns >= n_real are padding."""
    return _ops().cross_entropy_fwd(x, labels.long(), vocab_start, n_real)


def grad(x: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, g: torch.Tensor,
         vocab_start: int, n_real: int, *, inplace: bool = False) -> torch.Tensor:
    """dx [N, V_local] in x's dtype from the per-token lse and upstream grad g (0 if ignored);
    ``inplace`` overwrites x (unit column stride) and returns it."""
    op = _ops().cross_entropy_bwd_ if inplace and x.stride(-1) == 1 else _ops().cross_entropy_bwd
    return op(x, labels.long(), lse.float(), g.float(), vocab_start, n_real)
