"""megaft-plan on mixtures of experts: parallel.ep is searched (divisors of dp·cp that divide
model.n_experts), shown in the table and plan.json, and explained (plan.explain).

The models are published config.json files (tests/models/real_configs/, see SOURCES.md),
each alone in a folder as model.init_from: Mixtral-8x7B's shapes
(dolphin-2.5-mixtral-8x7b.json: 8 experts, top-2, 32 layers of dim 4096) and
Qwen3-30B-A3B (128 experts of width 768, top-8, 48 layers of dim 2048), both on two
8-GPU H100 nodes, seq 4096, global batch 128, bf16. data.path names a small JSONL file: the
planner never reads it, but megaft-train refuses ep > 1 without one (the generated task),
and so does the planner; validate() below does read it."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from megaft.config import Config, register_configs
from megaft.perf.hardware import GIB
from megaft.perf.memory import estimate_memory
from megaft.plan.app import run_plan, user_overrides  # importing it stores the megaft_plan primary config
from megaft.plan.report import COLUMNS, EP_COLUMNS, columns, explain_experts, format_experts
from megaft.plan.shape import planning_config
from megaft.plan.space import Layout, apply_layout, expert_degrees, search
from megaft.validation import validate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONF = os.path.join(ROOT, "conf")
REAL = os.path.join(ROOT, "tests", "models", "real_configs")
MIXTRAL, QWEN = "dolphin-2.5-mixtral-8x7b", "qwen3-30b-a3b"
register_configs()

MEMORY = "memory estimate over the budget"


def composed(overrides: list[str], name: str = "megaft_plan") -> Config:
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return OmegaConf.to_object(compose(name, overrides=overrides))


def plan_args(folder, model: str, nodes: int, data: bool = True) -> list[str]:
    """megaft-plan's overrides for `model`'s config.json alone in a folder (and a train file)."""
    ckpt = folder / model
    ckpt.mkdir()
    shutil.copy(os.path.join(REAL, f"{model}.json"), ckpt / "config.json")
    train = folder / "train.jsonl"  # in the generated task's alphabet: validate() reads it with its tokenizer
    train.write_text("".join(json.dumps({"text": f"{a}+{a}={2 * a}"}) + "\n" for a in range(4)))
    return [f"model.init_from={ckpt}", "cluster=h100", f"cluster.nodes={nodes}", "data.seq_len=4096",
            "model.max_seq_len=4096", "train.global_batch_size=128", "precision=bf16",
            *([f"data.path={train}"] if data else [])]


def planned(folder, model: str, nodes: int, data: bool = True):
    cfg = composed(plan_args(folder, model, nodes, data))
    shaped, problems = planning_config(cfg)
    assert problems == []
    return shaped, search(shaped, shaped.cluster, cfg.plan)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return planned(tmp_path_factory.mktemp("mixtral"), MIXTRAL, nodes=2)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return planned(tmp_path_factory.mktemp("qwen"), QWEN, nodes=2)


def best_at(result, ep: int):
    return next(c for c in result.ranked if c.layout.ep == ep)


def assert_fits_and_validates(shaped, result):
    """The top layout passes megaft-train's validate() (with the data file) and its memory estimate fits."""
    best, world = result.ranked[0], shaped.cluster.world_size
    assert validate(apply_layout(shaped, best.layout), world, gpu_budget=result.budget) == []
    assert estimate_memory(best.cfg, world).total <= result.budget[0]
    return best


def test_search_space_has_ep_for_moe_only(mixtral, qwen):
    shaped, result = mixtral
    assert shaped.model.n_experts == 8 and qwen[0].model.n_experts == 128
    # ep divides dp·cp and the experts: 16 replicas of 8 experts give ep 1, 2, 4, 8 (not 16)
    assert expert_degrees(shaped, 16) == [1, 2, 4, 8] and expert_degrees(qwen[0], 16) == [1, 2, 4, 8, 16]
    assert {c.layout.ep for c in result.ranked} == {1, 2, 4, 8}
    assert all(c.layout.dp * c.layout.cp % c.layout.ep == 0 for c in result.ranked)
    # a dense model keeps ep=1 alone, so its layouts (and its table) are those of before
    dense = dataclasses.replace(shaped, model=dataclasses.replace(shaped.model, n_experts=0))
    assert expert_degrees(dense, 16) == [1] and columns(False) == COLUMNS and columns(True) == EP_COLUMNS
    assert Layout(tp=1, pp=1, dp=8).overrides() == Layout(tp=1, pp=1, dp=8, ep=1).overrides()
    assert not any(o.startswith("parallel.ep") for o in Layout(tp=1, pp=1, dp=8).overrides())
    assert "parallel.ep=4" in Layout(tp=1, pp=1, dp=8, ep=4).overrides()


def test_mixtral_8x7b_on_two_nodes_picks_expert_parallelism(mixtral):
    """16 H100s: ZeRO-3 over all 16 with the 8 experts split over ep=4 (two experts per rank,
    all-to-alls within a node), full recompute, 4 sequences per micro-batch. At ep=1 the same
    layout does not fit, and the best layout that does is slower: it needs pp=8 and pays its
    bubble and the longer stages more than ep=4 pays in all-to-alls."""
    shaped, result = mixtral
    best = assert_fits_and_validates(shaped, result)
    lay = best.layout
    assert (lay.tp, lay.cp, lay.pp, lay.vpp, lay.dp, lay.ep, lay.zero, lay.micro_batch_size, lay.offload,
            lay.recompute) == (1, 1, 1, 1, 16, 4, 3, 4, "none", "full"), lay
    # 5.57 before the GEMM curve (issue 42), 5.04 with it; 5.40 with the elementwise kernels and the loss
    # priced by their bytes (megaft.perf.kernels_cost); 5.54 with the attention core by FlashAttention-2's
    # causal curve (megaft.perf.attention)
    assert best.cost.step_s == pytest.approx(5.54, abs=0.01)
    assert best.memory.total / GIB == pytest.approx(76.3, abs=0.1)  # 76.5 before the combine kept no fp32 copy
    assert 0 < best.cost.terms["ep_comm"] < 0.05 * best.cost.step_s
    # forcing ep=1: the same layout is over the budget ...
    ep1 = dataclasses.replace(lay, ep=1)
    assert result.rank_of(ep1) is None and result.reasons[ep1][0] == MEMORY
    assert estimate_memory(apply_layout(shaped, ep1), 16).total > result.budget[0] > best.memory.total
    # ... and the fastest ep=1 layout that fits is slower (pp=8 instead of the all-to-alls)
    dense_way = best_at(result, 1)
    assert dense_way.layout.pp == 8 and dense_way.cost.terms["ep_comm"] == 0
    assert dense_way.cost.step_s > best.cost.step_s + 0.1
    info = explain_experts(result, shaped, shaped.cluster)
    assert info["ep"] == 4 and info["ep_comm_s"] == best.cost.terms["ep_comm"]
    same = {e["ep"]: e for e in info["same_layout"]}
    assert same[1]["status"] == same[2]["status"] == "rejected" and same[1]["reason"] == MEMORY
    assert same[1]["memory_gib"] > same[2]["memory_gib"] > info["budget_gib"] > info["memory_gib"]
    assert same[8]["status"] == "valid" and same[8]["rank"] == 2  # ep=8: more all-to-all, less ZeRO-3 traffic
    text = format_experts(info)
    assert text.startswith("expert parallelism: ep=4 won") and "same layout at ep=1: rejected (95.2 GiB" in text


def test_qwen3_30b_a3b_on_two_nodes_keeps_ep_1(qwen):
    """Qwen3-30B-A3B sends each token to 8 experts of a 2048-wide model: its all-to-alls move
    twice Mixtral's bytes per token (top_k x dim: 8 x 2048 against 2 x 4096) for a third of
    its FLOPs per token (megaft.perf.counts.flops_per_token at seq 4096), so ep costs more
    than it buys. The winner, tp 2 x pp 2 x vpp 4 x dp 4 with ZeRO-2, fits at ep=1; ep would only
    save memory (the same layout at ep=2 fits with 14 GiB less) and add all-to-alls. The
    best ep > 1 layout (tp=1, ep=2) loses by less than its ep_comm: without the all-to-alls
    it would win, so they alone decide."""
    shaped, result = qwen
    best = assert_fits_and_validates(shaped, result)
    lay = best.layout
    assert (lay.tp, lay.cp, lay.pp, lay.vpp, lay.dp, lay.ep, lay.zero, lay.micro_batch_size, lay.offload,
            lay.recompute) == (2, 1, 2, 4, 4, 1, 2, 2, "none", "full"), lay
    # 2.18 s before the GEMM curve (issue 42), with tp 2 x pp 2; 2.03 s with it, at tp 1 x pp 4 (tp's
    # narrower GEMMs cost waves); 2.48 s with the loss priced by its bytes (megaft.perf.kernels_cost),
    # tp 2 x pp 2 again: the 151,936-wide logits' cross-entropy sits on the last pp stage, and tp splits it;
    # 2.70 s with the attention core by FlashAttention-2's causal curve (megaft.perf.attention)
    assert best.cost.step_s == pytest.approx(2.70, abs=0.01) and best.cost.terms["ep_comm"] == 0
    # the same layout at ep=2 fits with less memory: memory did not decide, the all-to-alls did
    ep2 = next(c for c in result.ranked if c.layout == dataclasses.replace(lay, ep=2))
    assert ep2.memory.total < best.memory.total - 10 * GIB
    assert ep2.cost.step_s - best.cost.step_s == pytest.approx(ep2.cost.terms["ep_comm"], rel=0.1)
    rival = next(c for c in result.ranked if c.layout.ep > 1)
    assert rival.layout.ep == 2 and rival.layout.tp == 1
    assert rival.cost.step_s > best.cost.step_s > rival.cost.step_s - rival.cost.terms["ep_comm"]
    # every ep > 1 loses, the more the wider the all-to-all
    slowest = [best_at(result, ep).cost.step_s for ep in (2, 4, 16)]
    assert best.cost.step_s < slowest[0] < slowest[1] < slowest[2]
    info = explain_experts(result, shaped, shaped.cluster)
    assert info["ep"] == 1 and [e["ep"] for e in info["same_layout"]] == [2, 4]
    assert all(e["status"] == "valid" and e["memory_gib"] < info["memory_gib"] for e in info["same_layout"])
    assert "same layout at ep=2: rank " in format_experts(info)


def test_ep_needs_a_data_file_as_megaft_train_does(tmp_path):
    """Without data.path megaft-train refuses ep > 1 (the generated task); the planner counts
    those layouts under that reason and picks among ep=1 (Mixtral-8x7B on one node: with a
    file ep=2 wins there, ZeRO-3 with CPU offload, 9 ms ahead of ep=4, which won by 8 ms before
    GEMMs were priced by shape, issue 42)."""
    (tmp_path / "task").mkdir()
    _, without = planned(tmp_path / "task", MIXTRAL, nodes=1, data=False)
    reason = "ep>1 with the generated task (no data.path)"
    assert without.rejected[reason] > 0 and "fix: train on a file (data.path=...)" in without.examples[reason]
    assert {c.layout.ep for c in without.ranked} == {1}
    (tmp_path / "file").mkdir()
    shaped, with_file = planned(tmp_path / "file", MIXTRAL, nodes=1)
    top = assert_fits_and_validates(shaped, with_file)
    assert (top.layout.ep, top.layout.dp, top.layout.zero, top.layout.offload) == (2, 8, 3, "cpu"), top.layout
    assert top.cost.step_s < without.ranked[0].cost.step_s


def test_cli_shows_ep_in_the_table_plan_json_and_explanation(tmp_path, capsys):
    args = plan_args(tmp_path, MIXTRAL, nodes=1) + ["plan.explain=true", "plan.top_k=3", "parallel.ep=8"]
    status, out = run_plan(composed(args), str(tmp_path / "run"), args)
    printed = capsys.readouterr().out
    assert status == 0
    header = next(line for line in printed.splitlines() if line.startswith("#"))
    assert header.split() == " ".join(EP_COLUMNS).split()
    assert "expert parallelism: ep=2 won" in printed and "same layout at ep=1:" in printed
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    top = plan["layouts"][0]
    assert top["ep"] == 2 and "parallel.ep=2" in top["overrides"] and "parallel.ep=8" not in top["overrides"]
    assert plan["model"]["n_experts"] == 8 and plan["model"]["top_k"] == 2
    assert plan["expert_parallelism"]["ep"] == 2 and "terms_s" in top and "ep_comm" in top["terms_s"]
    # the overrides are megaft-train's: composing them runs ep=2 (the command line's ep=8 is the layout's key)
    assert "parallel.ep=8" not in user_overrides(args)
    assert composed(top["overrides"], name="train").parallel.ep == 2
