"""benchmarks/preference.py on a tiny model and 8 pairs: its agreement check passes for
megaft and both TRL variants (step 1 ln 2 and its grad norm, the next loss, within 1e-4),
catches TRL run with another beta (step 1's grad norm scales with it), and its report has
every field. Seconds; no timing is asserted."""
import dataclasses
import json
import math

import pytest

from benchmarks import preference as bench

# TRL 1.16 calls transformers 5's renamed gradient-checkpointing methods by their old names
pytestmark = pytest.mark.filterwarnings("ignore:.*gradient_checkpointing.*:FutureWarning")

TINY = bench.Sizes(hidden=32, layers=1, heads=2, kv_heads=1, intermediate=48, vocab=96, pairs=8, prompt=(3, 9),
                   answer=(2, 8))
SETTINGS = bench.Settings(batch=4, micro=2, beta=0.5, lr=1e-2)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("pref_bench"))
    bench.quiet()
    inputs = bench.write_inputs(root, TINY)
    order = bench.megaft_order(*inputs, SETTINGS, 2, root)
    return inputs, order, root


def test_inputs(setup):
    (ckpt, pairs, seq_len), order, _ = setup
    records = [json.loads(line) for line in open(pairs)]
    assert len(records) == 8 and sorted(order) == list(range(8))  # one epoch: every pair once
    longest = max(len(r["prompt"]) + 1 + max(len(r["chosen"]), len(r["rejected"])) for r in records)
    assert longest <= seq_len < longest + 8
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{ckpt}/tokenizer.json")
    assert tok.encode("ab<eos>", add_special_tokens=False).ids == [tok.token_to_id("a"), tok.token_to_id("b"), 1]


def test_agreement_passes_then_catches_a_wrong_beta_and_reports(setup):
    inputs, order, root = setup
    turns, bad = bench.agreement(inputs, order, SETTINGS, 2, root)
    assert bad == [], bad
    for t in turns.values():
        assert abs(t.losses[0] - math.log(2)) < 1e-6 and abs(t.losses[1] - t.losses[0]) > 1e-4  # it moved
    # megaft crops each micro-batch to its longest row as TRL pads it; TRL online counts its reference twice
    assert turns["megaft"].tokens == turns["trl-precomp"].tokens
    assert turns["trl"].tokens == [2 * n for n in turns["megaft"].tokens]
    # packed rows hold fewer tokens (less padding), shared prompts fewer still (each prompt once)
    for step in range(2):
        assert turns["megaft-shared"].tokens[step] < turns["megaft-packed"].tokens[step] <= turns["megaft"].tokens[step]
    assert turns["megaft"].reference_s > 0 and turns["trl-precomp"].reference_s > 0 and turns["trl"].reference_s is None

    wrong = bench.run_turn("trl", inputs, order, dataclasses.replace(SETTINGS, beta=0.25), 1, root)
    bad = bench.disagreements({"megaft": turns["megaft"], "trl": wrong}, 1)
    assert len(bad) == 1 and bad[0].startswith("trl step 1 grad_norm"), bad  # step 1: ln 2 at any beta

    rows = bench.report({v: [t] for v, t in turns.items()}, SETTINGS.batch)
    assert list(rows) == list(bench.VARIANTS) and rows["trl"]["vs_trl"] == 1.0
    for r in rows.values():
        assert {"step_ms", "p20_ms", "p80_ms", "pair_ms", "vs_trl", "tokens_per_step", "reference_s",
                "reference_tokens", "build_s"} <= set(r)
        assert r["p20_ms"] <= r["step_ms"] <= r["p80_ms"] and r["pair_ms"] == r["step_ms"] / SETTINGS.batch
