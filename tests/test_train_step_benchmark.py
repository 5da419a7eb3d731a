"""benchmarks/train_step's measurement order: interleaved rounds, reversed every other
round (ABBA), each provider's median over all its turns; and one real tiny run of the
torch path on CPU (a smoke test of the wiring, not a timing)."""
import pytest
import torch

from benchmarks.train_step import measure
from megaft.config.model import ModelConfig

CPU = torch.device("cpu")
TINY = ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=40, max_seq_len=16)


def test_turns_alternate_and_the_median_covers_every_turn(monkeypatch):
    turns, decisions = [], []

    def fake_decide(provider, cfg, **kw):  # auto decided once per provider, before the rounds
        decisions.append(provider)
        return f"kernels of {provider}", {"rmsnorm": {"backend": f"b{provider}"}}

    def fake_block(provider, cfg, *, steps, kernels, **kw):
        assert kernels == f"kernels of {provider}"  # every turn runs the provider's decision
        turns.append((provider, steps))
        # a drift: every later turn is slower; a fixed order would charge it to B
        t = {"A": 1.0, "B": 1.0}[provider] + 0.1 * len(turns)
        return measure.Block([t] * steps, first_loss=2.0, peak_mem_bytes=len(turns))

    monkeypatch.setattr(measure, "decide", fake_decide)
    monkeypatch.setattr(measure, "block", fake_block)
    results = measure.run(["A", "B"], TINY, device=CPU, batch=1, seq=4, precision="fp32", warmup=0, steps=4,
                          rounds=4)
    assert turns == [("A", 1), ("B", 1), ("B", 1), ("A", 1), ("A", 1), ("B", 1), ("B", 1), ("A", 1)]
    assert [r.provider for r in results] == ["A", "B"]
    assert results[0].step_s == pytest.approx(results[1].step_s)  # ABBA cancels a linear drift
    assert results[0].step_s == pytest.approx(1.45)  # median of A's turns 1, 4, 5, 8
    assert [r.peak_mem_bytes for r in results] == [8, 7]  # the largest of its turns
    assert decisions == ["A", "B"] and [r.kernels for r in results] == ["bA", "bB"]
    assert measure.split_steps(5, 2) == [3, 2] and measure.round_orders(["A", "B", "C"], 2)[1] == ["C", "B", "A"]
    with pytest.raises(SystemExit, match="--rounds=3 needs"):
        measure.split_steps(2, 3)


def test_tiny_torch_run_on_cpu():
    # two torch providers: the same seeded weights and batch in every turn give one first loss
    results = measure.run(["backend=torch", "backend=torch,fused_linear_cross_entropy=true,ce_chunk_tokens=3"],
                          TINY, device=CPU, batch=2, seq=8, precision="fp32", warmup=1, steps=2, rounds=2)
    assert len(results) == 2 and all(r.step_s > 0 and r.tokens_per_s == 16 / r.step_s for r in results)
    assert results[1].first_loss == pytest.approx(results[0].first_loss, rel=1e-5)
    assert results[0].peak_mem_bytes is None  # CPU: no CUDA allocator
    assert [r.kernels for r in results] == ["torch", "torch"]  # what ran, as summary.json records it
    kernels, record = measure.decide("backend=auto", TINY, device=CPU, batch=2, seq=8, precision="fp32")
    assert kernels.backend == "auto" and {r["source"] for r in record.values()} == {"cpu"}  # auto off CUDA: torch
