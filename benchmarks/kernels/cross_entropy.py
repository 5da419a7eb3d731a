"""Cross-entropy ops.

cross_entropy: per-token loss from logits [tokens, vocab]. torch is megaft's
vocabulary-parallel reference (fp32 copy of the logits); torch.F is
F.cross_entropy(reduction="none"); Triton and CUDA C++ (online logsumexp, no fp32 copy), Liger.
Bytes: forward reads the logits once, backward reads them and writes their gradient.

linear_cross_entropy: the head projection and the loss from hidden [tokens, hidden]
and the head weight [vocab, hidden]. torch / torch.compile are the unfused pair (all
logits); torch.chunked, triton and cuda are megaft's fused path (chunks of tokens, torch,
Triton or CUDA C++ statistics), liger its FusedLinearCrossEntropy. FLOPs: the 2·T·H·V of the
forward projection and twice that in backward (input and weight gradients), 6·T·H·V
for fwd+bwd, counted alike for every provider (the fused path's recomputation is its
own cost). Peak memory is the number this op is about.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.kernels.providers import Op, cuda_reason, dtype_size, module_reason
from megaft.kernels.cross_entropy import cross_entropy, linear_cross_entropy, reference

CHUNK = 4096  # tokens per chunk of the fused linear cross-entropy


def _labels(n, vocab, device, gen):
    labels = torch.randint(0, vocab, (n,), generator=gen)
    labels[::10] = -100  # some ignored tokens, as with prompt masking
    return labels.to(device)


def ce_shapes(small: bool) -> list[tuple]:
    if small:
        return [(256, 4096), (512, 32000)]
    return [(8192, 32000), (8192, 128256), (4096, 152064)]  # tokens, vocab


def ce_inputs(shape, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = (2 * torch.randn(shape, generator=gen)).to(device, dtype).requires_grad_()
    return logits, _labels(shape[0], shape[1], device, gen)


def _ce_ref(x, y):
    return reference.cross_entropy(x, y, group=None, vocab_start=0, vocab_size=x.shape[-1])


def _ce_liger(x, y):
    from liger_kernel.transformers.functional import liger_cross_entropy

    return liger_cross_entropy(x, y, ignore_index=-100, reduction="none")


CE = Op(
    name="cross_entropy", shapes=ce_shapes, inputs=ce_inputs, validate_shape=(37, 1000),
    work=lambda shape, dtype, mode: {"fwd": 1, "full": 3}[mode] * shape[0] * shape[1] * dtype_size(dtype),
    providers={
        "torch": _ce_ref,
        "torch.F": lambda x, y: F.cross_entropy(x.float(), y, reduction="none"),
        "torch.compile": _ce_ref,
        "triton": lambda x, y: cross_entropy(x, y, backend="triton"),
        "cuda": lambda x, y: cross_entropy(x, y, backend="cuda"),
        "liger": _ce_liger,
    },
    needs={"cuda": cuda_reason("cross_entropy"), "liger": module_reason("liger_kernel")},
)


def lce_shapes(small: bool) -> list[tuple]:
    if small:
        return [(256, 256, 4096), (512, 512, 8192)]
    return [(8192, 4096, 32000), (8192, 4096, 128256), (4096, 8192, 128256)]  # tokens, hidden, vocab


def lce_inputs(shape, dtype, device, seed):
    n, d, v = shape
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=gen).to(device, dtype).requires_grad_()
    weight = (torch.randn(v, d, generator=gen) / d ** 0.5).to(device, dtype).requires_grad_()
    return hidden, weight, _labels(n, v, device, gen)


def _lce_ref(h, w, y):
    return reference.linear_cross_entropy(h, w, y, group=None, vocab_start=0, vocab_size=w.shape[0])


def _lce_liger(h, w, y):
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

    return LigerFusedLinearCrossEntropyFunction.apply(h, w, y, None, None, -100, 0.0, 0.0, "none")


LCE = Op(
    name="linear_cross_entropy", shapes=lce_shapes, inputs=lce_inputs, kind="compute", validate_shape=(37, 24, 1000),
    work=lambda shape, dtype, mode: {"fwd": 2, "full": 6}[mode] * shape[0] * shape[1] * shape[2],
    providers={
        "torch": _lce_ref,
        "torch.compile": _lce_ref,
        "torch.chunked": lambda h, w, y: linear_cross_entropy(h, w, y, backend="torch", chunk=CHUNK),
        "triton": lambda h, w, y: linear_cross_entropy(h, w, y, backend="triton", chunk=CHUNK),
        "cuda": lambda h, w, y: linear_cross_entropy(h, w, y, backend="cuda", chunk=CHUNK),
        "liger": _lce_liger,
    },
    needs={"cuda": cuda_reason("cross_entropy"), "liger": module_reason("liger_kernel")},
)
