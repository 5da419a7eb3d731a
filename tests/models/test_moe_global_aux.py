"""Global-batch load balancing (`moe.aux_scope=global_batch`): the micro-batches' shares add up
to transformers' load-balancing loss over the whole batch at once (value and every gradient),
and every layout equals the single process (dp, accumulation, pp, tp with sequence parallel,
cp, ep), while the value differs from the micro-batch scope's."""
from __future__ import annotations

import pytest
import torch

from megaft.config.moe import MoEConfig, check_moe
from megaft.models.moe.router import GlobalCounts
from models.layout_runs import Case, run_cases
from models.layout_runs import report as layout_report
from models.moe_fixture import hf_grad_of, load_reference, make_hf_moe, sample_ids
from models.test_moe import _megaft
from models.test_moe_training import data, moe_config  # noqa: F401 (the data fixture)


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_global_shares_equal_transformers_aux_over_the_whole_batch(tmp_path, name):
    make_hf_moe(str(tmp_path), name)
    ref, model = load_reference(str(tmp_path)), _megaft(str(tmp_path))
    micro = [sample_ids(seed=1), sample_ids(seed=2)]
    counts = sum(model.router_counts(ids) for ids in micro)
    model.global_counts = GlobalCounts(counts, torch.tensor(float(sum(ids.numel() for ids in micro))), len(micro))
    aux = local = mean_micro_aux = 0.0
    for ids in micro:
        model.blocks(ids)
        router = model.router_losses()
        aux, local = aux + router.aux / len(micro), local + router.local
        model.global_counts, saved = None, model.global_counts
        model.blocks(ids)
        mean_micro_aux += model.router_losses().aux.item() / len(micro)  # the micro-batch scope's value
        model.global_counts = saved
    out = ref(torch.cat(micro), output_router_logits=True)  # one batch: transformers pools every token
    assert aux.item() == pytest.approx(out.aux_loss.item(), rel=1e-6)
    assert abs(mean_micro_aux - out.aux_loss.item()) > 1e-4  # the scopes differ on this batch
    local.backward()
    (model.cfg.router_aux_loss_coef * out.aux_loss).backward()
    hf_grads = {n: p.grad for n, p in ref.named_parameters()}
    compared = 0
    for pname, p in model.named_parameters():
        if p.grad is None:  # after the last router (the last experts, the head): no path from the aux loss
            continue
        want = hf_grad_of(hf_grads, pname, name)
        assert (p.grad - want).abs().max() <= 1e-5 * want.abs().max() + 1e-12, pname
        compared += 1
    assert compared > 0 and any(".mlp.gate." in n for n, p in model.named_parameters() if p.grad is not None)


def test_global_scope_with_dropout_is_refused():
    errors = check_moe(MoEConfig(aux_scope="global_batch"), n_experts=4, cp=1, dropout=0.1)
    assert len(errors) == 1 and "model.dropout=0.1" in errors[0] and "fix: model.dropout=0" in errors[0]
    assert check_moe(MoEConfig(aux_scope="global_batch"), n_experts=4, cp=1) == []


GLOBAL_LAYOUTS = [
    ("olmoe", dict(dp=2)),
    ("qwen2_moe", dict(dp=2, zero=1, global_batch_size=16)),  # accumulation: 2 micro-batches per rank
    ("qwen3_moe", dict(pp=2, micro_batch_size=2)),  # the counting pass runs through the stages
    ("mixtral", dict(tp=2, sequence_parallel=True)),
    ("qwen3_moe", dict(cp=2)),
    ("mixtral", dict(dp=2, ep=2, zero=3)),
]


GLOBAL_IDS = [f"{n}-{'-'.join(f'{k}{v}' for k, v in lay.items())}" for n, lay in GLOBAL_LAYOUTS]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data):  # noqa: F811
    """Every layout at the global-batch scope verified in one spawn (models.layout_runs)."""
    root = tmp_path_factory.mktemp("moe_global_aux")
    cases = []
    for case, (name, layout) in zip(GLOBAL_IDS, GLOBAL_LAYOUTS):
        ckpt = str(root / case / "ckpt")
        make_hf_moe(ckpt, name)
        cfg = moe_config(ckpt, data, **layout)
        cfg.moe.aux_scope = "global_batch"
        cases.append(Case(case, cfg, str(root / case / "verify")))
    run_cases(str(root), cases)
    return root


@pytest.mark.parametrize("name, layout", GLOBAL_LAYOUTS, ids=GLOBAL_IDS)
def test_global_scope_layout_equals_the_single_process(runs, request, name, layout):
    report = layout_report(str(runs), request.node.callspec.id)
    assert report.passed, report.format()
    assert all(r.ref_aux is not None and r.aux_rel <= 1e-5 for r in report.rows), report.format()
