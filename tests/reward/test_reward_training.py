"""Reward models end to end (train.objective=reward): megaft-train's Trainer on preference pairs.

- 4 steps equal TRL 1.16's RewardTrainer fed the same pairs in the same order, with margins and
  center_rewards_coefficient: the loss, TRL's accuracy/margin/reward metrics and the grad norm at
  every step, and every trained weight (so every gradient, through Adam) after them;
- the export (RUN_DIR/hf) is a LlamaForSequenceClassification that transformers loads and that
  scores as megaft's own model does, and as TRL's trained model does;
- every layout of LAYOUTS (dp2 ZeRO-1 and ZeRO-3, tp2 with and without sp, pp2, cp2) repeats the
  single process's loss, grad norm, metrics and held-out accuracy at every step (one spawn);
- validation names what a reward run cannot do and the fix.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
import transformers
from models.hf_fixture import checkpoint_tensors, make_hf_llama
from multirank import spawn
from train_cases import read_rows

from megaft.parallel.grid import ParallelGrid
from megaft.training.summary import RunSummary
from megaft.validation import resolve, validate
from reward.reward_cases import (
    COMPARED,
    EXPORTED,
    LAYOUTS,
    eval_pairs_of,
    layout_config,
    layouts_rank,
    make_hf_reward,
    reward_config,
    run,
    write_pairs,
)

pytestmark = pytest.mark.exact  # make test runs these on a pinned CPU code path (docs/contributing.md)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("reward_train")
    ckpt, pairs = str(root / "ckpt"), str(root / "pairs.jsonl")
    make_hf_llama(ckpt, seed=1)
    make_hf_reward(str(root / "rm"), ckpt)
    write_pairs(pairs)
    write_pairs(eval_pairs_of(pairs), n=5, seed=7)
    return ckpt, pairs, root


def _trl_curve(rm: str, pairs: str, order: list[int], steps: int, out: str, cfg):
    """TRL's RewardTrainer on the pairs in `order` (no shuffling), the optimizer settings of `cfg`;
    (its log lines, its trained model)."""
    from datasets import Dataset
    from torch.utils.data import SequentialSampler
    from transformers import PreTrainedTokenizerFast
    from trl import RewardConfig, RewardTrainer

    class InOrder(RewardTrainer):
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

    records = [json.loads(line) for line in open(pairs)]
    data = Dataset.from_list([records[i] for i in order])
    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(rm, "tokenizer.json"), pad_token="<pad>",
                                  eos_token="<eos>", unk_token="<unk>")
    o = cfg.optim
    args = RewardConfig(output_dir=out, report_to="none", use_cpu=True, bf16=False, seed=0,
                        per_device_train_batch_size=cfg.train.global_batch_size, gradient_accumulation_steps=1,
                        max_steps=steps, learning_rate=o.lr, lr_scheduler_type="constant", warmup_steps=0,
                        weight_decay=0.0, adam_beta1=o.beta1, adam_beta2=o.beta2, adam_epsilon=o.eps,
                        max_grad_norm=o.clip_grad, logging_steps=1, save_strategy="no",
                        max_length=cfg.data.seq_len, dataloader_drop_last=False,
                        center_rewards_coefficient=cfg.reward.center_rewards_coefficient)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(rm, dtype=torch.float32,
                                                                            attn_implementation="eager")
    trainer = InOrder(model=model.train(), args=args, train_dataset=data, processing_class=tok)
    trainer.train()
    return [r for r in trainer.state.log_history if "loss" in r], trainer.model.eval()


def _order(cfg, pairs: str, steps: int) -> list[int]:
    """The pairs megaft trains on, in order: a pure function of (seed, step, pair count)."""
    from megaft.pref.batches import PairRows
    from megaft.pref.data import Pair

    n = sum(1 for _ in open(pairs))
    rows = PairRows([Pair([0], [1], [2])] * n, cfg.data.seq_len, cfg.data.seed, pad_id=0)
    return [int(i) for s in range(steps) for i in rows.pair_ids(s, cfg.train.global_batch_size)]


def test_four_steps_equal_trl_and_the_export_scores_as_transformers(inputs, tmp_path):
    ckpt, pairs, root = inputs
    rm, steps = str(root / "rm"), 4
    cfg = reward_config(rm, pairs, steps=steps)
    cfg.train.export_hf = True
    cfg = resolve(cfg)
    assert cfg.model.score_head and not validate(cfg, 1)
    run(cfg, ParallelGrid.single(), str(tmp_path / "megaft"))
    got = [r for r in read_rows(str(tmp_path / "megaft")) if "loss" in r]
    want, trl_model = _trl_curve(rm, pairs, _order(cfg, pairs, steps), steps, str(tmp_path / "trl"), cfg)
    assert len(got) == len(want) == steps
    bad = []
    for g, w in zip(got, want):
        for key in ("loss", "grad_norm", "accuracy", "margin", "mean_reward", "min_reward", "max_reward"):
            # fp32 programs that sum in different orders: 1e-4 relative (the pref tests' bound vs TRL)
            if abs(g[key] - w[key]) > 1e-4 * max(abs(w[key]), 1e-2):
                bad.append(f"step {g['step']} {key}: megaft {g[key]} TRL {w[key]}")
    assert not bad, "\n".join(bad)
    assert len({r["loss"] for r in got}) == steps  # the run learns: the loss moves every step
    # every weight after the steps: each one moved by Adam from its gradients, so each gradient agrees
    exported = checkpoint_tensors(str(tmp_path / "megaft" / "hf"))
    trained = {k: v.detach() for k, v in trl_model.state_dict().items()}
    assert set(exported) == set(trained) and "score.weight" in exported and "lm_head.weight" not in exported
    start = checkpoint_tensors(rm)
    for name, value in trained.items():
        assert not torch.equal(value, start[name]), name  # every tensor trained
        # Adam's steps of lr 1e-2 from gradients that agree to ~1e-6 relative
        torch.testing.assert_close(exported[name], value, rtol=1e-4, atol=1e-5, msg=name)
    _export_scores_as_megaft(str(tmp_path / "megaft" / "hf"), trl_model)


def _export_scores_as_megaft(hf_dir: str, trl_model) -> None:
    """transformers loads the export as a LlamaForSequenceClassification (num_labels 1, the pad id)
    and scores right-padded rows as TRL's trained model does (pad != eos here: transformers' own
    search for the last non-pad token is right)."""
    config = json.load(open(os.path.join(hf_dir, "config.json")))
    assert config["architectures"] == ["LlamaForSequenceClassification"] and config["num_labels"] == 1
    model = transformers.AutoModelForSequenceClassification.from_pretrained(hf_dir, dtype=torch.float32,
                                                                            attn_implementation="eager").eval()
    assert type(model).__name__ == "LlamaForSequenceClassification" and model.config.pad_token_id == 0
    ids = torch.tensor([[5, 9, 13, 22, 1, 0, 0], [7, 8, 30, 31, 40, 41, 1]])
    mask = (ids != 0).long()
    with torch.no_grad():
        got, want = model(ids, attention_mask=mask).logits, trl_model(ids, attention_mask=mask).logits
    assert got.shape == (2, 1)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_every_layout_equals_the_single_process(inputs):
    ckpt, pairs, root = inputs
    spawn(2, layouts_rank, ckpt, pairs, str(root / "layouts"))
    failures = []
    for name in LAYOUTS:
        single = root / "single" / name
        run(layout_config(ckpt, pairs, name, single=True), ParallelGrid.single(), str(single))
        want, got = read_rows(str(single)), read_rows(str(root / "layouts" / name))
        assert len(got) == len(want), name
        losses = [r["loss"] for r in want if "loss" in r]
        assert len(set(losses)) == len(losses) == 3, name  # the run learns
        assert len([r for r in want if "eval_accuracy" in r]) == 3, name  # evaluated at steps 0, 2 and 3
        for g, w in zip(got, want):
            for key in COMPARED:
                if key not in w:
                    continue
                # the layouts reorder fp32 sums: the pref tests' 5e-5 after Adam's updates, relative to
                # the quantity or to the rewards' scale (a margin of two rewards of about 1)
                scale = max(abs(w[key]), abs(w.get("mean_reward", w.get("eval_mean_reward", 0.0))), 1e-1)
                if key not in g or abs(g[key] - w[key]) > 5e-5 * scale:
                    failures.append(f"{name} step {w['step']} {key}: layout {g.get(key)} single {w[key]}")
        if name in EXPORTED:  # the layout's export (pp: each stage's files; tp: gathered shards) is the single's
            got_hf = checkpoint_tensors(str(root / "layouts" / name / "hf"))
            want_hf = checkpoint_tensors(str(single / "hf"))
            assert set(got_hf) == set(want_hf) and "score.weight" in got_hf and "lm_head.weight" not in got_hf, name
            for key, value in want_hf.items():
                # 3 Adam steps of lr 1e-2 from gradients equal to the layouts' rounding (5e-5 relative)
                torch.testing.assert_close(got_hf[key], value, rtol=1e-4, atol=1e-5, msg=f"{name} {key}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("change, problem", [
    (dict(packing="docs"), "fix: data.packing=none"),
    (dict(lora=4), "fix: lora.rank=0"),
    (dict(fused=True), "fix: kernels.fused_linear_cross_entropy=false"),
    (dict(sample_every=5), "fix: train.sample_every=0"),
    (dict(center=-1.0), "reward.center_rewards_coefficient=-1.0 must be >= 0"),
    (dict(objective="dpo", center=0.01), "is read by train.objective=reward only"),
    (dict(objective="sft", score_head=True), "fix: model.score_head=false or train.objective=reward"),
    (dict(no_file=True), "fix: data.path=PAIRS.jsonl"),
    (dict(then_eval=True), "fix: eval.pairs=HELD_OUT.jsonl (its pairwise accuracy) and eval.tasks=[]"),
    (dict(then_eval=True, pairs=True, tasks=["megaft_arith"]), "eval.pairs scores a reward model and eval.tasks"),
])
def test_validation_names_the_problem_and_the_fix(inputs, change, problem):
    ckpt, pairs, _ = inputs
    cfg = reward_config(ckpt, pairs)
    cfg.train.objective = change.get("objective", "reward")
    cfg.reward.center_rewards_coefficient = change.get("center")
    cfg.data.packing = change.get("packing", cfg.data.packing)
    cfg.lora.rank = change.get("lora", 0)
    cfg.kernels.fused_linear_cross_entropy = change.get("fused", False)
    cfg.train.sample_every = change.get("sample_every", 0)
    cfg.model.score_head = change.get("score_head", False)
    if change.get("no_file"):
        cfg.data.path = None
    if change.get("then_eval"):
        cfg.train.then_eval, cfg.train.export_hf = True, True
    cfg.eval.pairs = eval_pairs_of(pairs) if change.get("pairs") else None
    cfg.eval.tasks = change.get("tasks", [])
    problems = validate(cfg, 1)
    assert any(problem in p for p in problems), problems
    clean = reward_config(ckpt, pairs)
    assert not validate(clean, 1)  # the same config without the change is valid
    clean.train.then_eval, clean.train.export_hf, clean.eval.pairs = True, True, eval_pairs_of(pairs)
    assert not validate(clean, 1)  # then_eval with eval.pairs: megaft-eval's pairwise accuracy after the run


def test_a_mixture_of_experts_is_refused():
    from megaft.config.reward import check_reward_run

    problems = check_reward_run("reward", has_file=True, packing="none", n_experts=4, lora_rank=0,
                                fused_linear_cross_entropy=False)
    assert any("fix: a dense model" in p for p in problems), problems


def test_margins_must_be_numbers_on_every_pair_or_none(tmp_path):
    from megaft.data.errors import DataError
    from megaft.reward.margins import read_margins

    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "a", "chosen": "b", "rejected": "c", "margin": 0.5}\n'
                    '{"prompt": "a", "chosen": "d", "rejected": "c", "margin": 2}\n')
    assert read_margins([str(good)]).tolist() == [0.5, 2.0]
    none = tmp_path / "none.jsonl"
    none.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n')
    assert read_margins([str(none)]) is None
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(good.read_text() + '{"prompt": "a", "chosen": "e", "rejected": "c"}\n')
    with pytest.raises(DataError, match=r"mixed.jsonl:3: the pair has no 'margin' and others have one"):
        read_margins([str(mixed)])
    text = tmp_path / "text.jsonl"
    text.write_text('{"prompt": "a", "chosen": "b", "rejected": "c", "margin": "big"}\n')
    with pytest.raises(DataError, match=r"text.jsonl:1: 'margin' is 'big', not a finite number"):
        read_margins([str(text)])


def test_megaft_eval_reports_the_pairwise_accuracy_megaft_train_measures(inputs, tmp_path, capsys):
    """megaft-eval HF_DIR eval.pairs=FILE (transformers' class, the mask's last token) gives the held-out
    accuracy and margin that megaft-train's step-0 eval measures on the same pairs with its own model."""
    from megaft.eval.cli import main

    ckpt, pairs, root = inputs
    rm, held_out = str(root / "rm"), eval_pairs_of(pairs)
    cfg = reward_config(rm, pairs, steps=1)
    cfg.data.eval_path, cfg.train.export_hf, cfg.train.save_final = held_out, False, True
    run(resolve(cfg), ParallelGrid.single(), str(tmp_path / "run"))
    first = next(r for r in read_rows(str(tmp_path / "run")) if "eval_accuracy" in r and r["step"] == 0)
    assert main([rm, f"eval.pairs={held_out}", "eval.device=cpu", "eval.batch_size=2"]) == 0
    assert "accuracy" in capsys.readouterr().out
    got = json.load(open(os.path.join(rm, "eval", "results.json")))["results"]["pairwise"]
    assert got["pairs"] == 5
    assert abs(got["accuracy"] - first["eval_accuracy"]) < 1e-9 and 0 < got["accuracy"] < 1
    assert abs(got["margin"] - first["eval_margin"]) < 1e-5 * max(abs(first["eval_margin"]), 1.0)
    last = [r for r in read_rows(str(tmp_path / "run")) if "eval_accuracy" in r][-1]
    assert RunSummary.read(str(tmp_path / "run")).eval_accuracy == last["eval_accuracy"]  # summary.json has it
    # the run dir itself: megaft-eval exports its last checkpoint (no hf/ written) and scores the trained model
    assert not os.path.exists(tmp_path / "run" / "hf")
    assert main([str(tmp_path / "run"), f"eval.pairs={held_out}", "eval.device=cpu"]) == 0
    trained = json.load(open(tmp_path / "run" / "eval" / "results.json"))["results"]["pairwise"]
    assert abs(trained["accuracy"] - last["eval_accuracy"]) < 1e-9
    assert abs(trained["margin"] - last["eval_margin"]) < 1e-5 * max(abs(last["eval_margin"]), 1.0)
    # a causal LM is not a reward model: refused with the fix
    assert main([ckpt, f"eval.pairs={held_out}", "eval.device=cpu"]) == 2
    assert "is not a reward model" in capsys.readouterr().err


def test_tied_embeddings_train_the_body_and_export_no_lm_head(tmp_path, caplog):
    """A checkpoint with tie_word_embeddings: the reward model has no LM head to tie, says so, trains,
    and its export loads in transformers with the scores of megaft's own model."""
    from megaft.models.decoder import Decoder
    from megaft.models.hf.config import hf_model_config
    from megaft.models.hf.load import load_hf_weights
    from megaft.reward.losses import length_mask, sequence_rewards

    ckpt, pairs = str(tmp_path / "tied"), str(tmp_path / "pairs.jsonl")
    make_hf_llama(ckpt, seed=3, tie=True)
    write_pairs(pairs, margins=False)
    cfg = reward_config(ckpt, pairs, steps=2)
    cfg.train.export_hf = True
    cfg = resolve(cfg)
    assert cfg.model.tie_embeddings and not validate(cfg, 1)
    with caplog.at_level("WARNING"):
        run(cfg, ParallelGrid.single(), str(tmp_path / "run"))
    assert any("a reward model has no LM head, so nothing is tied" in r.getMessage() for r in caplog.records)
    hf_dir = str(tmp_path / "run" / "hf")
    tensors = checkpoint_tensors(hf_dir)
    assert "lm_head.weight" not in tensors and "score.weight" in tensors
    assert not torch.equal(tensors["model.embed_tokens.weight"], checkpoint_tensors(ckpt)["model.embed_tokens.weight"])
    mcfg = hf_model_config(hf_dir)
    mcfg.score_head = True
    ours = Decoder(mcfg)
    load_hf_weights(ours, hf_dir, tp_rank=0, tp_size=1)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(hf_dir, dtype=torch.float32,
                                                                         attn_implementation="eager").eval()
    ids = torch.tensor([[5, 9, 13, 22, 1, 0], [7, 8, 30, 31, 40, 1]])
    with torch.no_grad():
        want = hf(ids, attention_mask=(ids != 0).long()).logits[:, 0]
        got = sequence_rewards(ours.eval()(ids), length_mask(torch.tensor([5, 6]), 6))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_resume_equals_no_interruption(inputs, tmp_path):
    """Stopped after step 2 and resumed from its checkpoint (the new score head included): the pairs
    come in the same order and step 3 is the uninterrupted run's, bit for bit."""
    from megaft.training.loop import Trainer

    ckpt, pairs, _ = inputs
    cfg = resolve(reward_config(ckpt, pairs, steps=3))
    cfg.train.save_every = 1
    run(cfg, ParallelGrid.single(), str(tmp_path / "whole"))
    os.makedirs(tmp_path / "cut")
    Trainer(cfg, ParallelGrid.single(), str(tmp_path / "cut")).fit(stop_after=2)
    Trainer(cfg, ParallelGrid.single(), str(tmp_path / "cut")).fit()
    whole = [r for r in read_rows(str(tmp_path / "whole")) if "loss" in r]
    cut = [r for r in read_rows(str(tmp_path / "cut")) if "loss" in r]
    assert [r["step"] for r in cut] == [1, 2, 3]
    for key in ("loss", "grad_norm", "accuracy", "margin", "mean_reward"):
        assert cut[-1][key] == whole[-1][key], key


def test_every_gradient_equals_trls_compute_loss(inputs, tmp_path):
    """One batch as TRL's RewardTrainer collates it (chosen rows then rejected, right-padded, margins):
    TRL's own compute_loss on transformers' model and megaft's loss on its Decoder give the same loss
    and the same gradient of every weight (by HF name), the score head's included."""
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast
    from trl import RewardConfig, RewardTrainer

    from megaft.models.decoder import Decoder
    from megaft.models.hf.config import hf_model_config
    from megaft.models.hf.export import hf_tensors
    from megaft.models.hf.load import load_hf_weights
    from megaft.reward.losses import last_token_mask, reward_loss, sequence_rewards

    _, pairs, root = inputs
    rm = str(root / "rm")
    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(rm, "tokenizer.json"), pad_token="<pad>",
                                  eos_token="<eos>", unk_token="<unk>")
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(rm, dtype=torch.float32,
                                                                         attn_implementation="eager")
    args = RewardConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False,
                        center_rewards_coefficient=0.01, max_length=None)
    data = Dataset.from_list([json.loads(line) for line in open(pairs)][:4])
    trainer = RewardTrainer(model=hf, args=args, train_dataset=data, processing_class=tok)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    assert "margin" in batch and (batch["attention_mask"] == 0).any()  # margins and padding both exercised
    hf.train()
    want_loss = trainer.compute_loss(hf, dict(batch))
    want_loss.backward()

    cfg = hf_model_config(rm)
    cfg.score_head = True
    ours = Decoder(cfg)
    load_hf_weights(ours, rm, tp_rank=0, tp_size=1)
    rewards = sequence_rewards(ours(batch["input_ids"]), last_token_mask(batch["attention_mask"]))
    losses, _ = reward_loss(*rewards.chunk(2), batch["margin"], 0.01)
    loss = losses.mean()
    loss.backward()
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-7)
    want = {n: p.grad for n, p in hf.named_parameters()}
    got = {k: v for n, p in ours.named_parameters() for k, v in hf_tensors(n, p.grad, cfg).items()}
    assert set(got) == set(want) and "score.weight" in got
    for name, grad in want.items():
        assert grad.abs().max() > 0, name
        # the same fp32 math in two programs: sums in other orders (a few ulps of the largest element)
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-6 * float(grad.abs().max()), msg=name)
