"""A preference objective (dpo) under activation recompute and under mixed precision, one
process, megaft-train's Trainer in process on the tiny checkpoints of the preference tests:

- model.recompute=selective|full changes no number: every step's loss, grad norm and TRL
  metrics equal recompute=none's bitwise (the Llama; and the Mixtral, whose aux loss and
  expert loads also count once: a recomputed block's replay in backward logs nothing);
- precision=bf16 and fp16 (autocast compute, fp32 weights; fp16 with its loss scaler) train:
  step 1 tracks fp32 within the 16-bit rounding, the losses are finite and move.
"""
from __future__ import annotations

import math
import os

import pytest
from models.hf_fixture import make_hf_llama
from models.moe_fixture import make_hf_moe
from train_cases import read_rows

from megaft.parallel.grid import ParallelGrid
from megaft.validation import resolve, validate
from pref.pref_train_cases import COMPARED, moe_of, pref_config, run, write_pairs

STEPS = 3


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pref_precision")
    ckpt, pairs = str(root / "ckpt"), str(root / "pairs.jsonl")
    make_hf_llama(ckpt, seed=1)
    make_hf_moe(moe_of(ckpt), "mixtral", seed=1, sliding_window=None)
    write_pairs(pairs)
    return ckpt, pairs, root


def _dpo(inputs, name: str, *, moe: bool = False, recompute: str = "none", precision: str = "fp32") -> list[dict]:
    """The metrics lines of STEPS dpo steps (4 pairs a step in 2 micro-batches) of one variant."""
    ckpt, pairs, root = inputs
    out = os.path.join(root, name)
    if not os.path.exists(os.path.join(out, "metrics.jsonl")):  # each variant once per module
        cfg = pref_config(moe_of(ckpt) if moe else ckpt, pairs, "dpo", steps=STEPS)
        cfg.model.recompute, cfg.precision = recompute, precision
        assert validate(cfg, 1) == []
        cfg = resolve(cfg)
        assert cfg.model.recompute == recompute  # kept over the checkpoint's config.json
        run(cfg, ParallelGrid.single(), out)
    rows = [r for r in read_rows(out) if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    return rows


def _numbers(rows: list[dict]) -> list[dict]:
    """What a step line says about the math: the loss, grad norm, TRL metrics and router terms."""
    return [{k: v for k, v in r.items() if k in COMPARED or k.startswith(("rewards/", "aux_loss", "z_loss", "moe/"))}
            for r in rows]


@pytest.mark.parametrize("moe", [False, True], ids=["llama", "mixtral"])
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_changes_no_number_under_dpo(inputs, moe, mode):
    base = _dpo(inputs, f"fp32_none_{moe}", moe=moe)
    got = _dpo(inputs, f"fp32_{mode}_{moe}", moe=moe, recompute=mode)
    assert _numbers(got) == _numbers(base)  # bitwise: the same floats in every line
    keys = set(_numbers(base)[0])
    assert {"loss", "grad_norm", "rewards/chosen", "rewards/margins", "logps/chosen"} <= keys
    if moe:
        assert "aux_loss" in keys
        assert len({r["aux_loss"] for r in base}) == STEPS  # the routing moved
    losses = [r["loss"] for r in base]
    assert len(set(losses)) == STEPS  # it trains: a curve, not one number repeated


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_tracks_fp32_under_dpo(inputs, precision):
    want = _dpo(inputs, "fp32_none_False")
    got = _dpo(inputs, f"{precision}_none_False", precision=precision)
    losses = [r["loss"] for r in got]
    assert all(math.isfinite(x) for x in losses) and all(math.isfinite(r["grad_norm"]) for r in got)
    assert len(set(losses)) == STEPS  # the losses move over the steps
    first, base = got[0], want[0]
    # step 1: the policy is its own reference, the loss ln 2 in any precision (both scored alike)
    assert first["loss"] == pytest.approx(base["loss"], rel=2e-2)
    # the log-probs (~-20 to -40 summed over the answer tokens) and the gradient carry the 16-bit
    # rounding (bf16: an 8-bit mantissa, ~0.4% per op; fp16 10 bits) but track fp32's
    for key in ("logps/chosen", "logps/rejected", "grad_norm"):
        assert first[key] == pytest.approx(base[key], rel=2e-2), key
    assert first["logps/chosen"] != base["logps/chosen"]  # 16-bit compute really ran
    # after two updates the run still follows fp32's (lr 1e-2: the rounding grows, not the math)
    assert got[-1]["loss"] == pytest.approx(want[-1]["loss"], rel=1e-1, abs=2e-2)
    if precision == "fp16":  # the loss scaler is on and, this short, never skipped a step
        assert all("loss_scale" in r for r in got) and got[-1].get("skipped_steps", 0) == 0
