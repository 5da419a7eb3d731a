"""megaft-commbench: nccl-tests' bandwidth arithmetic, exact result checks, slow links, check mode.

One local launch of 2 gloo ranks (megaft.commbench.app.run, as the console script runs it)
measures twice in the same ranks: first as a user would (every collective at 3 sizes, the
real host), then with test hooks that pretend each rank is its own node, corrupt rank 1's
all-reduce result and delay rank 1's sends, so the wrong result and the slow link must be
named. Everything else is pure arithmetic on numbers or documents.
"""
from __future__ import annotations

import copy
import csv
import dataclasses
import functools
import json
import os
import subprocess
import sys

import pytest
import torch

from megaft.commbench.busbw import algbw_gbps, bus_factor, busbw_gbps, elements
from megaft.commbench.groups import grid_groups, node_groups, spans
from megaft.commbench.hooks import Hooks
from megaft.commbench.measure import mismatch
from megaft.commbench.pairs import slow_pairs
from megaft.commbench.verdict import below_floor, slow_links, verdict
from megaft.config import Config
from megaft.config.commbench import GIB, MIB, Collective, CommbenchConfig, check_commbench, message_sizes
from megaft.parallel.grid import ParallelGrid

SIZES = [8192, 16384, 32768]
DELAY_S = 0.1  # per send of rank 1 in the faulty phase: >= 100x a 64 KiB loopback send


# nccl-tests (src/*.cu, *GetBw): busBw = baseBw * factor, baseBw = size / time, where size is
# count*typesize for all_reduce/broadcast/sendrecv and count*typesize*nranks (count = per-rank
# chunk) for reduce_scatter/all_gather/alltoall.
NCCL_TESTS_FACTOR = {
    "all_reduce": lambda n: 2.0 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "send_recv": lambda n: 1.0,
}


@pytest.mark.parametrize("n", [2, 3, 4, 8, 512])
def test_bus_bandwidth_matches_nccl_tests(n):
    assert set(NCCL_TESTS_FACTOR) == set(Collective)
    for op, factor in NCCL_TESTS_FACTOR.items():
        assert bus_factor(op, n) == pytest.approx(factor(n), rel=1e-12)
        # 1 GiB in 10 ms: algbw 107.37 GB/s (1e9 bytes, nccl-tests' unit), busbw = algbw * factor
        assert algbw_gbps(GIB, 0.01) == pytest.approx(107.374182, rel=1e-6)
        assert busbw_gbps(op, GIB, 0.01, n) == pytest.approx(107.374182 * factor(n), rel=1e-6)
    assert bus_factor("all_reduce", 8) == 1.75 and bus_factor("all_gather", 8) == 0.875
    # chunked collectives round their float32 count down to a multiple of n, as nccl-tests does
    assert elements("reduce_scatter", 8192, 3) == 2046 and elements("all_reduce", 8192, 3) == 2048
    assert elements("all_to_all", 4, 4) == 4  # never below one element per chunk


def test_sizes_and_validation():
    cfg = CommbenchConfig()
    assert message_sizes(cfg, "cpu") == [8192 * 2 ** i for i in range(10)]  # 8 KiB .. 4 MiB on gloo
    assert message_sizes(cfg, "cuda")[-1] == GIB and len(message_sizes(cfg, "cuda")) == 18
    assert check_commbench(cfg, "cpu") == []
    bad = CommbenchConfig(collectives=["all_reduce", "allreduce"], min_bytes=8 * MIB, repeats=0, slow_fraction=1.5)
    problems = check_commbench(bad, "cpu")
    assert len(problems) == 4, problems
    assert any("allreduce" in p for p in problems) and any("min_bytes=8388608 > the largest" in p for p in problems)


def test_mismatch_names_the_first_wrong_element():
    expected = torch.arange(10.0)
    assert mismatch(expected.clone(), expected) is None
    out = expected.clone()
    out[7] = -1.0
    assert mismatch(out, expected) == "1 of 10 elements wrong, first at 7: got -1, expected 7"


def _doc(matrix: dict, results: list | None = None) -> dict:
    return {"results": results or [], "scopes": [{"name": "inter_node", "spans": "across nodes"}],
            "pairs": {"matrix": [{"src": a, "dst": b, "gbps": v, "correct": True, "error": None}
                                 for (a, b), v in matrix.items()]}}


def test_slow_pair_is_named_with_hosts_and_ratio():
    hosts = ["a", "b", "c", "d"]
    matrix = {(x, y): 10.0 + 0.1 * (i % 3) for i, (x, y) in enumerate((x, y) for x in hosts for y in hosts if x != y)}
    matrix[("c", "a")] = 2.0  # one direction of one link is bad
    median, slow = slow_pairs(matrix, 0.5)
    assert median == pytest.approx(10.1)
    assert [(s["src"], s["dst"]) for s in slow] == [("c", "a")]
    assert slow[0]["ratio"] == pytest.approx(2.0 / 10.1)
    assert slow_pairs(matrix, 0.15)[1] == []  # 0.198x is above a 0.15 fraction
    assert slow_pairs({}, 0.5) == (None, [])
    status, problems = verdict(_doc(matrix), CommbenchConfig(check=True))
    assert status == 1 and problems == ["slow link c -> a: 2 GB/s, 0.20x the median pair bandwidth 10.1 GB/s "
                                        "(< commbench.slow_fraction=0.5)"]
    assert verdict(_doc(matrix), CommbenchConfig(check=False)) == (0, [])  # without check: reported, not failed
    assert slow_links(_doc({k: 10.0 for k in matrix}), 0.5) == []


def test_floor_applies_to_the_largest_size():
    rows = [{"scope": "inter_node", "collective": "all_reduce", "bytes": b, "ranks": 8, "busbw_gbps": bw,
             "correct": True} for b, bw in ((MIB, 1.0), (GIB, 90.0))]
    assert below_floor(_doc({}, rows), 50.0) == []  # 1 MiB is latency-bound; 1 GiB is what counts
    assert below_floor(_doc({}, rows), 100.0) == [
        "all_reduce over inter_node (8 ranks across nodes): bus bandwidth 90 GB/s at 1 GiB < "
        "commbench.min_busbw_gbps=100"]


def test_groups_from_hosts_and_the_grid():
    # 2 hosts x 2 ranks, tp=2 dp=2: tp groups stay in a host (= intra_node), dp groups cross (= inter_node).
    hosts = ["a", "a", "b", "b"]
    intra, inter = node_groups(hosts)
    assert intra == [[0, 1], [2, 3]] and inter == [[0, 2], [1, 3]]
    axes = grid_groups(ParallelGrid(tp_size=2, dp_size=2, pp_size=1, rank=0, device=torch.device("cpu"),
                                    backend="gloo"))
    assert axes == {"tp": [[0, 1], [2, 3]], "cp": [[0], [1], [2], [3]], "dp": [[0, 2], [1, 3]],
                    "pp": [[0], [1], [2], [3]]}
    assert spans(axes["tp"], hosts) == "within a node" and spans(axes["dp"], hosts) == "across nodes"
    assert spans([[0, 1], [1, 2]], hosts) == "mixed"
    # cp sits between tp and dp in megaft's rank order: tp=2 cp=2 dp=2 on 8 ranks
    axes = grid_groups(ParallelGrid(tp_size=2, cp_size=2, dp_size=2, pp_size=1, rank=0, device=torch.device("cpu"),
                                    backend="gloo"))
    assert axes["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]] and axes["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert axes["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]] and axes["pp"] == [[r] for r in range(8)]
    # uneven hosts: the third rank of host a has no partner across nodes
    assert node_groups(["a", "a", "a", "b"]) == ([[0, 1, 2]], [[0, 3]])
    assert node_groups(["a", "b"]) == ([], [[0, 1]]) and node_groups(["a", "a"]) == ([[0, 1]], [])


# ---- the 2-rank run ------------------------------------------------------------------------------

def fake_host(rank: int) -> str:
    return f"node{rank}"


def corrupt_all_reduce(collective: str, rank: int, out: torch.Tensor) -> None:
    if collective == "all_reduce" and rank == 1:
        out.view(-1)[5] += 1.0


def slow_sends_of_rank_1(src: int, dst: int) -> float:
    return DELAY_S if src == 1 else 0.0


def faulty_config(cfg: Config) -> Config:
    out = copy.deepcopy(cfg)
    out.commbench = dataclasses.replace(out.commbench, collectives=["all_reduce"], max_bytes=SIZES[0])
    return out


def two_phase_worker(local_rank: int, cfg: Config, run_dir: str, nproc: int, init_file: str) -> None:
    """The real rank body twice: as a user runs it, then with every fault hook."""
    from megaft.commbench.run import local_worker

    local_worker(local_rank, cfg, run_dir, nproc, init_file)
    hooks = Hooks(hostname=fake_host, corrupt=corrupt_all_reduce, delay_send=slow_sends_of_rank_1)
    local_worker(local_rank, faulty_config(cfg), os.path.join(run_dir, "faulty"), nproc, init_file + ".faulty",
                 hooks=hooks)


def bench_config() -> Config:
    cfg = Config()
    cfg.device = "cpu"
    cfg.launcher.nproc = 2
    cfg.parallel.tp, cfg.parallel.dp = 1, None  # dp=2: the dp group is the host's two ranks
    cfg.commbench = CommbenchConfig(min_bytes=SIZES[0], max_bytes=SIZES[-1], warmup=1, repeats=3,
                                    pair_bytes=64 * 1024)
    return cfg


def test_two_rank_run_checks_results_names_faults_and_gates_check_mode(tmp_path, capsys):
    from megaft.commbench.app import run

    cfg = bench_config()
    status = run(cfg, str(tmp_path), worker=functools.partial(two_phase_worker))
    out = capsys.readouterr().out
    assert status == 0 and "megaft-commbench: PASS" in out, out
    assert "intra_node: 1 group of 2 ranks, within a node" in out
    assert "inter_node: none (all 2 ranks are on one host" in out

    # The three files, parseable.
    doc = json.loads((tmp_path / "commbench.json").read_text())
    assert doc["schema"] == "megaft.commbench/1" and doc["world_size"] == 2 and doc["backend"] == "gloo"
    with open(tmp_path / "commbench.csv") as f:
        csv_rows = list(csv.DictReader(f))
    assert (tmp_path / "commbench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    scopes = {s["name"]: s for s in doc["scopes"]}
    assert scopes["intra_node"]["groups"] == [[0, 1]] and scopes["intra_node"]["spans"] == "within a node"
    assert scopes["inter_node"]["groups"] == [] and "one host" in scopes["inter_node"]["note"]
    assert scopes["dp"]["same_as"] == "intra_node" and scopes["tp"]["note"].startswith("parallel.tp=1")
    assert doc["pairs"]["matrix"] == [] and "one host" in doc["pairs"]["note"]

    # Every collective at every size, checked, with nccl-tests' arithmetic.
    rows = doc["results"]
    assert [(r["collective"], r["bytes"]) for r in rows] == [(c.value, s) for c in Collective for s in SIZES]
    assert len(csv_rows) == len(rows) and {r["scope"] for r in csv_rows} == {"intra_node"}
    for r in rows:
        assert r["correct"] and r["error"] is None and r["ranks"] == 2, r
        assert r["time_p20_s"] <= r["time_s"] <= r["time_p80_s"]
        assert r["algbw_gbps"] == pytest.approx(r["bytes"] / r["time_s"] / 1e9)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * NCCL_TESTS_FACTOR[r["collective"]](2))

    # Check mode: a reachable floor passes; an absurd one fails naming every collective.
    assert verdict(doc, CommbenchConfig(check=True, min_busbw_gbps=1e-6)) == (0, [])
    status, problems = verdict(doc, CommbenchConfig(check=True, min_busbw_gbps=1e6))
    assert status == 1 and len(problems) == len(Collective)
    assert all(any(p.startswith(f"{c} over intra_node (2 ranks within a node): bus bandwidth ") and "at 32 KiB" in p
                   for p in problems) for c in Collective), problems

    # The faulty phase: two "nodes", rank 1's all-reduce result corrupted, rank 1's sends slowed.
    bad = json.loads((tmp_path / "faulty" / "commbench.json").read_text())
    assert bad["hosts"] == {"node0": [0], "node1": [1]}
    scopes = {s["name"]: s for s in bad["scopes"]}
    assert scopes["inter_node"]["groups"] == [[0, 1]] and scopes["inter_node"]["spans"] == "across nodes"
    assert scopes["dp"]["same_as"] == "inter_node" and scopes["intra_node"]["groups"] == []
    [row] = bad["results"]
    assert not row["correct"] and row["busbw_gbps"] is None, row  # a wrong all-reduce is a failure, not a number
    assert row["error"].startswith("rank 1: iteration 0: 1 of 2048 elements wrong, first at 5")
    assert {(m["src"], m["dst"]) for m in bad["pairs"]["matrix"]} == {("node0", "node1"), ("node1", "node0")}
    assert [(s["src"], s["dst"]) for s in bad["pairs"]["slow"]] == [("node1", "node0")]
    assert bad["pairs"]["slow"][0]["ratio"] < 0.5
    status, problems = verdict(bad, CommbenchConfig(check=True))
    assert status == 1 and problems[0].startswith("all_reduce over inter_node at 8 KiB returned a wrong result")
    assert any(p.startswith("slow link node1 -> node0: ") for p in problems), problems
    status, problems = verdict(bad, CommbenchConfig(check=False))
    assert status == 1 and len(problems) == 1  # wrong results fail without check mode; slow links do not


def two_hosts(rank: int) -> str:
    return "hostA" if rank < 2 else "hostB"


def slow_sends_of_rank_2(src: int, dst: int) -> float:
    return DELAY_S if src == 2 else 0.0


def four_rank_worker(local_rank: int, cfg: Config, run_dir: str, nproc: int, init_file: str) -> None:
    """4 ranks, tp=2 dp=2: on the real host, then as 2 hosts of 2 ranks with hostB's sends slowed."""
    from megaft.commbench.run import local_worker

    local_worker(local_rank, cfg, run_dir, nproc, init_file)
    local_worker(local_rank, faulty_config(cfg), os.path.join(run_dir, "two_hosts"), nproc, init_file + ".2",
                 hooks=Hooks(hostname=two_hosts, delay_send=slow_sends_of_rank_2))


def test_four_ranks_measure_every_scope_with_nccl_tests_arithmetic(tmp_path, capsys):
    """4 gloo ranks, tp=2 dp=2. One host: intra_node is all 4 ranks (the n=4 factors), tp and dp
    are their own 2-rank groups, each measured. Two hosts of 2: tp is intra_node, dp is
    inter_node (measured once, named by `same_as`), and the slowed host is named."""
    from megaft.commbench.app import run

    cfg = bench_config()
    cfg.launcher.nproc, cfg.parallel.tp, cfg.parallel.dp = 4, 2, 2
    cfg.commbench = dataclasses.replace(cfg.commbench, max_bytes=SIZES[0], repeats=2)
    assert run(cfg, str(tmp_path), worker=four_rank_worker) == 0, capsys.readouterr().out
    doc = json.loads((tmp_path / "commbench.json").read_text())
    scopes = {s["name"]: s for s in doc["scopes"]}
    assert doc["grid"] == {"tp": 2, "cp": 1, "dp": 2, "pp": 1, "ep": 1}
    assert scopes["ep"] == {"name": "ep", "groups": [], "group_size": 0, "spans": "", "same_as": None,
                            "note": "parallel.ep=1: no ep group to measure"}
    assert doc["ep"] == {"note": "parallel.ep=1: no expert all-to-all to measure"}
    assert scopes["intra_node"]["groups"] == [[0, 1, 2, 3]] and scopes["inter_node"]["groups"] == []
    assert (scopes["tp"]["groups"], scopes["dp"]["groups"]) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert scopes["tp"]["same_as"] is None and scopes["dp"]["same_as"] is None
    assert scopes["cp"]["note"].startswith("parallel.cp=1") and scopes["pp"]["note"].startswith("parallel.pp=1")
    rows = doc["results"]
    assert {(r["scope"], r["ranks"]) for r in rows} == {("intra_node", 4), ("tp", 2), ("dp", 2)}
    assert sorted((r["scope"], r["collective"]) for r in rows) == sorted(
        (s, c.value) for s in ("intra_node", "tp", "dp") for c in Collective)
    for r in rows:
        assert r["correct"] and r["bytes"] == SIZES[0], r
        assert r["algbw_gbps"] == pytest.approx(r["bytes"] / r["time_s"] / 1e9)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * NCCL_TESTS_FACTOR[r["collective"]](r["ranks"]))

    split = json.loads((tmp_path / "two_hosts" / "commbench.json").read_text())
    assert split["hosts"] == {"hostA": [0, 1], "hostB": [2, 3]}
    scopes = {s["name"]: s for s in split["scopes"]}
    assert scopes["intra_node"]["groups"] == [[0, 1], [2, 3]] and scopes["inter_node"]["groups"] == [[0, 2], [1, 3]]
    assert (scopes["tp"]["same_as"], scopes["dp"]["same_as"]) == ("intra_node", "inter_node")
    assert scopes["inter_node"]["spans"] == "across nodes" and scopes["intra_node"]["spans"] == "within a node"
    assert {(r["scope"], r["ranks"]) for r in split["results"]} == {("intra_node", 2), ("inter_node", 2)}
    assert all(r["correct"] for r in split["results"])
    assert [(s["src"], s["dst"]) for s in split["pairs"]["slow"]] == [("hostB", "hostA")]
    status, problems = verdict(split, CommbenchConfig(check=True))
    assert status == 1 and [p.split(":")[0] for p in problems] == ["slow link hostB -> hostA"]


def test_command_exits_2_on_a_bad_config(tmp_path):
    exe = os.path.join(os.path.dirname(sys.executable), "megaft-commbench")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-c", "from megaft.cli import commbench; commbench()"]
    bad = subprocess.run(cmd + [f"hydra.run.dir={tmp_path}", "device=cpu", "commbench.repeats=0",
                                "commbench.slow_fraction=2"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2, bad.stdout[-2000:] + bad.stderr[-2000:]
    assert "commbench.repeats=0 must be >= 1" in bad.stderr and "commbench.slow_fraction=2.0 must be in" in bad.stderr
    assert not (tmp_path / "commbench.json").exists()


def test_commbench_under_torchrun_measures_every_collective_once(tmp_path):
    """docs/commbench.md's torchrun launch: 2 ranks, rank 0 writes one commbench.json of correct rows."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    out = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", "-m", "megaft.commbench.app",
                          f"hydra.run.dir={tmp_path}", "device=cpu", "commbench.min_bytes=8192",
                          "commbench.max_bytes=16384", "commbench.warmup=1", "commbench.repeats=2",
                          "commbench.plot=false"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stdout.count("megaft-commbench: PASS") == 1  # rank 0 alone reports
    doc = json.load(open(tmp_path / "commbench.json"))
    rows = [r for r in doc["results"] if r["scope"] == "intra_node"]
    assert {r["collective"] for r in rows} == {c.value for c in Collective}
    assert all(r["correct"] and r["ranks"] == 2 for r in rows) and len(rows) == 2 * len(Collective)
