"""The per-GPU memory estimate (megaft.perf.memory): the 1b preset against small budgets in
validate() (pure config, no GPU), and its params/grads/optimizer bytes against what a
tiny CPU model's optimizer really holds (`memory_bytes()`) under tp, pp, dp and ZeRO, dense and
mixture of experts (tests/test_perf_moe.py checks the MoE counts against built models)."""
import os

import pytest
import torch
from multirank import spawn
from omegaconf import OmegaConf
from train_cases import small_config

from megaft.config import Config
from megaft.optim.zero import build_optimizer
from megaft.parallel.grid import ParallelGrid
from megaft.perf.counts import rank_params
from megaft.perf.hardware import GIB
from megaft.perf.memory import check_memory, estimate_memory, estimate_ranks
from megaft.training.model import build_model
from megaft.training.parts import RunParts
from megaft.validation import validate

CONF = os.path.join(os.path.dirname(__file__), os.pardir, "conf")
LLAMA_32_1B_PARAMS = 1_235_814_400  # the published count of Llama-3.2-1B (tied embeddings)


def preset_1b(**train) -> Config:
    cfg = Config()
    fields = OmegaConf.to_container(OmegaConf.load(os.path.join(CONF, "model", "1b.yaml")))
    fields.pop("defaults")
    for key, value in fields.items():
        setattr(cfg.model, key, value)
    cfg.model.vocab_size = 128256  # Llama 3's tokenizer (no file needed)
    cfg.data.seq_len, cfg.precision, cfg.device = 2048, "bf16", "cpu"
    cfg.train.micro_batch_size, cfg.train.global_batch_size = train.get("micro", 4), 64
    return cfg


def test_1b_params_match_the_published_count():
    assert rank_params(preset_1b().model, tp=1, pp=1, vpp=1) == [LLAMA_32_1B_PARAMS]
    # tp shards every matrix; pp gives each rank half the blocks and the tied head a copy
    assert sum(rank_params(preset_1b().model, tp=2, pp=1, vpp=1)) < LLAMA_32_1B_PARAMS
    first, last = rank_params(preset_1b().model, tp=1, pp=2, vpp=1)
    assert last == first + 2048  # the final norm
    assert first + last == LLAMA_32_1B_PARAMS + 128256 * 2048  # the tied copy of the embedding


def test_1b_over_a_small_budget_is_a_validation_error():
    cfg = preset_1b()
    cfg.launcher.gpu_mem_gb = 8
    problems = validate(cfg, 8)
    assert len(problems) == 1, problems
    est = estimate_memory(cfg, 8)
    assert f"estimated memory per GPU {est.total / GIB:.1f} GiB" in problems[0]
    assert "> 8.0 GiB (launcher.gpu_mem_gb=8)" in problems[0]
    for fix in ("parallel.tp=1", "parallel.pp=1", "parallel.zero=0", "train.micro_batch_size=4"):
        assert fix in problems[0], fix
    assert "raise parallel.zero=0 (up to 3)" in problems[0]
    cfg.launcher.gpu_mem_gb = 80  # an H100 holds it
    assert validate(cfg, 8) == []


def test_the_memory_fix_under_lora_stops_at_zero_2():
    """LoRA refuses ZeRO-3, so the over-budget message must not suggest it."""
    cfg = preset_1b()
    cfg.lora.rank, cfg.parallel.zero, cfg.launcher.gpu_mem_gb = 16, 1, 1
    problems = check_memory(cfg, 8)
    assert len(problems) == 1 and "raise parallel.zero=1 (up to 2)" in problems[0], problems
    cfg.parallel.zero = 2
    assert "parallel.zero" not in check_memory(cfg, 8)[0]


def test_estimate_moves_the_right_way():
    def total(world=8, micro=4, **par):
        cfg = preset_1b(micro=micro)
        for key, value in par.items():
            setattr(cfg.parallel, key, value)
        return estimate_memory(cfg, world)

    base = total()
    assert base.optimizer == 2 * base.params == 2 * LLAMA_32_1B_PARAMS * 4  # fp32 moments, zero=0
    zero1, zero2, zero3 = total(zero=1), total(zero=2), total(zero=3)
    assert zero1.optimizer == base.optimizer // 8 and zero1.grads == base.grads
    assert zero2.grads == base.grads // 8 and zero3.params == base.params // 8
    assert base.total > zero1.total > zero2.total > zero3.total
    assert total(tp=2).total < base.total and total(tp=2, sequence_parallel=True).total < total(tp=2).total
    assert total(pp=2).total < base.total
    assert total(micro=1).activations == pytest.approx(base.activations / 4, rel=1e-6)
    # gpipe keeps every micro-batch of the step alive, 1f1b at most pp of them
    assert total(pp=2, schedule="gpipe").activations > total(pp=2).activations


def test_no_budget_no_check():
    cfg = preset_1b()  # device=cpu, launcher.gpu_mem_gb=0: nothing to compare with
    assert check_memory(cfg, 8) == []


# (tp, pp, dp, zero, tied, master_weights) on 2 ranks: every rank compares its optimizer's bytes to the estimate.
MEMORY_CASES = [(1, 1, 2, 0, False, False), (1, 1, 2, 1, False, False), (1, 1, 2, 2, False, False),
                (1, 1, 2, 3, False, False), (2, 1, 1, 0, False, False), (1, 2, 1, 0, False, False),
                (1, 2, 1, 0, True, False), (1, 1, 2, 0, False, True), (1, 1, 2, 2, False, True),
                (1, 1, 2, 3, False, True)]
# the same with a mixture of experts (Qwen2-MoE-like: a shared expert and a dense block): every expert,
# the router and the shared expert's gate held, split over tp and pp, sharded by ZeRO
MOE_CASES = [(2, 1, 1, 0, False, False), (1, 2, 1, 0, False, False), (1, 1, 2, 2, False, True),
             (1, 1, 2, 3, False, False)]
MOE_SHAPE = dict(arch="qwen2_moe", n_experts=4, top_k=2, moe_ffn_dim=32, shared_expert_ffn_dim=64,
                 mlp_only_layers=[1])


def compare_memory_bytes(rank: int, world: int) -> None:
    failures = []
    for case in [(c, False) for c in MEMORY_CASES] + [(c, True) for c in MOE_CASES]:
        (tp, pp, dp, zero, tied, masters), moe = case
        cfg = small_config()
        cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.zero = tp, pp, dp, zero
        cfg.model.tie_embeddings = tied
        if moe:
            for key, value in MOE_SHAPE.items():
                setattr(cfg.model, key, value)
        if masters:
            cfg.precision, cfg.optim.master_weights = "bf16", True
        grid = ParallelGrid.build(tp=tp, pp=pp, dp=dp, device="cpu")
        model = build_model(RunParts(cfg, grid))
        _, opt, reducer = build_optimizer(model, cfg.optim, zero=zero, bucket_mb=cfg.parallel.bucket_mb, grid=grid,
                                          norm_params=model.norm_params() if pp > 1 else None)
        measured = opt.memory_bytes()
        est = estimate_ranks(cfg, world)[grid.pp_rank]
        for part in ("params", "grads", "optimizer"):
            # 5%: the flat buffers pad to a multiple of dp and the vocabulary to one of tp
            if measured[part] != pytest.approx(getattr(est, part), rel=0.05):
                failures.append(f"{case} pp rank {grid.pp_rank} {part}: measured "
                                f"{measured[part]} vs estimated {getattr(est, part)}")
        reducer.remove_hooks()
        del model, opt
    torch.distributed.barrier()
    assert not failures, "\n".join(failures)


def test_estimate_matches_measured_memory_bytes():
    spawn(2, compare_memory_bytes)
