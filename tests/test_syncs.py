"""Host syncs of a training step (issue 38): what a CUDA step would wait for, counted on CPU
(tests/syncs.py) and, on a GPU, under torch.cuda.set_sync_debug_mode.

Budgets of one forward and backward (`forward_backward`, every micro-batch of a step): a dense
model none; a mixture of experts one per MoE layer and micro-batch (the rows per expert, which
the grouped GEMM and the all-to-all split sizes need on the host, as in Megatron's
dispatcher), with expert parallelism and with an expert capacity too; the preference path
(DPO, its packed pairs with shared prompts) adds none. The whole step adds the scalars of its
metrics line (loss, grad norm, and the MoE statistics' one copy when there are MoE layers) and
the count of the batch's targets (on the host there: an overcount the counter cannot avoid).
"""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from models.hf_fixture import make_hf_llama
from models.moe_fixture import make_hf_moe
from multirank import spawn
from pref.pref_train_cases import pref_config, write_pairs
from syncs import SyncCounter
from train_cases import small_config

from megaft.parallel.grid import ParallelGrid
from megaft.training.loop import Trainer
from megaft.validation import resolve

LAYERS = 4


def moe_config(**moe):
    cfg = small_config(steps=4)  # 16 rows in micro-batches of 8: 2 micro-batches
    cfg.model = dataclasses.replace(cfg.model, arch="mixtral", n_experts=4, top_k=2, n_layers=LAYERS, moe_ffn_dim=64)
    for k, v in moe.items():
        setattr(cfg.moe, k, v)
    return resolve(cfg)


def step_syncs(cfg, grid: ParallelGrid, run_dir: str) -> tuple[int, int, int]:
    """(syncs of step 1's forward and backward, of all of step 1, micro-batches per step), after
    step 0 (the first step builds what later steps reuse)."""
    os.makedirs(run_dir, exist_ok=True)
    trainer = Trainer(cfg, grid, run_dir)
    trainer.train_step(0)
    step, fwd_bwd = trainer.parts.step, SyncCounter()
    inner = step.forward_backward

    def counted(batch, divisor):
        with fwd_bwd:
            return inner(batch, divisor)

    step.forward_backward = counted
    with SyncCounter() as whole:
        trainer.train_step(1)
    micro = cfg.train.global_batch_size // (cfg.train.micro_batch_size * grid.dp_size)
    return fwd_bwd.total, whole.total, micro


def test_a_dense_step_syncs_only_for_its_metrics(tmp_path):
    fwd_bwd, whole, _ = step_syncs(small_config(steps=4), ParallelGrid.single(), str(tmp_path))
    # the loss and the grad norm of the metrics line, and the batch's target count (a host tensor
    # there, which the counter cannot tell from a device tensor: an overcount)
    assert (fwd_bwd, whole) == (0, 3)


@pytest.mark.parametrize("moe", [{}, dict(capacity_factor=1.0), dict(capacity_factor=1.0, drop_policy="position")],
                         ids=["dropless", "capacity_probs", "capacity_position"])
def test_a_moe_step_syncs_once_per_layer_and_micro_batch(tmp_path, moe):
    fwd_bwd, whole, micro = step_syncs(moe_config(**moe), ParallelGrid.single(), str(tmp_path))
    assert micro == 2
    assert fwd_bwd == LAYERS * micro
    assert whole == LAYERS * micro + 4  # + the dense step's 3 and the router statistics' one copy


def ep_rank(rank: int, world: int, root: str) -> None:
    cfg = moe_config(capacity_factor=None)
    cfg.parallel.dp, cfg.parallel.ep = 2, 2
    cfg.train.micro_batch_size = 4  # 2 micro-batches on each dp rank
    grid = ParallelGrid.build(tp=1, dp=2, pp=1, ep=2, device="cpu")
    fwd_bwd, _, micro = step_syncs(cfg, grid, os.path.join(root, f"rank{rank}"))
    assert micro == 2
    assert fwd_bwd == LAYERS * micro, (rank, fwd_bwd)


def test_expert_parallel_dispatch_syncs_once_per_layer_and_micro_batch(tmp_path):
    spawn(2, ep_rank, str(tmp_path))


@pytest.fixture(scope="module")
def pref_inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("syncs_pref")
    make_hf_llama(str(root / "ckpt"), seed=1)
    make_hf_moe(str(root / "moe"), "mixtral", seed=3, sliding_window=None)
    write_pairs(str(root / "pairs.jsonl"))
    return root


@pytest.mark.parametrize("model, packed", [("ckpt", False), ("ckpt", True), ("moe", False), ("moe", True)],
                         ids=["dpo", "dpo_packed_shared", "dpo_moe", "dpo_moe_packed_shared"])
def test_the_preference_path_adds_no_sync(tmp_path, pref_inputs, model, packed):
    cfg = pref_config(str(pref_inputs / model), str(pref_inputs / "pairs.jsonl"), steps=4)
    if packed:
        cfg.data.packing, cfg.pref.share_prompt = "docs", True
    cfg = resolve(cfg)
    fwd_bwd, _, micro = step_syncs(cfg, ParallelGrid.single(), str(tmp_path))
    assert fwd_bwd == (cfg.model.n_layers * micro if model == "moe" else 0)


def test_the_counter_sees_each_kind_and_skips_host_copies():
    x = torch.arange(6)
    with SyncCounter() as c:
        x.sum().item(), x.nonzero(), x[x > 2], torch.bincount(x), x.tolist()
        host = x.cpu()
        host.sum().item(), host.tolist(), host[host > 2]  # host values: free
        moved = host.to("cpu")  # back to "the device": a device tensor again
        moved.sum().item()
    assert dict(c.counts) == {"item": 2, "nonzero": 1, "bool_index": 1, "bincount": 1, "tolist": 1, "cpu": 1}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_syncs_match_the_budgets(tmp_path):
    import warnings

    for name, cfg, budget in (("dense", small_config(steps=4), 0), ("moe", moe_config(), LAYERS * 2)):
        cfg.device = "cuda"
        trainer = Trainer(cfg, ParallelGrid.single(device="cuda"), str(tmp_path / name))
        trainer.train_step(0)
        batch = trainer.parts.data.batch(1)
        divisor = trainer.parts.optim.loss_divisor(batch.n_targets)
        torch.cuda.synchronize()  # the batch on its way: only the step's own syncs below
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                trainer.parts.step.forward_backward(batch, divisor)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [w for w in seen if "synchroniz" in str(w.message)]
        assert len(syncs) <= budget, (name, [str(w.message) for w in syncs])
