"""Greedy decoding under expert parallelism: each dp rank decodes its own prompts (other counts,
lengths and stopping steps) while every forward exchanges tokens with the other ep rank. The ranks
keep in step (megaft.inference.generate._Lockstep) and each gets the single process's completions;
before, the rank that finished first left the other waiting in the experts' all-to-all."""
from __future__ import annotations

import pytest
import torch
from multirank import spawn

from megaft.inference.generate import greedy_generate
from megaft.parallel.grid import ParallelGrid
from megaft.training.model import build_model
from megaft.training.protocols import RunParts
from megaft.validation import resolve
from models.moe_fixture import make_hf_moe
from models.test_moe_training import moe_config

NEW = 6
# rank 0: two prompts of one length; rank 1: three lengths (more batches, so more forwards)
PROMPTS = [[[3, 5, 7], [4, 6, 8]], [[9, 2], [5, 5, 5, 5, 1], [7, 3, 2]]]


def _model(ckpt: str, grid: ParallelGrid, **layout):
    cfg = resolve(moe_config(ckpt, "", **layout))
    model = build_model(RunParts(cfg, grid))
    return model.eval()


def _ranks(rank: int, world: int, ckpt: str, want: list[list[list[int]]]) -> None:
    grid = ParallelGrid.build(tp=1, dp=2, pp=1, ep=2, device="cpu")
    model = _model(ckpt, grid, dp=2, ep=2)
    got = greedy_generate(model, PROMPTS[rank], max_new_tokens=NEW, eos_id=None, device=torch.device("cpu"))
    assert got == want[rank], (rank, got, want[rank])
    # an eos that ends one rank's rows at different steps from the other's
    eos = want[rank][0][2]
    got = greedy_generate(model, PROMPTS[rank], max_new_tokens=NEW, eos_id=eos, device=torch.device("cpu"))
    assert got == [row[:row.index(eos)] if eos in row else row for row in want[rank]]


@pytest.mark.exact
def test_ep2_ranks_decoding_different_prompts_equal_the_single_process(tmp_path):
    ckpt = str(tmp_path / "mixtral")
    make_hf_moe(ckpt, "mixtral")
    single = _model(ckpt, ParallelGrid.single())
    want = [greedy_generate(single, prompts, max_new_tokens=NEW, eos_id=None, device=torch.device("cpu"))
            for prompts in PROMPTS]
    assert all(len(row) == NEW for rows in want for row in rows)
    spawn(2, _ranks, ckpt, want)
