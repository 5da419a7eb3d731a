"""benchmarks/moe_lora.py: LoRA on a mixture of experts against its full fine-tune, on tiny
models (seconds): the first-step losses agree (B = 0), the adapters hold less state than the
full model and both variants' measured bytes equal megaft.perf.memory's, the report has its
fields, and a LoRA variant whose first loss differs is refused. Timings are not asserted."""
import io
import json

import pytest
import torch

from benchmarks import lora as lora_bench
from benchmarks import moe_lora as bench

TINY = "n_layers=2,dim=32,n_heads=4,n_kv_heads=2,ffn_dim=48,n_experts=4,vocab_size=96,max_seq_len=64"
ARGS = ["--device", "cpu", "--rank", "4", "--steps", "2", "--rounds", "2", "--warmup", "0", "--seq", "16",
        "--dp", "4"]


@pytest.mark.parametrize("preset, extra", [("mixtral", ""), ("qwen3_moe", ",head_dim=8,moe_ffn_dim=16,top_k=2")])
def test_lora_on_experts_agrees_and_holds_less_state(tmp_path, preset, extra):
    out, path = io.StringIO(), tmp_path / "moe_lora.json"
    report = bench.main(["--model", preset, "--set", TINY + extra, *ARGS, "--json", str(path)], out=out)
    full, lora = report["variants"]["full"], report["variants"]["lora"]
    assert report["losses_agree"] and full["losses_agree"] and lora["losses_agree"]
    assert lora["first_losses"] == pytest.approx(full["first_losses"], rel=1e-6)  # fp32, B = 0: the same model
    assert len(full["first_losses"]) == len(lora["first_losses"]) == 2  # one turn per round, ABBA
    assert 0 < lora["trainable"] < full["trainable"] and lora["trainable_bytes"] < full["trainable_bytes"]
    for v in (full, lora):
        assert v["state_equals_formula"], v  # measured at dp=1 = megaft.perf.memory's bytes
        assert v["state"]["grads"] == 4 * v["trainable"] and v["state"]["optimizer"] == 8 * v["trainable"]
        assert v["steps"] == 2 and 0 < v["p20_ms"] <= v["median_ms"] <= v["p80_ms"]
    assert report["ratio"] == pytest.approx(lora["median_ms"] / full["median_ms"])
    assert report["state_ratio"] < 1
    rows = report["formula_rows"]
    assert [(r["variant"], r["zero"], r["ep"]) for r in rows] == [
        ("full", 1, 4), ("lora", 1, 4), ("full", 2, 4), ("lora", 2, 4)]
    text = out.getvalue()
    assert "median ms" in text and "meas/formula" in text and "load average" in text and "!" not in text
    saved = json.loads(path.read_text())
    assert saved["model"]["n_experts"] == 4 and "experts" in saved["lora"]["targets"]
    assert saved["environment"]["command"].startswith("python -m benchmarks.moe_lora")


def test_expert_adapters_are_in_the_trainable_state():
    """rank 4 on experts only: the trainable count is the per-expert pairs' (gate, up, down of every
    expert, A [E, r, in] and B [E, out, r]) and nothing else."""
    cfg = bench.model_config("mixtral", TINY)
    model, flat, _ = lora_bench.build("lora", cfg, bench.LoraConfig(rank=4, targets=["experts"]),
                                      torch.device("cpu"), seed=0)
    per_layer = cfg.n_experts * 4 * 3 * (cfg.dim + cfg.expert_ffn)
    assert sum(p.numel() for p in flat.params) == cfg.n_layers * per_layer
    assert all(".mlp.experts.adapter." in n for n, p in model.named_parameters() if p.requires_grad)


def test_a_lora_variant_whose_first_loss_differs_is_refused(monkeypatch):
    original = lora_bench.build

    def nonzero_b(variant, cfg, lora, device, seed, kernels=None):  # an adapter that is not zero at init
        model, flat, opt = original(variant, cfg, lora, device, seed, kernels)
        if variant == "lora":
            with torch.no_grad():
                model.layers[0].mlp.experts.adapter.down_proj.B.fill_(0.5)
        return model, flat, opt

    monkeypatch.setattr(lora_bench, "build", nonzero_b)
    out = io.StringIO()
    with pytest.raises(SystemExit, match="first-step loss differs"):
        bench.main(["--set", TINY, *ARGS], out=out)
    assert "first-step losses differ" in out.getvalue() and "median ms" not in out.getvalue()


def test_presets_and_overrides():
    for name in bench.PRESETS:
        cfg = bench.model_config(name)
        assert cfg.n_experts > 0 and 1 <= cfg.top_k <= cfg.n_experts
    cfg = bench.model_config("qwen3_moe", "n_layers=2,norm_topk_prob=false,rope_theta=1e6")
    assert (cfg.n_layers, cfg.norm_topk_prob, cfg.rope_theta, cfg.n_experts) == (2, False, 1e6, 64)
    with pytest.raises(SystemExit, match="not key=value"):
        bench.model_config("mixtral", "experts=4")
    with pytest.raises(SystemExit, match="one of"):
        bench.model_config("dbrx")
    with pytest.raises(SystemExit, match="top_k"):
        bench.model_config("mixtral", "top_k=9")
