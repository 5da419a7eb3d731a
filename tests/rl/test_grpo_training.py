"""GRPO on logged rollouts end to end (train.objective=grpo rl.rollouts=FILE): megaft-train's Trainer.

- every layout of LAYOUTS (dp with ZeRO-3 and accumulation, tp with sp, cp, pp; dapo, grpo,
  dr_grpo, bnpo) repeats the single process's loss, grad norm and TRL metrics at every step
  (one spawn of 2 ranks runs them all);
- the first step equals TRL's GRPOTrainer fed the same rollouts (loss and grad norm) for every
  loss_type;
- validation names what a GRPO run cannot do yet and the fix.
"""
from __future__ import annotations

import json
from typing import Optional

import pytest
import torch
from models.hf_fixture import VOCAB, make_hf_llama
from models.moe_fixture import make_hf_moe
from multirank import spawn
from rl.grpo_cases import (
    BETA,
    LAYOUTS,
    G,
    grpo_config,
    kl_config,
    layouts_rank,
    moe_of,
    reference_of,
    run,
    single_name,
    write_rollouts,
)
from train_cases import read_rows

from megaft.config.rl import LOSS_TYPES
from megaft.parallel.grid import ParallelGrid
from megaft.validation import resolve, validate

pytestmark = pytest.mark.exact  # make test runs these on a pinned CPU code path (docs/contributing.md)
COMPARED = ("loss", "grad_norm", "reward", "reward_std", "clip_ratio/region_mean", "entropy", "completions/mean_length",
            "completions/max_length", "completions/clipped_ratio")
KL_COMPARED = COMPARED + ("kl",)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo_train")
    ckpt, rollouts = str(root / "ckpt"), str(root / "rollouts.jsonl")
    make_hf_llama(ckpt, seed=1)
    make_hf_llama(reference_of(ckpt), seed=4)
    make_hf_moe(moe_of(ckpt), "mixtral", seed=3, sliding_window=None)
    write_rollouts(rollouts, VOCAB)
    return ckpt, rollouts, root


@pytest.fixture(scope="module")
def singles(inputs):
    ckpt, rollouts, root = inputs
    for loss_type in LOSS_TYPES:
        run(resolve(grpo_config(ckpt, rollouts, loss_type)), ParallelGrid.single(), str(root / f"single_{loss_type}"))
    for name in sorted({single_name(n) for n in LAYOUTS} - {f"single_{t}" for t in LOSS_TYPES}):
        loss_type, kl = next((t, name[len(f"single_{t}"):]) for t in sorted(LOSS_TYPES, key=len, reverse=True)
                             if name.startswith(f"single_{t}"))
        # a mixture of experts' aux loss is per micro-batch: the single process takes the dp layout's ones
        moe = kl.endswith("_moe")
        cfg = kl_config(moe_of(ckpt) if moe else ckpt, rollouts, loss_type, kl.removesuffix("_moe"),
                        micro=2 if moe else 4)
        run(resolve(cfg), ParallelGrid.single(), str(root / name))
    return root


@pytest.fixture(scope="module")
def layouts(inputs, singles):
    ckpt, rollouts, root = inputs
    spawn(2, layouts_rank, ckpt, rollouts, str(root / "layouts"))
    return root / "layouts"


def _lines(run_dir) -> list[dict]:
    return [r for r in read_rows(str(run_dir)) if "loss" in r]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layout_equals_the_single_process(inputs, singles, layouts, name):
    want, got = _lines(singles / single_name(name)), _lines(layouts / name)
    assert len(got) == len(want) == 3
    for step, (g, w) in enumerate(zip(got, want), start=1):
        for key in (KL_COMPARED if "_kl" in name else COMPARED) + (("aux_loss",) if "_moe" in name else ()):
            # fp32: a layout reorders the sums of log-probs (O(10)) and of the gradient
            assert g[key] == pytest.approx(w[key], rel=2e-5, abs=1e-6), f"{name} step {step} {key}: {g[key]}, {w[key]}"
    assert want[0]["loss"] != want[1]["loss"]  # the weights moved: later steps compare trained models


def test_loss_types_differ(singles):
    """grpo, dr_grpo and dapo give three gradients here (unequal completion lengths), so each layout's
    equality is not vacuous; bnpo is dapo in one process (both the global token mean). On-policy,
    grpo's loss is 0 up to rounding (each group's advantages sum to 0): its gradient norm carries it."""
    first = {t: _lines(singles / f"single_{t}")[0] for t in LOSS_TYPES}
    norms = {t: round(first[t]["grad_norm"], 6) for t in ("grpo", "dr_grpo", "dapo")}
    assert len(set(norms.values())) == 3, norms
    assert first["bnpo"]["loss"] == first["dapo"]["loss"] and first["bnpo"]["grad_norm"] == first["dapo"]["grad_norm"]
    assert abs(first["grpo"]["loss"]) < 1e-6 < abs(first["dapo"]["loss"])


def trl_first_step(model_dir: str, groups: list[dict], out_dir: str, *, loss_type: str = "dapo", beta: float = 0.0,
                   reference: Optional[str] = None, temperature: float = 1.0):
    """TRL's GRPOTrainer on `model_dir`, fed `groups` through its rollout_func with a reward function
    returning their logged rewards, one micro-batch: (its first loss, the gradient norm, the trainer)."""
    trl = pytest.importorskip("trl", reason="TRL is the reference (requirements.txt installs it)")
    from datasets import Dataset
    from transformers import AutoTokenizer, LlamaForCausalLM

    rewards = {tuple(c): r for g in groups for c, r in zip(g["completion_ids"], g["rewards"])}

    def logged(completions, completion_ids, **kwargs):
        return [rewards[tuple(ids)] for ids in completion_ids]

    def rollout(prompts, trainer):
        return {"prompt_ids": [g["prompt_ids"] for g in groups for _ in range(G)],
                "completion_ids": [c for g in groups for c in g["completion_ids"]],
                "logprobs": [[0.0] * len(c) for g in groups for c in g["completion_ids"]]}

    tok = AutoTokenizer.from_pretrained(model_dir)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token or tok.convert_ids_to_tokens(0)
    n = len(groups) * G
    args = trl.GRPOConfig(output_dir=out_dir, per_device_train_batch_size=n, num_generations=G,
                          max_completion_length=8, beta=beta, epsilon_high=0.28, temperature=temperature,
                          loss_type=loss_type, report_to=[], use_cpu=True, bf16=False,
                          model_init_kwargs={"dtype": torch.float32, "attn_implementation": "eager"})
    trainer = trl.GRPOTrainer(model=model_dir, reward_funcs=logged, args=args, processing_class=tok,
                              train_dataset=Dataset.from_dict({"prompt": ["x"] * len(groups)}), rollout_func=rollout)
    if reference:  # TRL builds its ref_model from the policy's checkpoint: give it rl.reference's weights
        trainer.ref_model.load_state_dict(LlamaForCausalLM.from_pretrained(reference, dtype=torch.float32).state_dict())
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    out = trainer._generate_and_score_completions([{"prompt": "x"}] * n)
    loss = trainer._compute_loss(trainer.model, out)
    loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in trainer.model.parameters()
                                                 if p.grad is not None]))
    return float(loss), float(norm), trainer


@pytest.mark.parametrize("loss_type, kl, temperature", [(t, "", 1.0) for t in LOSS_TYPES] + [
    ("dapo", "_kl_ref", 1.0), ("grpo", "_kl_ref", 1.0), ("dapo", "_kl_ref", 0.7)])
def test_first_step_equals_trl(inputs, singles, loss_type, kl, temperature):
    """TRL's GRPOTrainer on the same checkpoint, fed step 1's two groups through its rollout_func,
    with a reward function returning the logged rewards: its loss and gradient norm are megaft's;
    with the KL term against rl.reference's checkpoint (TRL's ref_model given its weights) its kl too;
    at rl.temperature 0.7 both take the log-probs of logits / 0.7 (the policy's and the reference's)."""
    ckpt, rollouts, root = inputs
    groups = [json.loads(line) for line in open(rollouts)][:2]
    loss, norm, trainer = trl_first_step(ckpt, groups, str(root / f"trl_{loss_type}"), loss_type=loss_type,
                                         beta=BETA if kl else 0.0, reference=reference_of(ckpt) if kl else None,
                                         temperature=temperature)
    name = f"single_{loss_type}{kl}"
    if temperature != 1.0:  # one step of its own
        name += f"_t{temperature}"
        cfg = kl_config(ckpt, rollouts, loss_type, kl)
        cfg.rl.temperature, cfg.train.max_steps = temperature, 1
        run(resolve(cfg), ParallelGrid.single(), str(singles / name))
    first = _lines(singles / name)[0]
    # abs: grpo's on-policy loss is 0 up to the rounding of O(1) terms
    assert first["loss"] == pytest.approx(loss, rel=1e-5, abs=1e-6), (first["loss"], loss)
    assert first["grad_norm"] == pytest.approx(norm, rel=1e-4)
    assert first["reward"] == pytest.approx(trainer._metrics["train"]["reward"][-1], rel=1e-6)
    assert first["entropy"] == pytest.approx(trainer._metrics["train"]["entropy"][-1], rel=1e-5)
    lengths = {k: v[-1] for k, v in trainer._metrics["train"].items() if k.startswith("completions/")}
    assert len(lengths) == 7 and all(first[k] == v for k, v in lengths.items()), (lengths, first)
    if kl:
        assert first["kl"] == pytest.approx(trainer._metrics["train"]["kl"][-1], rel=1e-5) and first["kl"] > 1e-3


def test_a_mixture_of_experts_equals_trl_with_its_aux_loss(inputs, tmp_path):
    """Mixtral (4 experts, top-2, router_aux_loss_coef 0.02): TRL's GRPOTrainer adds coef x
    transformers' load-balancing loss over the micro-batch's tokens (prompt and completion, not the
    padding); megaft's loss line is the policy loss and aux_loss its own line, so TRL's loss is
    megaft's loss + coef x aux_loss, and the gradient norms are equal. One micro-batch, as TRL's."""
    ckpt, rollouts, _ = inputs
    moe = moe_of(ckpt)
    cfg = grpo_config(moe, rollouts, "dapo", steps=1, micro=2 * G)
    run(resolve(cfg), ParallelGrid.single(), str(tmp_path / "megaft"))
    got = _lines(tmp_path / "megaft")[0]
    groups = [json.loads(line) for line in open(rollouts)][:2]
    loss, norm, trainer = trl_first_step(moe, groups, str(tmp_path / "trl"))
    assert trainer.aux_loss_enabled and got["aux_loss"] > 0
    assert got["aux_loss"] == pytest.approx(trainer._metrics["train"]["aux_loss"][-1], rel=1e-5)
    assert got["loss"] + 0.02 * got["aux_loss"] == pytest.approx(loss, rel=1e-5, abs=1e-6)
    assert got["grad_norm"] == pytest.approx(norm, rel=1e-4)


def test_validation_names_what_grpo_cannot_do_yet(inputs, tmp_path):
    ckpt, rollouts, _ = inputs
    cfg = grpo_config(ckpt, rollouts)
    assert validate(cfg, 1) == []
    cases = [
        (dict(rollouts=None), "neither rl.rollouts nor rl.prompts is set"),
        (dict(prompts=rollouts), "rl.rollouts and rl.prompts are both set"),
        (dict(rollouts=None, prompts=rollouts), "generated completions need reward functions"),
        (dict(beta=0.04, reference="/no/such/ckpt"), "rl.reference=/no/such/ckpt is not a Hugging Face checkpoint"),
        (dict(reference="/no/such/ckpt"), "is read by the KL term only, and rl.beta=0"),
        (dict(temperature=0.0), "rl.temperature=0.0 must be > 0"),
        (dict(num_generations=3), "is not whole groups of rl.num_generations=3"),
        (dict(loss_type="cispo"), "rl.loss_type='cispo' is unknown"),
        (dict(scale_rewards="std"), "rl.scale_rewards='std' is unknown"),
    ]
    for change, message in cases:
        bad = grpo_config(ckpt, rollouts)
        for k, v in change.items():
            setattr(bad.rl, k, v)
        problems = validate(bad, 1)
        assert any(message in p for p in problems), (change, problems)
    broken = tmp_path / "broken.jsonl"
    lines = open(rollouts).read().splitlines()
    record = json.loads(lines[1])
    record["completion_ids"][0] = list(range(20))  # longer than rl.max_completion_length=8
    broken.write_text("\n".join([lines[0], json.dumps(record), "{not json"]) + "\n")
    problems = validate(grpo_config(ckpt, str(broken)), 1)
    assert any(f"{broken}:2: completion 0 has 20 tokens > rl.max_completion_length=8" in p for p in problems), problems
    assert any(f"{broken}:3:" in p for p in problems), problems
    sft = grpo_config(ckpt, rollouts)
    sft.train.objective = "sft"
    assert any("rl.rollouts=" in p and "train.objective=grpo only" in p for p in validate(sft, 1))


def test_rollout_rows_put_labels_on_the_completion_only(inputs):
    from megaft.rl.rollouts import group_rows, logged_rewards, read_rollouts

    _, rollouts, _ = inputs
    groups = read_rollouts(rollouts, G, 8, 16)
    inputs_, labels = group_rows(groups[:1], 16, 0)
    g = groups[0]
    for row, completion in enumerate(g.completion_ids):
        ids = g.prompt_ids + completion
        assert inputs_[row, :len(ids)].tolist() == ids
        targets = labels[row][labels[row] != -100].tolist()
        assert targets == completion  # every completion token is predicted once, no prompt token
    assert logged_rewards(groups[:1]).squeeze(1).tolist() == g.rewards


def test_a_resumed_run_repeats_the_uninterrupted_one(inputs, singles, tmp_path):
    """Stopped after step 2 (its checkpoint) and resumed to step 3: the same rollouts (a pure
    function of the step), the same moments, the same step 3 as the uninterrupted single run."""
    ckpt, rollouts, _ = inputs
    run_dir = str(tmp_path / "resumed")
    first = grpo_config(ckpt, rollouts, "dapo", steps=2)
    first.train.save_every = 2
    run(resolve(first), ParallelGrid.single(), run_dir)
    again = grpo_config(ckpt, rollouts, "dapo", steps=3)
    again.train.save_every = 2
    run(resolve(again), ParallelGrid.single(), run_dir)
    got, want = _lines(run_dir), _lines(singles / "single_dapo")
    assert [line["step"] for line in got] == [1, 2, 3]
    for key in COMPARED:
        assert got[2][key] == want[2][key], key  # one process, the same operations: bit for bit


def test_megaft_report_plots_the_reward(singles, tmp_path, monkeypatch):
    """megaft-report on two GRPO runs: curves.png gains a reward panel, whose points (curves.json
    and the PNG's text chunk) are each run's metrics.jsonl rewards (tests/test_report.py: an SFT
    sweep's have no reward)."""
    import shutil

    from test_report import png_text

    from megaft import report
    from megaft.report.curves import PNG_KEY

    sweep = tmp_path / "sweep"
    for i, name in enumerate(("single_dapo", "single_grpo")):
        shutil.copytree(singles / name, sweep / str(i))
    monkeypatch.setattr(report.status, "squeue_states", lambda: None)
    assert report.main([str(sweep)]) == 0
    stored = json.loads((sweep / "curves.json").read_text())
    assert json.loads(dict(png_text(sweep / "curves.png"))[PNG_KEY]) == stored
    for curve in stored["runs"]:
        lines = [json.loads(x) for x in (sweep / curve["run"] / "metrics.jsonl").read_text().splitlines()]
        assert curve["reward"] == [[m["step"], m["reward"]] for m in lines if "reward" in m]
        assert len(curve["reward"]) == 3
