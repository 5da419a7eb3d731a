"""train.objective=distill against TRL 1.16: 2 steps of megaft's Trainer (2 micro-batches of 2 sequences a
step, so the accumulation's reduction is tested) equal a plain torch loop over the same batches through
transformers' models with TRL's own loss, GKDTrainer.generalized_jsd_loss(student, teacher, labels, beta,
temperature, num_items_in_batch = the global batch's target tokens): the off-policy GKD step (lmbda = 0,
seq_kd off) with the gradient-accumulation-correct reduction. GKDTrainer itself is not driven: its
compute_loss passes no temperature to the loss (so T is always 1 there) and it pads and shuffles its own
batches; the loss function is the definition compared. The same loop checks distill.alpha's cross-entropy
mix. Compared at each step: the loss and the grad norm, and after them every trained weight (so the
gradients, through AdamW)."""
from __future__ import annotations

import pytest
import torch
import transformers
from models.hf_fixture import checkpoint_tensors, make_hf_llama
from train_cases import read_rows

from distill.distill_cases import distill_config, write_sft
from megaft.parallel.grid import ParallelGrid
from megaft.training.loop import Trainer
from megaft.validation import resolve

trl_gkd = pytest.importorskip("trl.experimental.gkd.gkd_trainer")
STEPS = 2


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill_trl")
    ckpt, teacher, data = str(root / "student"), str(root / "teacher"), str(root / "sft.jsonl")
    make_hf_llama(ckpt, seed=1)
    make_hf_llama(teacher, seed=2)
    write_sft(data)
    return ckpt, teacher, data, root


def _reference(cfg, batches):
    """(losses, grad norms, trained weights) of the torch loop with TRL's loss on `batches`."""
    load = lambda p: transformers.LlamaForCausalLM.from_pretrained(  # noqa: E731
        p, dtype=torch.float32, attn_implementation="eager")
    student, teacher = load(cfg.model.init_from).train(), load(cfg.distill.teacher).eval()
    o, d = cfg.optim, cfg.distill
    opt = torch.optim.AdamW(student.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=0.0)
    losses, norms = [], []
    for inputs, labels in batches:
        n = (labels != -100).sum()
        total = 0.0
        for ids, lab in zip(inputs.split(cfg.train.micro_batch_size), labels.split(cfg.train.micro_batch_size)):
            with torch.no_grad():
                t = teacher(ids).logits
            s = student(ids).logits
            loss = trl_gkd.GKDTrainer.generalized_jsd_loss(s, t, lab, beta=d.beta, temperature=d.temperature,
                                                          num_items_in_batch=n)
            if d.alpha:
                ce = torch.nn.functional.cross_entropy(s.flatten(0, 1), lab.flatten(), reduction="sum") / n
                loss = (1 - d.alpha) * loss + d.alpha * ce
            loss.backward()
            total += loss.item()
        norms.append(torch.nn.utils.clip_grad_norm_(student.parameters(), o.clip_grad).item())
        losses.append(total)
        opt.step()
        opt.zero_grad()
    return losses, norms, {k: v.detach() for k, v in student.state_dict().items()}


@pytest.mark.parametrize("beta,temperature,alpha", [(0.0, 1.0, 0.0), (0.5, 2.0, 0.0), (1.0, 2.0, 0.0),
                                                    (0.5, 1.0, 0.3)])
def test_two_steps_equal_trl(inputs, beta, temperature, alpha):
    ckpt, teacher, data, root = inputs
    cfg = distill_config(ckpt, teacher, data, beta=beta, temperature=temperature, alpha=alpha, steps=STEPS)
    cfg.distill.loss = {0.0: "forward_kl", 1.0: "reverse_kl"}.get(beta, "jsd")
    cfg.train.export_hf = True
    cfg = resolve(cfg)
    run_dir = root / f"run_{beta}_{temperature}_{alpha}"
    run_dir.mkdir()
    trainer = Trainer(cfg, ParallelGrid.single(), str(run_dir))
    batches = [trainer.parts.data.global_batch(step, cfg.train.global_batch_size)[:2] for step in range(STEPS)]
    trainer.fit()
    rows = [r for r in read_rows(str(run_dir)) if "loss" in r]
    losses, norms, weights = _reference(cfg, batches)
    assert len(rows) == STEPS and losses[0] > 1e-3 and losses[0] != losses[1]
    for row, loss, norm in zip(rows, losses, norms):
        # fp32 sums in another order (megaft's vocab slices and chunks, HF's eager attention): relative 1e-5
        assert row["loss"] == pytest.approx(loss, rel=1e-5), (row, loss)
        assert row["grad_norm"] == pytest.approx(norm, rel=1e-5), (row, norm)
    got = checkpoint_tensors(str(run_dir / "hf"))
    moved = 0
    for name, want in weights.items():
        if name in got:
            torch.testing.assert_close(got[name], want, rtol=1e-4, atol=1e-5, msg=name)  # after 2 Adam updates
            moved += 1
    assert moved >= 10
