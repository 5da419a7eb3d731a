"""Bucket layout and the hook-driven reduction, in one process (no collectives needed)."""
import pytest
import torch
from torch import nn

from megaft.config.optim import OptimConfig
from megaft.optim.zero import build_optimizer
from megaft.parallel.data.flat import FlatParams, plan_buckets
from megaft.parallel.grid import ParallelGrid


def test_plan_buckets_cuts_at_params_and_pads():
    # caps at >= 10 elements; every bucket padded to a multiple of 4
    plan = plan_buckets([6, 6, 3, 20, 1], cap=10, multiple=4)
    assert [(a, z, idx) for a, z, idx, _ in plan] == [(0, 12, [0, 1]), (12, 36, [2, 3]), (36, 40, [4])]
    assert [offs for *_, offs in plan] == [[0, 6], [12, 15], [36]]
    assert [(a, z) for a, z, *_ in plan_buckets([5, 7], cap=0, multiple=3)] == [(0, 12)]  # cap 0: one bucket


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def test_flat_layout_is_reverse_order_views():
    model = _model()
    want = [p.detach().clone() for p in model.parameters()]
    flat = FlatParams(model, weight_decay=0.1, device=torch.device("cpu"), bucket_numel=100, multiple=3)
    for p, w in zip(model.parameters(), want):
        assert torch.equal(p, w)  # values kept
        assert p.data.untyped_storage().data_ptr() in {g.data.untyped_storage().data_ptr() for g in flat.groups}
    matrices = flat.groups[0]
    assert matrices.params == [model[4].weight, model[2].weight, model[0].weight]  # backward order
    assert all(b.numel % 3 == 0 for b in flat.buckets)
    # the first bucket expected ready holds the last layer's weight
    assert any(p is model[4].weight or p is model[4].bias for p in flat.buckets[0].params)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_buckets_launch_during_last_backward_only(zero):
    """Accumulation micro-steps launch nothing (zero 0/1); the last backward launches every
    bucket from its hooks, before finish(); the reduced grads equal plain autograd's."""
    model = _model()
    ref = _model()
    cfg = OptimConfig()
    flat, opt, reducer = build_optimizer(model, cfg, zero=zero, bucket_mb=200 * 4 / 2 ** 20,
                                         grid=ParallelGrid.single())
    assert len(reducer.buckets) >= 3
    xs = [torch.randn(5, 8) for _ in range(3)]
    for i, x in enumerate(xs):
        if i == len(xs) - 1:
            reducer.arm()
        model(x).square().sum().backward()
        ref(x).square().sum().backward()
        launched = len(reducer._pending)
        if zero < 2:
            assert launched == (len(reducer.buckets) if i == len(xs) - 1 else 0)
        else:  # zero 2, 3 reduce every micro-batch, as soon as buckets fill
            assert launched == len(reducer.buckets) * (i + 1)
    reducer.finish()
    if zero == 3:  # every layer was freed again after its backward
        assert opt.gatherer.held_bytes() == 0
    got = torch.cat([g.reshape(-1) for g in opt.grads])
    lookup = dict(zip(map(id, model.parameters()), ref.parameters()))
    want = torch.cat([torch.cat([lookup[id(p)].grad.reshape(-1) for p in b.params]
                                + [torch.zeros(b.numel - sum(p.numel() for p in b.params))])
                      for b in opt.buckets]) if zero else torch.cat([
                          torch.cat([lookup[id(p)].grad.reshape(-1) for p in g.params]) for g in flat.groups])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # accumulation order differs only
