"""megaft-commbench's expert-parallel all-to-all: sizes from the model as the cost model counts
them, balanced and skewed split sizes, the ep groups of the grid, the cost model's price.

One local launch of 2 gloo ranks at parallel.ep=2 (a tiny mixture of experts, bf16 rows)
measures twice in the same ranks: first as a user would (cluster=cpu, so the cost model
prices the all-to-all), then with no cluster and a hook that corrupts rank 1's routed
all-to-all result, which must be named. The rest is arithmetic on configs and documents.
"""
from __future__ import annotations

import copy
import csv
import dataclasses
import json
import os

import pytest
import torch

from megaft.commbench.app import check
from megaft.commbench.busbw import bus_factor, busbw_gbps
from megaft.commbench.ep import (
    balanced_splits,
    ep_plan,
    ep_problems,
    expert_popularity,
    off_rank,
    routed_splits,
)
from megaft.commbench.groups import ep_groups
from megaft.commbench.hooks import Hooks
from megaft.commbench.verdict import below_floor, verdict
from megaft.config import Config, compose_config
from megaft.config.cluster import ClusterConfig
from megaft.config.commbench import CommbenchConfig, EpCollective
from megaft.parallel.grid import ParallelGrid
from megaft.perf.counts import a2a_bytes

TOKENS, TOP_K, DIM, EXPERTS = 2 * 16, 2, 64, 4  # micro-batch 2 x seq 16; bf16 rows of 64


def moe_config(ep: int = 2, nproc: int = 2, precision: str = "bf16") -> Config:
    cfg = Config()
    cfg.device, cfg.precision = "cpu", precision
    cfg.launcher.nproc = nproc
    cfg.parallel.tp, cfg.parallel.dp, cfg.parallel.ep = 1, None, ep
    cfg.model = dataclasses.replace(cfg.model, arch="mixtral", n_experts=EXPERTS, top_k=TOP_K, dim=DIM)
    cfg.train.micro_batch_size, cfg.data.seq_len = 2, 16
    cfg.commbench = CommbenchConfig(collectives=["all_to_all"], min_bytes=8192, max_bytes=8192, warmup=1,
                                    repeats=3)
    return cfg


def test_sizes_are_the_cost_models_count():
    plan = ep_plan(moe_config())
    assert (plan.tokens, plan.top_k, plan.dim, plan.elem_bytes, plan.ep) == (TOKENS, TOP_K, DIM, 2, 2)
    assert plan.rows == 64 and plan.row_bytes == 128 and plan.send_bytes == 8192
    # each rank sends (ep-1)/ep of its buffer to the others, once to dispatch and once to combine
    assert 2 * plan.send_bytes * (plan.ep - 1) / plan.ep == a2a_bytes(TOKENS, TOP_K, DIM, 2, 2) == plan.a2a_bytes
    fp32 = ep_plan(moe_config(precision="fp32"))
    assert fp32.elem_bytes == 4 and fp32.send_bytes == 2 * plan.send_bytes  # the compute dtype's bytes
    cfg = moe_config(ep=4, nproc=8)
    cfg.parallel.cp = 2  # a rank holds seq_len / cp tokens of each row
    four = ep_plan(cfg)
    assert four.tokens == TOKENS // 2 and four.a2a_bytes == 2 * four.send_bytes * 3 / 4
    cfg = moe_config()
    cfg.model.dim = 63  # odd bf16 rows travel as whole float32 words: 126 bytes sent as 128
    odd = ep_plan(cfg)
    assert odd.row_bytes == 126 and odd.row_elems == 32 and odd.send_bytes == 64 * 128
    assert ep_plan(moe_config(ep=1)) is None
    # the all-to-all's bus bandwidth rule: (n-1)/n of the send buffer leaves each rank
    assert bus_factor("ep_all_to_all", 2) == 0.5 and bus_factor("ep_all_to_all_routed", 8) == 7 / 8
    assert busbw_gbps("ep_all_to_all_routed", 8192, 1e-6, 4) == pytest.approx(8.192 * 0.75)


def test_balanced_and_routed_splits():
    assert balanced_splits(64, 2) == [[32, 32], [32, 32]]
    assert balanced_splits(10, 4) == [[3, 3, 2, 2]] * 4  # the remainder to the first ranks
    routed = routed_splits(64, EXPERTS, 2)
    assert routed == routed_splits(64, EXPERTS, 2)  # seeded: every rank computes the same matrix
    assert all(sum(row) == 64 for row in routed)  # every rank still sends all its tokens' rows...
    sent, received = off_rank(routed)
    assert routed != balanced_splits(64, 2) and sent[0] != sent[1]  # ...but not as many over the network
    assert sent == [routed[0][1], routed[1][0]] and received == [routed[1][0], routed[0][1]]
    weights = expert_popularity(8)
    assert sorted(weights.tolist(), reverse=True) == pytest.approx([(1 + p) ** -0.5 for p in range(8)])
    # with one expert per rank, the skew shows: the busiest of 8 ranks receives well above the mean
    wide = routed_splits(4096, 8, 8)
    incoming = [sum(wide[s][d] for s in range(8)) for d in range(8)]
    assert all(sum(row) == 4096 for row in wide) and max(incoming) > 1.5 * 4096 and min(incoming) < 4096
    assert routed_splits(64, EXPERTS, 2, seed=1) != routed  # the seed matters


def test_ep_groups_are_the_grids():
    def grid(**sizes) -> ParallelGrid:
        return ParallelGrid(rank=0, device=torch.device("cpu"), backend="gloo", **sizes)

    # consecutive dp replicas of each tp position: ranks tp apart
    assert ep_groups(grid(tp_size=2, dp_size=2, pp_size=1, ep_size=2)) == [[0, 2], [1, 3]]
    assert ep_groups(grid(tp_size=1, dp_size=4, pp_size=1, ep_size=2)) == [[0, 1], [2, 3]]
    # dp x cp replicas, dp major: ep=2 pairs the cp ranks of one dp rank
    assert ep_groups(grid(tp_size=1, cp_size=2, dp_size=2, pp_size=1, ep_size=2)) == [[0, 1], [2, 3]]
    assert ep_groups(grid(tp_size=1, dp_size=2, pp_size=2, ep_size=2)) == [[0, 1], [2, 3]]
    assert ep_groups(grid(tp_size=2, dp_size=2, pp_size=1)) == []


def test_checks_need_a_mixture_of_experts_to_size():
    assert ep_problems(moe_config()) == [] and check(moe_config(), 2, local=False) == []
    dense = moe_config()
    dense.model.n_experts = 0
    [problem] = check(dense, 2, local=False)
    assert problem.startswith("parallel.ep=2 splits the experts of a mixture of experts, and model.arch=mixtral is "
                              "dense")
    uneven = moe_config(ep=4, nproc=4)
    uneven.model.n_experts = 6
    assert ep_problems(uneven) == ["parallel.ep=4 does not divide model.n_experts=6: each ep rank holds "
                                   "n_experts/ep experts; fix: parallel.ep among the divisors of 6"]
    missing = moe_config()
    missing.model.init_from = "/nonexistent/mixtral"
    assert ep_problems(missing)[0].startswith("model.init_from='/nonexistent/mixtral': ")
    dense.parallel.ep = 1
    assert ep_problems(dense) == []  # a dense model without ep: nothing to size


# ---- the 2-rank run ------------------------------------------------------------------------------

def corrupt_routed(collective: str, rank: int, out: torch.Tensor) -> None:
    if collective == "ep_all_to_all_routed" and rank == 1:
        out.view(-1)[3] += 1.0


def no_cluster(cfg: Config) -> Config:
    out = copy.deepcopy(cfg)
    out.cluster = ClusterConfig()
    return out


def two_phase_worker(local_rank: int, cfg: Config, run_dir: str, nproc: int, init_file: str) -> None:
    from megaft.commbench.run import local_worker

    local_worker(local_rank, cfg, run_dir, nproc, init_file)
    local_worker(local_rank, no_cluster(cfg), os.path.join(run_dir, "faulty"), nproc, init_file + ".faulty",
                 hooks=Hooks(corrupt=corrupt_routed))


def test_two_ranks_at_ep2_measure_the_dispatch_all_to_all(tmp_path, capsys):
    from megaft.commbench.app import run

    cfg = moe_config()
    cfg.cluster = compose_config(["cluster=cpu"]).cluster
    status = run(cfg, str(tmp_path), worker=two_phase_worker)
    out = capsys.readouterr().out
    assert status == 0 and "megaft-commbench: PASS" in out, out

    doc = json.loads((tmp_path / "commbench.json").read_text())
    assert doc["grid"] == {"tp": 1, "cp": 1, "dp": 2, "pp": 1, "ep": 2}
    scopes = {s["name"]: s for s in doc["scopes"]}
    assert scopes["ep"]["groups"] == [[0, 1]] and scopes["ep"]["same_as"] == "intra_node"
    ep = doc["ep"]
    assert (ep["tokens"], ep["top_k"], ep["dim"], ep["elem_bytes"], ep["send_bytes"]) == (TOKENS, TOP_K, DIM, 2, 8192)
    balanced, routed = ep["splits"]["ep_all_to_all"], ep["splits"]["ep_all_to_all_routed"]
    assert balanced == [[32, 32], [32, 32]] and routed == routed_splits(64, EXPERTS, 2) != balanced

    # the ep rows: measured although intra_node has the same group, at the model's size, checked
    rows = {r["collective"]: r for r in doc["results"] if r["scope"] == "ep"}
    assert list(rows) == [c.value for c in EpCollective]
    assert [(r["scope"], r["collective"]) for r in doc["results"]] == [
        ("intra_node", "all_to_all"), ("ep", "ep_all_to_all"), ("ep", "ep_all_to_all_routed")]
    sent, received = off_rank(routed)
    for name, splits, most_sent, most_received in (("ep_all_to_all", balanced, 32, 32),
                                                   ("ep_all_to_all_routed", routed, max(sent), max(received))):
        r = rows[name]
        assert r["correct"] and r["error"] is None and r["ranks"] == 2 and r["groups"] == 1, r
        assert r["bytes"] == TOKENS * TOP_K * DIM * 2 == 8192 and r["splits"] == splits
        assert (r["sent_bytes"], r["recv_bytes"]) == (most_sent * 128, most_received * 128)
        assert r["a2a_bytes"] == a2a_bytes(TOKENS, TOP_K, DIM, 2, 2) == 2 * r["bytes"] * (2 - 1) / 2
        assert r["algbw_gbps"] == pytest.approx(r["bytes"] / r["time_s"] / 1e9)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] / 2)  # (ep-1)/ep of the buffer leaves
        # cluster=cpu: ep=2 fits a node of 2, so NVLink's (loopback's) 5 GB/s x 0.5 and one 30 us step
        assert r["model_time_s"] == pytest.approx(4096 / (5e9 * 0.5) + 30e-6)
        assert r["model_ratio"] == pytest.approx(r["time_s"] / r["model_time_s"])
    assert rows["ep_all_to_all_routed"]["sent_bytes"] > rows["ep_all_to_all"]["sent_bytes"]  # a rank sends more
    assert ep["model"]["time_s"] == rows["ep_all_to_all"]["model_time_s"]
    assert "cluster=cpu" in ep["model"]["note"]

    # the table and the CSV have them; the floor of check mode does not apply to them
    assert "float32; grid tp=1 cp=1 dp=2 pp=1 ep=2\n" in out
    assert "ep: the same groups as intra_node (within a node), measured there; its own rows below" in out
    assert "ep_all_to_all_routed" in out and f"rows [source][destination] {routed}" in out
    assert f"cost model: {rows['ep_all_to_all']['model_time_s'] * 1e6:.1f} us per all-to-all" in out
    with open(tmp_path / "commbench.csv") as f:
        lines = [r for r in csv.DictReader(f) if r["scope"] == "ep"]
    assert [(r["collective"], int(r["bytes"]), r["correct"]) for r in lines] == [
        ("ep_all_to_all", 8192, "True"), ("ep_all_to_all_routed", 8192, "True")]
    assert float(lines[1]["model_time_s"]) == pytest.approx(rows["ep_all_to_all"]["model_time_s"])
    assert (tmp_path / "commbench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.split(" over ")[0] for p in below_floor(doc, 1e6)] == ["all_to_all"]

    # the faulty phase: no cluster, so no price; rank 1's routed result corrupted, so named and failed
    bad = json.loads((tmp_path / "faulty" / "commbench.json").read_text())
    rows = {r["collective"]: r for r in bad["results"] if r["scope"] == "ep"}
    assert rows["ep_all_to_all"]["correct"] and rows["ep_all_to_all"]["model_time_s"] is None
    assert bad["ep"]["model"]["time_s"] is None and "no cluster= preset" in bad["ep"]["model"]["note"]
    routed_row = rows["ep_all_to_all_routed"]
    assert not routed_row["correct"] and routed_row["busbw_gbps"] is None and routed_row["model_ratio"] is None
    words = (routed[0][1] + routed[1][1]) * DIM * 2 // 4  # what rank 1 receives
    assert routed_row["error"].startswith(f"rank 1: iteration 0: 1 of {words} elements wrong, first at 3")
    status, problems = verdict(bad, CommbenchConfig())
    assert status == 1 and problems == [f"ep_all_to_all_routed over ep at 8 KiB returned a wrong result: "
                                        f"{routed_row['error']}"]


def test_four_ranks_tp2_run_two_ep_groups_tp_apart(tmp_path, capsys):
    """tp=2 dp=2 ep=2: the ep groups are [0, 2] and [1, 3] (the dp groups), both at once;
    rank 2 is the second of its group, so the splits are read by group rank. With
    cluster=cpu (2 ranks a node) a group tp=2 apart spans nodes: the cost model prices the
    rows over the 10 GbE link."""
    from megaft.commbench.app import run

    cfg = moe_config(nproc=4)
    cfg.parallel.tp, cfg.parallel.dp = 2, 2
    cfg.cluster = compose_config(["cluster=cpu"]).cluster
    cfg.commbench = dataclasses.replace(cfg.commbench, repeats=2, plot=False)
    assert run(cfg, str(tmp_path)) == 0, capsys.readouterr().out
    doc = json.loads((tmp_path / "commbench.json").read_text())
    scopes = {s["name"]: s for s in doc["scopes"]}
    assert scopes["ep"]["groups"] == [[0, 2], [1, 3]] and scopes["ep"]["same_as"] == "dp"
    rows = [r for r in doc["results"] if r["scope"] == "ep"]
    assert [r["collective"] for r in rows] == ["ep_all_to_all", "ep_all_to_all_routed"]
    for r in rows:
        assert r["correct"] and r["groups"] == 2 and r["ranks"] == 2 and r["bytes"] == 8192, r
        assert r["slowest_group"] in ([0, 2], [1, 3])
        assert r["model_time_s"] == pytest.approx(4096 / (1.25e9 * 0.5) + 50e-6)
    assert rows[1]["splits"] == routed_splits(64, EXPERTS, 2)
