"""Training the mixture-of-experts families on local ranks equals the single process (megaft-verify's
machinery: loss, grad norm and aux_loss per step, every parameter's step-1 gradient, router
included) at tp=2, tp=2 with sequence parallel, dp=2 with ZeRO-3, cp=2, tp=2 with full recompute,
pp=2 (alone, with tp=2 and sequence parallel, interleaved), dp=2 with ZeRO-1 and accumulation, and
verify.shrink=auto;
an expert that gets no token still takes part (ZeRO-3, dp=2); and a run exported after two
steps reloads in transformers with megaft's final eval loss, in the published per-expert layout."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_finetune_hf import EVAL_LINES, reference_eval_loss

from megaft.config import Config
from models.hf_fixture import checkpoint_tensors
from models.layout_runs import Case, run_cases
from models.layout_runs import report as layout_report
from models.moe_fixture import make_hf_moe

pytestmark = pytest.mark.exact  # make test runs these on a pinned CPU code path (docs/contributing.md)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i} ", "completion": f"abc{i % 7}"}) + "\n"
                            for i in range(64)))
    return str(path)


def moe_config(ckpt: str, data: str, **parallel) -> Config:
    cfg = Config()
    cfg.model.init_from = ckpt
    cfg.data.path, cfg.data.seq_len = data, 16
    cfg.train.micro_batch_size, cfg.train.global_batch_size = 4, 8
    cfg.verify.steps = 3
    for key, value in parallel.items():
        target = {"recompute": cfg.model, "micro_batch_size": cfg.train, "global_batch_size": cfg.train,
                  "shrink": cfg.verify}.get(key, cfg.parallel)
        setattr(target, key, value)
    p = cfg.parallel
    cfg.launcher.nproc = p.tp * p.cp * p.pp * (p.dp or 1)
    return cfg


# (family, layout, checkpoint shape): pp=2 with qwen3_moe leaves the last stage without a MoE layer
# (decoder_sparse_step=2 over 3 layers); the interleaved schedule runs 4 Mixtral layers on 2 ranks.
LAYOUTS = [
    ("mixtral", dict(tp=2), {}),
    ("qwen2_moe", dict(tp=2, sequence_parallel=True), {}),
    ("olmoe", dict(dp=2, zero=3), {}),
    ("olmoe", dict(tp=2, sequence_parallel=True), {}),  # the full-width qk-norm's squares summed over tp
    ("qwen3_moe", dict(cp=2), {}),
    ("qwen2_moe", dict(tp=2, recompute="full"), {}),
    ("qwen3_moe", dict(pp=2), {}),
    ("qwen2_moe", dict(pp=2, tp=2, sequence_parallel=True), {}),
    ("mixtral", dict(pp=2, vpp=2, schedule="interleaved", micro_batch_size=2), dict(num_hidden_layers=4)),
    ("olmoe", dict(dp=2, zero=1, global_batch_size=16), {}),  # 2 micro-batches per rank: accumulation
    ("qwen3_moe", dict(tp=2, shrink="auto"), {}),  # megaft-verify's shrunk model keeps its experts
]


LAYOUT_IDS = [f"{n}-{'-'.join(f'{k}{v}' for k, v in lay.items())}" for n, lay, _ in LAYOUTS]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data):
    """Every layout below, and the expert without tokens, verified in one spawn per world size."""
    root = tmp_path_factory.mktemp("moe_layouts")
    cases = []
    for case, (name, layout, shape) in zip(LAYOUT_IDS, LAYOUTS):
        ckpt = str(root / case / "ckpt")
        make_hf_moe(ckpt, name, **shape)
        cases.append(Case(case, moe_config(ckpt, data, **layout), str(root / case / "verify")))
    # Top-1 routing with expert 3's router row the mean of the others' (test_an_expert_without_tokens...)
    ckpt = root / "no_tokens" / "ckpt"
    make_hf_moe(str(ckpt), "mixtral", num_experts_per_tok=1)
    file = str(ckpt / "model.safetensors")
    tensors = load_file(file)
    for name in [n for n in tensors if n.endswith("block_sparse_moe.gate.weight")]:
        tensors[name][3] = tensors[name][:3].mean(0)
    save_file(tensors, file, metadata={"format": "pt"})
    cases.append(Case("no_tokens", moe_config(str(ckpt), data, dp=2, zero=3), str(root / "no_tokens" / "verify")))
    run_cases(str(root), cases)
    return root


@pytest.mark.parametrize("name, layout, shape", LAYOUTS, ids=LAYOUT_IDS)
def test_moe_layout_equals_the_single_process(runs, request, name, layout, shape):
    """Pipeline stages pass the micro-batch's router statistics on with the activations and get the
    totals back with the gradients (megaft.pipeline.runtime): the pooled loss equals the single process."""
    report = layout_report(str(runs), request.node.callspec.id)
    assert report.passed, report.format()
    assert [r.step for r in report.rows] == [1, 2, 3]
    assert all(r.ref_aux is not None and r.aux_rel <= 1e-5 for r in report.rows), report.format()
    names = [n for n, _ in report.grads]
    assert any(".mlp.gate.weight" in n for n in names) and any(".mlp.experts.down_proj" in n for n in names)
    assert max(r.loss_rel for r in report.rows) <= 1e-5 and report.grads[0][1] <= 1e-4


def test_an_expert_without_tokens_trains_at_zero3_dp2(runs):
    """Top-1 routing with expert 3's router row the mean of the others': its logit never exceeds
    the largest, so it gets no token on step 1; its (zero) gradient still goes through every
    ZeRO-3 gather and reduce-scatter, and the run equals the single process."""
    report = layout_report(str(runs), "no_tokens")
    assert report.passed, report.format()
    first = json.loads((runs / "no_tokens" / "verify" / "layout" / "metrics.jsonl").read_text().splitlines()[1])
    assert first["step"] == 1 and first["moe/0/tokens_min"] == 0 == first["moe/1/tokens_min"], first
    assert first["moe/0/tokens_max"] > 0 and first["moe/0/imbalance"] > 1


def test_export_after_two_steps_reloads_in_transformers_with_the_finalreference_eval_loss(tmp_path, data):
    ckpt = tmp_path / "ckpt"
    make_hf_moe(str(ckpt), "qwen2_moe")
    evalf = tmp_path / "eval.jsonl"
    evalf.write_text("".join(json.dumps({"text": t}) + "\n" for t in EVAL_LINES))
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "megaft.train", f"hydra.run.dir={run}", "train.progress=false",
           f"model.init_from={ckpt}", "data=jsonl", f"data.path={data}", f"data.eval_path={evalf}",
           "data.seq_len=16", "train.max_steps=2", "train.eval_every=2", "train.micro_batch_size=4",
           "train.global_batch_size=8", "train.export_hf=true", "parallel.tp=2", "launcher.nproc=2"]
    out = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, 2]
    assert abs(evals[0]["eval_loss"] - reference_eval_loss(str(ckpt))) <= 1e-5 * evals[0]["eval_loss"]
    exported = str(run / "hf")
    assert abs(evals[-1]["eval_loss"] - reference_eval_loss(exported)) <= 1e-5 * evals[-1]["eval_loss"]
    written, published = checkpoint_tensors(exported), checkpoint_tensors(str(ckpt))
    assert sorted(written) == sorted(published)  # mlp.experts.E.{gate,up,down}_proj.weight, shared expert
    assert not torch.equal(written["model.layers.0.mlp.experts.3.down_proj.weight"],
                           published["model.layers.0.mlp.experts.3.down_proj.weight"])
    train = [r for r in rows if "loss" in r]
    assert all(r["aux_loss"] > 0 and "moe/0/imbalance" in r and "moe/1/imbalance" not in r for r in train)
    summary = json.load(open(run / "summary.json"))
    assert summary["moe"]["experts"] == 4 and summary["moe"]["layers"] == [0, 2], summary["moe"]
    assert summary["moe"]["grouped_gemm"] == "torch" and "no token dropped" in summary["moe"]["dispatch"]
