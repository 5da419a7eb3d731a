"""Expert parallelism (`parallel.ep`) on local ranks equals the single process (megaft-verify's
machinery: loss, grad norm and aux_loss per step, every parameter's step-1 gradient, the experts'
joined over the ep ranks) with dp, ZeRO 1-3, accumulation, cp, tp with sequence parallel, pp and
full recompute, bf16 and verify.shrink=auto; an ep rank whose experts get no token still takes
part; a checkpoint taken at ep=2 resumes at ep=1 and at ep=4 (and one taken at ep=1 at ep=2 with
ZeRO-3) with the uninterrupted losses;
and a run at ep=2 loads its HF checkpoint per ep slice and exports the published layout."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_finetune_hf import EVAL_LINES, reference_eval_loss

from megaft.validation import validate
from models.hf_fixture import checkpoint_tensors
from models.layout_runs import Case, run_cases
from models.layout_runs import check as check_case
from models.layout_runs import report as layout_report
from models.moe_fixture import make_hf_moe
from models.test_moe_training import data, moe_config  # noqa: F401 (the data fixture)

pytestmark = pytest.mark.exact  # make test runs these on a pinned CPU code path (docs/contributing.md)

EP_LAYOUTS = [
    ("mixtral", dict(dp=2, ep=2)),
    ("olmoe", dict(dp=2, ep=2, zero=3)),
    ("qwen2_moe", dict(dp=2, ep=2, zero=2)),
    ("olmoe", dict(dp=2, ep=2, zero=1, global_batch_size=16)),  # 2 micro-batches per rank: accumulation
    ("qwen3_moe", dict(cp=2, ep=2)),  # the ep ranks are the two cp ranks of one sequence
    ("qwen2_moe", dict(tp=2, sequence_parallel=True, dp=2, ep=2)),
    ("qwen3_moe", dict(pp=2, dp=2, ep=2)),  # the last stage has no MoE layer
    ("mixtral", dict(dp=2, ep=2, recompute="full")),  # the replay dispatches again in backward
    ("mixtral", dict(dp=2, ep=2, precision="bf16")),  # rows travel in bf16; verify's bf16 tolerances
    ("qwen3_moe", dict(dp=2, ep=2, shrink="auto")),  # megaft-verify's shrunk model keeps every expert
]


EP_IDS = [f"{n}-{'-'.join(f'{k}{v}' for k, v in lay.items())}" for n, lay in EP_LAYOUTS]
RESUMES = (("ep2", "to_ep1", dict(dp=2)), ("ep2", "to_ep4", dict(dp=4, ep=4)),
           ("ep1", "to_ep2_zero3", dict(dp=2, ep=2, zero=3)))


def _train_config(ckpt: str, data: str, **layout):  # noqa: F811
    # 16 rows in micro-batches of 4 at every dp: the same micro-batches, so the same router losses
    cfg = moe_config(ckpt, data, global_batch_size=16, **layout)
    cfg.train.max_steps, cfg.train.save_every, cfg.train.keep_last, cfg.train.progress = 4, 2, 2, False
    assert validate(cfg, cfg.launcher.nproc) == []  # and resolves the vocabulary from the checkpoint
    return cfg


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data):  # noqa: F811
    """Every run of this module in one spawn per world size (models.layout_runs): the ep layouts
    and the ep rank without tokens (megaft-verify), the resharding runs and the export run."""
    root = tmp_path_factory.mktemp("moe_ep")
    cases = []
    for case, (name, layout) in zip(EP_IDS, EP_LAYOUTS):
        ckpt = str(root / case / "ckpt")
        make_hf_moe(ckpt, name)
        layout = dict(layout)
        precision = layout.pop("precision", "fp32")
        cfg = moe_config(ckpt, data, **layout)
        cfg.verify.precision = precision
        cases.append(Case(case, cfg, str(root / case / "verify")))
    # Top-1 routing with experts 2 and 3 given the mean of experts 0 and 1's router rows
    ckpt = root / "no_tokens" / "ckpt"
    make_hf_moe(str(ckpt), "mixtral", num_experts_per_tok=1)
    file = str(ckpt / "model.safetensors")
    tensors = load_file(file)
    for name in [n for n in tensors if n.endswith("block_sparse_moe.gate.weight")]:
        tensors[name][2] = tensors[name][3] = tensors[name][:2].mean(0)
    save_file(tensors, file, metadata={"format": "pt"})
    cases.append(Case("no_tokens", moe_config(str(ckpt), data, dp=2, ep=2, zero=3), str(root / "no_tokens" / "verify")))
    # Resharding: saved at ep=2 and at ep=1, each resumed from its step-2 checkpoint in other layouts
    ckpt = str(root / "reshard_ckpt")
    make_hf_moe(ckpt, "qwen2_moe")
    cases.append(Case("ep2", _train_config(ckpt, data, dp=2, ep=2), str(root / "ep2"), verify=False))
    cases.append(Case("ep1", _train_config(ckpt, data, dp=2), str(root / "ep1"), verify=False))
    for saved, run, layout in RESUMES:
        cases.append(Case(run, _train_config(ckpt, data, **layout), str(root / run), verify=False,
                          resume_from=(str(root / saved), 2)))
    # Loading and exporting at ep=2
    ckpt = root / "export_ckpt"
    make_hf_moe(str(ckpt), "mixtral")
    evalf = root / "eval.jsonl"
    evalf.write_text("".join(json.dumps({"text": t}) + "\n" for t in EVAL_LINES))
    cfg = moe_config(str(ckpt), data, dp=2, ep=2)
    cfg.data.eval_path = str(evalf)
    cfg.train.max_steps, cfg.train.eval_every, cfg.train.export_hf, cfg.train.progress = 2, 2, True, False
    assert validate(cfg, cfg.launcher.nproc) == []
    cases.append(Case("export", cfg, str(root / "export"), verify=False))
    run_cases(str(root), cases)
    return root


@pytest.mark.parametrize("name, layout", EP_LAYOUTS, ids=EP_IDS)
def test_expert_parallel_layout_equals_the_single_process(runs, request, name, layout):
    report = layout_report(str(runs), request.node.callspec.id)
    precision = layout.get("precision", "fp32")
    assert report.passed, report.format()
    assert [r.step for r in report.rows] == [1, 2, 3]
    aux_tol = 1e-5 if precision == "fp32" else 1e-3
    assert all(r.ref_aux is not None and r.aux_rel <= aux_tol for r in report.rows), report.format()
    names = [n for n, _ in report.grads]
    assert any(".mlp.experts.down_proj" in n for n in names) and any(".mlp.gate.weight" in n for n in names)


def test_an_ep_rank_without_tokens_trains_at_zero3(runs):
    """Top-1 routing with experts 2 and 3 (ep rank 1's) given router rows equal to the mean of
    experts 0 and 1's: their logits never exceed the larger, so ep rank 1 receives no row on
    step 1 and its grouped GEMMs run on none; every all-to-all, ZeRO-3 gather and reduce-scatter
    still runs, and the run equals the single process."""
    report = layout_report(str(runs), "no_tokens")
    assert report.passed, report.format()
    first = json.loads((runs / "no_tokens" / "verify" / "layout" / "metrics.jsonl").read_text().splitlines()[1])
    assert first["step"] == 1 and first["moe/0/tokens_median"] == 0 == first["moe/1/tokens_median"], first
    assert first["moe/0/tokens_max"] > 0


def _losses(run: str) -> dict[int, float]:
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_checkpoints_reshard_across_ep(runs):
    """Saved at ep=2 (dp=2), resumed at ep=1 (dp=2) and at ep=4 (dp=4, one expert per rank);
    saved at ep=1, resumed at ep=2 with ZeRO-3: steps 3-4 equal the uninterrupted run (each
    expert's weights and Adam moments move between ranks by name and expert index,
    megaft.checkpoint.reshard)."""
    root = str(runs)
    for case in ("ep2", "ep1") + tuple(run for _, run, _ in RESUMES):
        check_case(root, case)
    ep2 = os.path.join(root, "ep2")
    straight = _losses(ep2)
    assert sorted(straight) == [1, 2, 3, 4]
    for _, run, _ in RESUMES:
        got = _losses(os.path.join(root, run))
        assert sorted(got) == [1, 2, 3, 4], run
        for step in (3, 4):
            assert abs(got[step] - straight[step]) <= 1e-5 * straight[step], (run, step, got, straight)
    manifest = json.load(open(os.path.join(ep2, "checkpoints", "step_000004", "manifest.json")))
    assert manifest["layout"]["ep"] == 2


def test_a_run_at_ep2_loads_and_exports_the_published_layout(runs):
    """Each ep rank reads only its experts of the per-expert checkpoint; the export gathers them
    back: transformers reloads it with megaft's final eval loss, under the published names."""
    check_case(str(runs), "export")
    ckpt, run = runs / "export_ckpt", runs / "export"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, 2]
    assert abs(evals[0]["eval_loss"] - reference_eval_loss(str(ckpt))) <= 1e-5 * evals[0]["eval_loss"]
    assert abs(evals[-1]["eval_loss"] - reference_eval_loss(str(run / "hf"))) <= 1e-5 * evals[-1]["eval_loss"]
    written, published = checkpoint_tensors(str(run / "hf")), checkpoint_tensors(str(ckpt))
    assert sorted(written) == sorted(published)
    for e in range(4):  # every expert trained, whichever ep rank held it
        name = f"model.layers.0.block_sparse_moe.experts.{e}.w2.weight"
        assert not torch.equal(written[name], published[name]), name
    summary = json.load(open(run / "summary.json"))
    assert "all-to-all over ep=2" in summary["moe"]["dispatch"], summary["moe"]
