"""parallel.ep (expert parallelism) in validate(): every layout it cannot run is refused
with a message that names the problem and its fix, on a tiny mixture of experts built in
Python (no files, no ranks); the memory check offers ep as a fix for a MoE that does not fit."""
from __future__ import annotations

import pytest

from megaft.config import Config
from megaft.config.model import ModelConfig
from megaft.config.parallel import check_parallel
from megaft.perf.memory import check_memory
from megaft.validation import check_layout, validate

SHAPE = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=50, max_seq_len=256)


def config(*, experts: int = 4, **parallel) -> Config:
    """A Mixtral-like model of `experts` experts (0: a dense Llama) on the given parallel.* settings."""
    cfg = Config()
    moe = dict(arch="mixtral", n_experts=experts, top_k=2) if experts else {}
    cfg.model = ModelConfig(**SHAPE, **moe)
    cfg.data.seq_len, cfg.device = 32, "cpu"
    cfg.train.micro_batch_size, cfg.train.global_batch_size = 1, 8
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    return cfg


def about(problems: list[str], *words: str) -> list[str]:
    """The problems that mention every one of `words`."""
    return [p for p in problems if all(w in p for w in words)]


def test_a_valid_expert_layout_has_no_ep_problem():
    # 8 ranks: tp=2, dp=4; ep=2 and ep=4 divide both dp*cp=4 and the 4 experts
    for ep in (2, 4):
        cfg = config(tp=2, ep=ep)
        assert check_parallel(cfg.parallel, 8) == []
        assert about(validate(cfg, 8), "divide") == about(validate(cfg, 8), "dense") == []


@pytest.mark.parametrize("tp,cp,ep,replicas", [(2, 1, 8, "4*1 = 4"), (1, 1, 16, "8*1 = 8"), (1, 2, 3, "4*2 = 8")])
def test_ep_must_divide_the_data_parallel_replicas(tp, cp, ep, replicas):
    cfg = config(experts=48, tp=tp, cp=cp, ep=ep)  # 48 experts: every ep here divides them
    (problem,) = about(check_parallel(cfg.parallel, 8), f"parallel.ep={ep}")
    assert f"parallel.ep={ep} must divide dp*cp = {replicas}" in problem
    assert f"fix: parallel.ep among the divisors of {replicas.split()[-1]}" in problem
    assert about(validate(cfg, 8), f"parallel.ep={ep} must divide dp*cp") == [problem]  # validate() reports it


def test_ep_must_divide_the_expert_count():
    cfg = config(experts=6, ep=4)  # 8 ranks: dp=8; ep=4 divides dp but not the 6 experts
    assert check_parallel(cfg.parallel, 8) == []
    (problem,) = about(check_layout(cfg, 8), "model.n_experts=6")
    assert "parallel.ep=4 does not divide model.n_experts=6" in problem
    assert "fix: parallel.ep among the common divisors of 6 and dp*cp" in problem
    assert about(validate(cfg, 8), "model.n_experts=6") == [problem]


def test_ep_needs_a_mixture_of_experts():
    cfg = config(experts=0, ep=2)
    (problem,) = about(check_layout(cfg, 8), "parallel.ep=2")
    assert "is dense" in problem and "model.arch=llama" in problem and problem.endswith("fix: parallel.ep=1")
    assert about(validate(cfg, 8), "is dense") == [problem]


def test_powersgd_with_ep_is_refused():
    cfg = config(ep=2, grad_compression="powersgd")
    (problem,) = about(check_parallel(cfg.parallel, 8), "powersgd")
    assert "parallel.ep>1 is not supported" in problem
    assert "fix: parallel.grad_compression=none or bf16" in problem
    assert about(validate(cfg, 8), "powersgd") == [problem]
    cfg.parallel.ep = 1  # without ep, powersgd reduces every gradient over one group as before
    assert about(check_parallel(cfg.parallel, 8), "powersgd") == []


def test_the_memory_fix_offers_ep_for_a_mixture_of_experts():
    # 8 ranks, tp=2: 4 replicas; the 4 experts split over 2 or 4 of them
    cfg = config(tp=2)
    cfg.launcher.gpu_mem_gb = 0.5  # below the fixed margin: never fits
    (problem,) = about(validate(cfg, 8), "estimated memory per GPU")
    assert "raise parallel.ep=1 (to 2 or 4: each rank holds n_experts/ep experts)" in problem
    cfg.parallel.ep = 2
    assert "raise parallel.ep=2 (to 4: " in check_memory(cfg, 8)[0]
    cfg.parallel.ep = 4  # nothing left to split over more ranks
    assert "parallel.ep" not in check_memory(cfg, 8)[0]
    dense = config(experts=0, tp=2)
    dense.launcher.gpu_mem_gb = 0.5
    assert "parallel.ep" not in about(validate(dense, 8), "estimated memory per GPU")[0]
