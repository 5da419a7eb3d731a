"""Sampled draws (megaft.inference.generate.draw) happen on the logits' device with a generator
seeded by (seed, step): on the CPU the same tokens as the former host draw, reproducible."""
from __future__ import annotations

import pytest
import torch

from megaft.inference.generate import Sampling, draw, draw_generator, top_p_filter

SAMPLING = Sampling(temperature=0.8, top_p=0.9, seed=2)


def _host_draws(logits: torch.Tensor, n: int) -> list[torch.Tensor]:
    """The former draw: the logits copied to the host, a CPU generator seeded by (seed, step)."""
    g = torch.Generator().manual_seed((SAMPLING.seed * 1_000_003 + 3) % (2 ** 63))
    out = []
    for _ in range(n):
        scores = top_p_filter(logits.float().cpu() / SAMPLING.temperature, SAMPLING.top_p)
        out.append(torch.multinomial(scores.softmax(dim=-1), 1, generator=g).squeeze(1))
    return out


def test_cpu_draws_equal_the_former_host_draws():
    torch.manual_seed(0)
    logits = torch.randn(6, 300) * 4
    g = draw_generator(SAMPLING, 3, logits.device)
    assert g.device == torch.device("cpu") and draw_generator(SAMPLING, 3).device == torch.device("cpu")
    got = [draw(logits, SAMPLING, g) for _ in range(20)]
    for a, b in zip(got, _host_draws(logits, 20)):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_draws_stay_on_the_device_and_are_seeded():
    torch.manual_seed(0)
    logits = (torch.randn(6, 300) * 4).cuda()
    g = draw_generator(SAMPLING, 3, torch.device("cuda"))
    assert g.device.type == "cuda"
    first = [draw(logits, SAMPLING, g) for _ in range(10)]
    assert all(t.device == logits.device for t in first)
    g = draw_generator(SAMPLING, 3, logits.device)
    assert all(torch.equal(a, draw(logits, SAMPLING, g)) for a in first)  # seeded: the same again
    kept = top_p_filter(logits / SAMPLING.temperature, SAMPLING.top_p) > float("-inf")
    assert all(kept[torch.arange(6), t].all() for t in first)  # only nucleus tokens drawn
