"""megaft.pref against TRL's own trainers, on a tiny random fp32 Llama.

Each case builds TRL's real trainer (DPOTrainer, and the experimental CPOTrainer and
ORPOTrainer, on the same checkpoint and a three-pair dataset of different lengths), takes
one collated batch from the trainer's own dataloader, and calls the trainer's
`compute_loss` (DPOTrainer._compute_loss; CPO/ORPO get_batch_loss_metrics) and backward.
megaft loads the same checkpoint into a Decoder, computes the log-probs of the same token
ids (megaft.pref.logps) and the objective (megaft.pref.losses); the loss, the six
rewards/* and logps/* metrics TRL logs (and ORPO's three more) and every parameter's
gradient must agree.
"""
from __future__ import annotations

import os

import pytest
import torch
from datasets import Dataset
from models.hf_fixture import load_reference, make_hf_llama
from multirank import spawn
from transformers import PreTrainedTokenizerFast
from trl import DPOConfig, DPOTrainer
from trl.experimental.cpo import CPOConfig, CPOTrainer
from trl.experimental.orpo import ORPOConfig, ORPOTrainer

from megaft.config.kernels import KernelsConfig
from megaft.config.pref import check_preference
from megaft.models.hf.config import hf_name
from megaft.pref.logps import SequenceLogps, decoder_token_logps, next_token_labels, sequence_logps
from megaft.pref.losses import preference_loss
from pref.pref_cases import ATOL, RTOL, megaft_model, sequence_of, tp2_rank

pytestmark = pytest.mark.exact  # make test runs these on a pinned CPU code path (docs/contributing.md)

# Three pairs; prompts, chosen and rejected answers of different lengths (letters only: the
# fixture's character vocabulary has no space). TRL appends <eos> to each answer.
PAIRS = {"prompt": ["abc", "Hellow", "xy"],
         "chosen": ["defg", "orld", "zzzzzz"],
         "rejected": ["q", "ORLDxyz", "Zz"]}
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected")
# id -> (TRL trainer, its settings, megaft objective, megaft settings)
CASES = {
    "dpo": ("dpo", dict(loss_type="sigmoid", beta=0.5), "dpo", dict(beta=0.5)),
    "robust": ("dpo", dict(loss_type="robust", beta=0.5, label_smoothing=0.2), "robust",
               dict(beta=0.5, label_smoothing=0.2)),
    "ipo": ("dpo", dict(loss_type="ipo", beta=0.1), "ipo", dict(beta=0.1)),
    "simpo": ("cpo", dict(loss_type="simpo", cpo_alpha=0.0, beta=2.0, simpo_gamma=0.7), "simpo",
              dict(beta=2.0, gamma=0.7)),
    "simpo_smoothed": ("cpo", dict(loss_type="simpo", cpo_alpha=0.0, beta=2.0, simpo_gamma=0.7, label_smoothing=0.1),
                       "simpo", dict(beta=2.0, gamma=0.7, label_smoothing=0.1)),
    "orpo": ("orpo", dict(beta=0.5), "orpo", dict(beta=0.5)),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The policy, and a reference with other weights (so DPO's log-ratios are not zero)."""
    root = tmp_path_factory.mktemp("pref")
    make_hf_llama(str(root / "policy"), seed=0)
    make_hf_llama(str(root / "ref"), seed=3)
    return str(root / "policy"), str(root / "ref")


def _trl_trainer(kind: str, settings: dict, policy: str, ref: str, out: str):
    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(policy, "tokenizer.json"), pad_token="<pad>",
                                  eos_token="<eos>", unk_token="<unk>")
    # fp32 on the CPU: transformers 5's TrainingArguments default to bf16, which autocasts the
    # reference model that the trainer prepares
    common = dict(output_dir=out, report_to="none", per_device_train_batch_size=len(PAIRS["prompt"]), use_cpu=True,
                  bf16=False, gradient_checkpointing=False, seed=0)
    data = Dataset.from_dict(PAIRS)
    model = load_reference(policy)
    if kind == "dpo":
        return DPOTrainer(model=model, ref_model=load_reference(ref), args=DPOConfig(**common, **settings),
                          train_dataset=data, processing_class=tok)
    if kind == "cpo":
        return CPOTrainer(model=model, args=CPOConfig(max_length=64, **common, **settings), train_dataset=data,
                          processing_class=tok)
    return ORPOTrainer(model=model, args=ORPOConfig(max_length=64, **common, **settings), train_dataset=data,
                       processing_class=tok)


def trl_step(trainer, kind: str):
    """One collated batch, TRL's loss on it, the metrics it logged and the gradients."""
    batch = next(iter(trainer.get_train_dataloader()))
    model = trainer.model
    model.train()  # DPOTrainer files metrics under "train" only in training mode
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    logged = trainer._metrics["train"] if kind == "dpo" else trainer._stored_metrics["train"]
    metrics = {k: v[-1] for k, v in logged.items()}
    return batch, loss.detach(), metrics, {n: p.grad for n, p in model.named_parameters()}


def megaft_step(kind: str, objective: str, settings: dict, batch, policy: str, ref: str):
    """megaft's (loss, per-pair metrics, gradients by HF name) on TRL's collated batch."""
    model = megaft_model(policy)
    extra = {}
    if kind == "dpo":  # one [chosen; rejected] batch of ids, the completions marked
        pairs = batch["input_ids"].shape[0] // 2
        chosen, rejected = sequence_of(model, batch["input_ids"], batch["completion_mask"]).split(pairs)
        with torch.no_grad():
            reference = sequence_of(megaft_model(ref), batch["input_ids"], batch["completion_mask"])
        extra = dict(zip(("ref_chosen", "ref_rejected"), reference.split(pairs)))
    else:  # chosen and rejected rows apart, TRL labels (prompt and padding -100) unshifted
        ids = batch["chosen_input_ids"]
        # one forward for both sums of the chosen rows: ORPO's SFT term reads every non-pad token
        # (prompt included), the odds ratio the answer's
        whole = next_token_labels(ids, batch["chosen_attention_mask"])
        logps = decoder_token_logps(model, ids, whole)
        chosen = sequence_logps(logps, next_token_labels(ids, batch["chosen_labels"] != -100))
        rejected = sequence_of(model, batch["rejected_input_ids"], batch["rejected_labels"] != -100)
        if objective == "orpo":
            extra["chosen_nll"] = sequence_logps(logps, whole)
    losses, metrics = preference_loss(objective, chosen, rejected, **extra, **settings)
    loss = losses.mean()
    loss.backward()
    return loss.detach(), metrics, {hf_name(n): p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("case", CASES)
def test_matches_trl_trainer(case, checkpoints, tmp_path):
    kind, trl_settings, objective, settings = CASES[case]
    policy, ref = checkpoints
    batch, want_loss, want_metrics, want_grads = trl_step(_trl_trainer(kind, trl_settings, policy, ref,
                                                                       str(tmp_path)), kind)
    loss, metrics, grads = megaft_step(kind, objective, settings, batch, policy, ref)
    torch.testing.assert_close(loss, want_loss, atol=ATOL, rtol=RTOL)
    names = METRICS + (("nll_loss", "log_odds_ratio", "log_odds_chosen") if objective == "orpo" else ())
    for name in names:
        got = metrics[name].mean()
        torch.testing.assert_close(got, torch.tensor(want_metrics[name]), atol=ATOL, rtol=RTOL,
                                   msg=lambda m, name=name: f"{name}: {m}")
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], atol=ATOL, rtol=RTOL,
                                   msg=lambda m, name=name: f"grad {name}: {m}")
    # the comparison has something to compare: the reward metrics are not all zero or equal
    assert metrics["rewards/margins"].abs().min() > 1e-3
    assert len(set(metrics["logps/chosen"].tolist())) == len(PAIRS["prompt"])


def test_conservative_dpo_is_trl_sigmoid_with_label_smoothing(checkpoints, tmp_path):
    """cDPO: TRL's DPOTrainer loss_type="sigmoid" up to 0.28 smoothed the labels; TRL 1.x
    DPOTrainer ignores label_smoothing there, and keeps that exact expression in
    CPOTrainer.cpo_loss (loss_type="sigmoid"), on policy log-probs: fed the DPO log-ratios it
    is cDPO, loss and gradients."""
    trainer = _trl_trainer("cpo", dict(loss_type="sigmoid", beta=0.5, label_smoothing=0.2, cpo_alpha=0.0),
                           *checkpoints, str(tmp_path))
    gen = torch.Generator().manual_seed(0)
    sums = [(-30 * torch.rand(4, generator=gen)).requires_grad_() for _ in range(4)]
    counts = torch.tensor([3, 7, 1, 12])
    pc, pr, rc, rr = (SequenceLogps(s, counts) for s in sums)
    losses, metrics = preference_loss("dpo", pc, pr, rc, rr, beta=0.5, label_smoothing=0.2)
    grads = torch.autograd.grad(losses.mean(), sums)
    want, want_chosen, want_rejected = trainer.cpo_loss(sums[0] - sums[2], sums[1] - sums[3])
    torch.testing.assert_close(losses, want, atol=0, rtol=1e-6)
    torch.testing.assert_close(grads, torch.autograd.grad(want.mean(), sums), atol=0, rtol=1e-6)
    torch.testing.assert_close(metrics["rewards/chosen"], want_chosen, atol=0, rtol=1e-6)
    torch.testing.assert_close(metrics["rewards/rejected"], want_rejected, atol=0, rtol=1e-6)
    # without smoothing it is plain DPO; with it, another loss
    plain, _ = preference_loss("dpo", pc, pr, rc, rr, beta=0.5)
    assert not torch.allclose(plain, losses)
    torch.testing.assert_close(preference_loss("dpo", pc, pr, rc, rr, beta=0.5, label_smoothing=0.0)[0], plain)


def test_fused_head_logps_equal_the_logits_path(checkpoints):
    """kernels.fused_linear_cross_entropy gives the same per-token log-probs and gradients."""
    policy, _ = checkpoints
    ids = torch.randint(3, 61, (3, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.zeros_like(ids)
    for row, start in enumerate((2, 5, 9)):
        mask[row, start:] = 1
    labels = next_token_labels(ids, mask)
    out = []
    for kernels in (None, KernelsConfig(backend="torch", fused_linear_cross_entropy=True, ce_chunk_tokens=7)):
        model = megaft_model(policy, kernels)
        logps = decoder_token_logps(model, ids, labels)
        logps.sum().backward()
        out.append((logps.detach(), [p.grad for p in model.parameters()]))
    torch.testing.assert_close(out[1][0], out[0][0], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(out[1][1], out[0][1], atol=ATOL, rtol=RTOL)
    seq = sequence_logps(out[0][0], labels)
    assert seq.count.tolist() == [9, 6, 2]  # every completion token (the last prompt token predicts the first)
    assert (out[0][0][labels == -100] == 0).all() and (out[0][0][labels != -100] < 0).all()


def test_next_token_labels():
    ids = torch.tensor([[5, 6, 7, 8, 0], [9, 10, 11, 0, 0]])
    mask = torch.tensor([[0, 0, 1, 1, 0], [0, 1, 1, 0, 0]])
    assert next_token_labels(ids, mask).tolist() == [[-100, 7, 8, -100, -100], [10, 11, -100, -100, -100]]


def test_settings_errors():
    one = SequenceLogps(torch.tensor([-3.0]), torch.tensor([2]))
    cases = [
        (("dpo", one, one), {}, "needs the reference model's log-probs"),
        (("simpo", one, one, one, one), {}, "simpo is reference-free"),
        (("orpo", one, one), {}, "chosen_nll is ORPO's SFT term"),
        (("dpo", one, one, one, one), dict(chosen_nll=one), "chosen_nll is ORPO's SFT term"),
        (("kto", one, one, one, one), {}, "objective 'kto' is unknown"),
    ]
    for args, kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            preference_loss(*args, beta=0.1, **kwargs)
    assert check_preference("robust", beta=0.1, label_smoothing=0.5) == [
        "label_smoothing=0.5: robust DPO needs a flip probability in [0, 0.5)"]
    assert check_preference("ipo", beta=0.0, label_smoothing=0.1) == [
        "beta=0.0 must be > 0 (the objectives divide by it or scale rewards by it)",
        "label_smoothing=0.1 has no meaning for ipo (TRL ignores it); fix: 0, or objective one of dpo, robust, simpo"]
    assert check_preference("orpo", beta=0.1, label_smoothing=0.0) == []


def test_tp2_equals_single_process(checkpoints):
    """Under tp=2 (the vocabulary split, with and without sequence parallel and the fused head)
    the log-probs, the DPO losses and every gradient shard equal the single process's."""
    spawn(2, tp2_rank, *checkpoints)
