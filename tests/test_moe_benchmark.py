"""benchmarks/moe.py: its correctness check (megaft's MoE against transformers' block on
the same weights, and the refusal to time a disagreeing implementation) and its
all-to-all byte counts (the uniform formula by hand, the exact count on a hand-built
routing). A tiny shape, seconds; timings are not asserted."""
import io
import json

import pytest
import torch

from benchmarks import moe as bench

TINY = "olmoe:tokens=48,dim=32,experts=8,ffn=16,top_k=2"
TINY_MIXTRAL = "mixtral:tokens=40,dim=24,experts=4,ffn=20,top_k=2"


def test_uniform_formula_by_hand():
    # 2 directions x 2048 tokens x 8 copies x (ep-1)/ep x 512 x 4 bytes (fp32)
    assert bench.a2a_formula_bytes(2048, 8, 512, 4, 2) == 2 * 2048 * 8 * 512 * 4 // 2 == 32 * 2 ** 20
    assert bench.a2a_formula_bytes(2048, 8, 512, 4, 4) == 50_331_648  # 48 MiB
    assert bench.a2a_formula_bytes(2048, 8, 512, 4, 8) == 56 * 2 ** 20
    assert bench.a2a_formula_bytes(2048, 2, 512, 2, 8) == 2 * 2048 * 2 * 7 / 8 * 512 * 2  # bf16, Mixtral's top-2
    assert bench.a2a_formula_bytes(100, 4, 16, 4, 1) == 0  # ep=1: nothing leaves the rank


def test_exact_count_on_a_hand_built_routing():
    # 3 tokens, top-2 over 4 experts; ep=2: rank 0 holds experts {0, 1}, rank 1 {2, 3}
    experts = torch.tensor([[0, 1], [0, 2], [1, 3]])
    assert bench.remote_rows(experts, 4, 2, 0) == 2  # rows to 2 and 3
    assert bench.remote_rows(experts, 4, 2, 1) == 4  # rows to 0, 1, 0, 1
    assert bench.a2a_exact_bytes(experts, 4, 2, dim=16, elem_bytes=4) == [2 * 2 * 16 * 4, 2 * 4 * 16 * 4]
    # ep=4: one expert per rank; expert 0 and 1 get 2 rows each, 2 and 3 one each
    assert [bench.remote_rows(experts, 4, 4, r) for r in range(4)] == [4, 4, 5, 5]
    # the mean over the rank holding the batch is the uniform formula: each row's expert is in one block
    for ep in (2, 4):
        exact = bench.a2a_exact_bytes(experts, 4, ep, dim=16, elem_bytes=4)
        assert sum(exact) / ep == bench.a2a_formula_bytes(3, 2, 16, 4, ep)
    with pytest.raises(ValueError, match="do not split evenly"):
        bench.remote_rows(experts, 4, 3, 0)
    shape = bench.parse_shape("olmoe:tokens=3,dim=16,experts=4,top_k=2")
    table = bench.a2a_table(experts, shape, [2, 3], elem_bytes=4)
    assert table[0]["exact_min"] == 2 * 2 * 16 * 4 and table[0]["exact_max"] == 2 * 4 * 16 * 4
    assert "skipped" in table[1] and table[1]["formula_bytes"] == bench.a2a_formula_bytes(3, 2, 16, 4, 3)


def test_shapes_parse():
    s = bench.parse_shape("mixtral:tokens=64,dim=32,ffn=48")
    assert (s.family, s.tokens, s.dim, s.experts, s.ffn, s.top_k, s.norm) == ("mixtral", 64, 32, 8, 48, 2, True)
    assert bench.parse_shape("olmoe") == bench.PRESETS["olmoe"]
    with pytest.raises(SystemExit, match="unknown preset"):
        bench.parse_shape("dbrx")
    with pytest.raises(SystemExit, match="renormalizes"):
        bench.parse_shape("mixtral:norm=0")
    with pytest.raises(SystemExit, match="top_k"):
        bench.parse_shape("olmoe:experts=4")  # top-8 of 4


def test_main_on_tiny_shapes_agrees_with_transformers(tmp_path):
    out = io.StringIO()
    path = tmp_path / "moe.json"
    report = bench.main(["--device", "cpu", "--shape", TINY, "--shape", TINY_MIXTRAL, "--reps", "2",
                         "--rounds", "2", "--ep", "2", "4", "--json", str(path)], out=out)
    text = out.getvalue()
    assert len(report["shapes"]) == 2
    for result in report["shapes"]:
        megaft = [n for n in result["checks"] if n.startswith("megaft:")]
        assert megaft and "hf:grouped_mm" in result["checks"]
        for name, check in result["checks"].items():
            assert check["ok"], (name, check)
            for diff in check["diffs"].values():  # fp32: rounding only
                assert diff["max_abs_diff"] <= 1e-6 * max(1.0, diff["ref_max_abs"])
        assert set(result["timings"]) == {"hf:eager", *result["checks"]}  # every agreeing impl timed
        assert all(t["median_ms"] > 0 and t["calls"] == 2 for t in result["timings"].values())
        shape = result["shape"]
        for row in result["a2a"]:
            assert row["formula_bytes"] == bench.a2a_formula_bytes(shape["tokens"], shape["top_k"], shape["dim"], 4,
                                                                   row["ep"])
            assert sum(row["exact_bytes"]) / row["ep"] == pytest.approx(row["formula_bytes"])
            assert row["exact_min"] <= row["formula_bytes"] <= row["exact_max"]
    assert "agree" in text and "median ms" in text and "max / formula" in text
    assert json.loads(path.read_text())["shapes"][0]["shape"]["tokens"] == 48


def test_a_disagreeing_megaft_is_not_timed(monkeypatch):
    original = bench.hf_layer

    def off_by_a_little(shape, impl, source, device):  # transformers' copies differ from megaft's weights
        block = original(shape, impl, source, device)
        with torch.no_grad():
            block.experts.down_proj.add_(1e-3)
        return block

    monkeypatch.setattr(bench, "hf_layer", off_by_a_little)
    out = io.StringIO()
    with pytest.raises(SystemExit, match="megaft disagrees with transformers"):
        bench.main(["--device", "cpu", "--shape", TINY, "--reps", "1", "--rounds", "1", "--ep", "2"], out=out)
    text = out.getvalue()
    assert "disagrees with hf:eager" in text
    timings = text.split("forward + backward, ms")[1].split("expert-parallel")[0]
    assert "hf:eager" in timings and "megaft:" not in timings


def test_matmul_work_by_hand():
    # 3 projections x (fwd + dx + dW) x 2 FLOPs per multiply-add over 2048 x 8 rows, plus the router's
    assert bench.gemm_flops(bench.PRESETS["olmoe"]) == 3 * 3 * 2 * (2048 * 8) * 512 * 256 + 3 * 2 * 2048 * 512 * 64
    assert bench.gemm_flops(bench.PRESETS["mixtral"]) == 18 * 4096 * 512 * 1024 + 6 * 2048 * 512 * 8


def test_the_cpu_grouped_mm_row_runs_torch_grouped_mm(monkeypatch):
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip(reason="this torch has no torch._grouped_mm")
    calls = []
    original = torch._grouped_mm

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(torch, "_grouped_mm", counted)
    shape = bench.parse_shape(TINY)
    cpu = torch.device("cpu")
    impl = bench.megaft_impl(bench.megaft_layer(shape, bench.GROUPED_MM_CPU, cpu), bench.GROUPED_MM_CPU)
    x = torch.randn(1, shape.tokens, shape.dim, requires_grad=True)
    bench.fwd_bwd(impl, x, torch.randn(1, shape.tokens, shape.dim))
    assert len(calls) == 9  # 3 projections: forward, dx, dW
    calls.clear()
    plain = bench.megaft_impl(bench.megaft_layer(shape, "torch", cpu), "torch")
    bench.fwd_bwd(plain, x, torch.randn(1, shape.tokens, shape.dim))
    assert not calls  # the patch is undone after each call
