"""A mixture of experts under a preference objective: each micro-batch's token mask (its rows'
padding left out) reaches the router statistics through the forward's `router_valid=` on every
path PreferenceStep scores the policy by. test_pref_training checks the logits path against
TRL; here kernels.fused_linear_cross_entropy (the path through Decoder.blocks, never the whole
logits) routes the same tokens: step 1's aux loss and expert loads are the same numbers."""
from __future__ import annotations

from models.hf_fixture import make_hf_llama
from models.moe_fixture import make_hf_moe
from train_cases import read_rows

from megaft.parallel.grid import ParallelGrid
from megaft.validation import resolve, validate
from pref.pref_train_cases import moe_of, pref_config, run, write_pairs


def _first_step(ckpt: str, pairs: str, out: str, fused: bool) -> dict:
    cfg = pref_config(moe_of(ckpt), pairs, "dpo", steps=1)
    cfg.kernels.fused_linear_cross_entropy = fused
    assert validate(cfg, 1) == []
    run(resolve(cfg), ParallelGrid.single(), out)
    [row] = [r for r in read_rows(out) if "loss" in r]
    return row


def test_fused_head_counts_the_same_tokens_as_the_logits_path(tmp_path):
    ckpt, pairs = str(tmp_path / "ckpt"), str(tmp_path / "pairs.jsonl")
    make_hf_llama(ckpt, seed=1)
    make_hf_moe(moe_of(ckpt), "mixtral", seed=1, sliding_window=None)
    write_pairs(pairs)
    logits = _first_step(ckpt, pairs, str(tmp_path / "logits"), fused=False)
    fused = _first_step(ckpt, pairs, str(tmp_path / "fused"), fused=True)
    router = [k for k in logits if k == "aux_loss" or k.startswith("moe/")]
    assert "aux_loss" in router and any(k.endswith("tokens_max") for k in router)
    assert {k: fused[k] for k in router} == {k: logits[k] for k in router}
