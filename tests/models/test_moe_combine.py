"""The MoE combine (megaft.models.moe.combine) against autograd's fp32 sum: the same values
and gradients bit for bit (the recast in backward is exact), with half the saved bytes of
the expert outputs under bf16."""
import pytest
import torch

from megaft.models.moe.combine import combine


def _reference(y, w):
    return (y.float() * w.unsqueeze(-1)).sum(1)


def _run(fn, y, w):
    y, w = y.detach().requires_grad_(), w.detach().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fn(y, w)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(2)))
    return out, y.grad, w.grad, sum(t.numel() * t.element_size() for t in saved)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_equals_the_fp32_sum(dtype):
    g = torch.Generator().manual_seed(1)
    y, w = torch.randn(24, 2, 16, generator=g).to(dtype), torch.rand(24, 2, generator=g)
    new, ref = _run(combine, y, w), _run(_reference, y, w)
    for a, b in zip(new[:3], ref[:3]):  # the same fp32 products and sums: exact
        assert a.dtype == b.dtype and torch.equal(a, b)
    # saved for backward: y in its own dtype (and w) in place of y's fp32 copy
    assert new[3] == y.numel() * y.element_size() + w.numel() * 4
    assert ref[3] - new[3] == y.numel() * (4 - y.element_size())
