"""rl.num_iterations (mu), rl.mask_truncated_completions and rl.top_p end to end (megaft-train's
Trainer), each against TRL 1.16's GRPOTrainer where it defines them and at a layout against the
single process (one spawn of 2 ranks runs every layout).

- mu = 2: steps 2k+1 and 2k+2 train on one generation's groups; the second step's loss, gradient
  norm and clip ratios equal TRL's `_compute_loss` (num_iterations=2, its old log-probs computed
  from the generating weights) on megaft's weights after the first step; dp2 ZeRO-3 with
  accumulation, pp2 and online generation at dp2 repeat the single process; an online run equals
  the replay of its logged rollouts; a run resumed inside a generation (its old log-probs and groups
  read back from RUN_DIR/rl_state) repeats the uninterrupted one bit for bit (and at dp2 ZeRO-3 the
  single process), and without the file or at another layout is refused with the fix;
- mask_truncated_completions: the first step equals TRL's with mask_truncated_completions=True
  (loss, gradient norm, entropy) and differs from the unmasked one; cp2 repeats it;
- top_p = 0.7: tp2 with sequence parallelism draws the single process's completions, which differ
  from top_p = 1's.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from models.hf_fixture import VOCAB, make_hf_llama
from multirank import spawn
from rl.grpo_cases import G, run, write_prompts
from rl.grpo_settings_cases import LAYOUTS, SINGLES, settings_config, settings_rank, write_ended_rollouts
from train_cases import read_rows

from megaft.parallel.grid import ParallelGrid
from megaft.rl.iterations import Generation
from megaft.training.loop import Trainer
from megaft.validation import resolve, validate

pytestmark = pytest.mark.exact  # make test runs these on a pinned CPU code path (docs/contributing.md)
COMPARED = ("loss", "grad_norm", "reward", "reward_std", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean",
            "clip_ratio/region_mean")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo_settings")
    ckpt, rollouts, prompts = str(root / "ckpt"), str(root / "rollouts.jsonl"), str(root / "prompts.jsonl")
    make_hf_llama(ckpt, seed=1)
    write_ended_rollouts(rollouts, VOCAB)
    write_prompts(prompts)
    for what in SINGLES:
        run(resolve(settings_config(ckpt, rollouts, prompts, what)), ParallelGrid.single(), str(root / what))
    return ckpt, rollouts, prompts, root


@pytest.fixture(scope="module")
def layouts(inputs):
    ckpt, rollouts, prompts, root = inputs
    spawn(2, settings_rank, ckpt, rollouts, prompts, str(root / "layouts"))
    return root / "layouts"


def _lines(run_dir) -> list[dict]:
    return [r for r in read_rows(str(run_dir)) if "loss" in r]


def _jsonl(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layout_equals_the_single_process(inputs, layouts, name):
    root = inputs[3]
    single = root / LAYOUTS[name][0]
    want, got = _lines(single), _lines(layouts / name)
    assert [line["step"] for line in got] == [line["step"] for line in want]
    for g, w in zip(got, want):
        for key in COMPARED:
            # fp32: a layout reorders the sums of log-probs (O(10)) and of the gradient
            assert g[key] == pytest.approx(w[key], rel=2e-5, abs=1e-6), (name, g["step"], key, g[key], w[key])
    if os.path.exists(single / "rollouts.jsonl"):  # online: the same draws at the layout
        assert _jsonl(layouts / name / "rollouts.jsonl") == _jsonl(single / "rollouts.jsonl")


def test_a_resumed_dp2_run_equals_the_single_process(inputs, layouts):
    """dp2 ZeRO-3 at mu = 2, resumed after step 3 inside generation 1: each rank reads back its own
    share of the old log-probs (RUN_DIR/rl_state/generation1.rank<r>.pt) and step 4 is one process's."""
    root = inputs[3]
    assert {"generation1.rank0.pt", "generation1.rank1.pt"} <= set(os.listdir(layouts / "mu2_dp2_resumed" / "rl_state"))
    got, want = _lines(layouts / "mu2_dp2_resumed"), _lines(root / "mu2")
    assert [line["step"] for line in got] == [1, 2, 3, 4]
    for key in COMPARED:
        assert got[3][key] == pytest.approx(want[3][key], rel=2e-5, abs=1e-6), key
    assert got[3]["clip_ratio/region_mean"] > 0  # the resumed step is off-policy: its old log-probs were read


def test_mu_steps_share_their_generation(inputs):
    """mu = 2: steps 1-2 and 3-4 each train on one generation (the same groups and rewards); the first
    step of each is on-policy (ratio 1: nothing clipped), the second is not (clipped tokens)."""
    root = inputs[3]
    for what in ("mu2", "online_mu2"):
        lines, samples = _lines(root / what), _jsonl(root / what / "samples.jsonl")
        assert [s["step"] for s in samples] == [1, 2, 3, 4]
        assert samples[0]["completions"] == samples[1]["completions"] != samples[2]["completions"]
        assert samples[2]["completions"] == samples[3]["completions"]
        for first, second in ((lines[0], lines[1]), (lines[2], lines[3])):
            assert first["reward"] == second["reward"] and first["loss"] != second["loss"]
            assert first["clip_ratio/region_mean"] == 0.0 < second["clip_ratio/region_mean"]
    assert len(_jsonl(root / "online_mu2" / "rollouts.jsonl")) == 2 * 2  # two generations of 2 prompts


def test_an_online_mu_run_equals_its_replay(inputs, tmp_path):
    ckpt, _, prompts, root = inputs
    cfg = settings_config(ckpt, None, prompts, "online_mu2")
    cfg.rl.prompts, cfg.rl.rollouts = None, str(root / "online_mu2" / "rollouts.jsonl")
    run(resolve(cfg), ParallelGrid.single(), str(tmp_path / "replay"))
    for a, b in zip(_lines(tmp_path / "replay"), _lines(root / "online_mu2"), strict=True):
        for key in COMPARED:
            assert a[key] == b[key], (a["step"], key)  # one process, the same operations: bit for bit


def _trl(model_dir: str, rollouts: str, out_dir: str, **args):
    """TRL's GRPOTrainer on `model_dir`, fed the file's first two groups through its rollout_func with
    their logged rewards, one micro-batch: (the trainer, its generated-and-scored batch)."""
    trl = pytest.importorskip("trl", reason="TRL is the reference (requirements.txt installs it)")
    from datasets import Dataset
    from transformers import AutoTokenizer

    groups = _jsonl(rollouts)[:2]
    rewards = {tuple(c): r for g in groups for c, r in zip(g["completion_ids"], g["rewards"])}

    def logged(completions, completion_ids, **kwargs):
        return [rewards[tuple(ids)] for ids in completion_ids]

    def rollout(prompts, trainer):
        return {"prompt_ids": [g["prompt_ids"] for g in groups for _ in range(G)],
                "completion_ids": [c for g in groups for c in g["completion_ids"]],
                "logprobs": [[0.0] * len(c) for g in groups for c in g["completion_ids"]]}

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.pad_token, tok.eos_token = "<pad>", "<eos>"  # the fixture's ids 0 and 1, as megaft reads them
    n = len(groups) * G
    config = trl.GRPOConfig(output_dir=out_dir, per_device_train_batch_size=n, num_generations=G,
                            max_completion_length=8, epsilon_high=0.28, loss_type="dapo", report_to=[], use_cpu=True,
                            bf16=False, model_init_kwargs={"dtype": torch.float32, "attn_implementation": "eager"},
                            **args)
    trainer = trl.GRPOTrainer(model=model_dir, reward_funcs=logged, args=config, processing_class=tok,
                              train_dataset=Dataset.from_dict({"prompt": ["x"] * len(groups)}), rollout_func=rollout)
    assert tok.pad_token_id == 0 and trainer.eos_token_ids == [1]  # megaft's stop ids: the same
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer, trainer._generate_and_score_completions([{"prompt": "x"}] * n)


def _trl_step(trainer, out) -> tuple[float, float, dict]:
    trainer._metrics["train"].clear()
    loss = trainer._compute_loss(trainer.model, out)
    loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in trainer.model.parameters()
                                                 if p.grad is not None]))
    trainer.model.zero_grad(set_to_none=True)
    return loss.item(), float(norm), {k: v[-1] for k, v in trainer._metrics["train"].items()}


def test_the_second_iteration_equals_trl(inputs, tmp_path):
    """TRL with num_iterations=2 computes the old log-probs from the generating weights right after
    generating; megaft takes them from step 1's own forward. On megaft's weights after step 1 (its
    export), TRL's loss, gradient norm and clip ratios of the same batch are megaft's step 2."""
    from transformers import LlamaForCausalLM

    ckpt, rollouts, prompts, root = inputs
    one = settings_config(ckpt, rollouts, prompts, "mu2")
    one.train.max_steps, one.train.export_hf = 1, True
    run(resolve(one), ParallelGrid.single(), str(tmp_path / "one"))
    trainer, out = _trl(ckpt, rollouts, str(tmp_path / "trl"), num_iterations=2)
    assert out["old_per_token_logps"] is not None  # TRL's off-policy path
    trainer.model.load_state_dict(LlamaForCausalLM.from_pretrained(str(tmp_path / "one" / "hf"),
                                                                   dtype=torch.float32).state_dict())
    loss, norm, metrics = _trl_step(trainer, out)
    second = _lines(root / "mu2")[1]
    assert second["loss"] == pytest.approx(loss, rel=1e-5, abs=1e-6), (second["loss"], loss)
    assert second["grad_norm"] == pytest.approx(norm, rel=1e-4)
    for key in ("entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                "clip_ratio/low_min", "clip_ratio/high_max"):
        assert second[key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-7), key
    assert second["clip_ratio/low_mean"] > 0 and second["clip_ratio/high_mean"] > 0


def test_masking_truncated_completions_equals_trl(inputs, tmp_path):
    ckpt, rollouts, prompts, root = inputs
    trainer, out = _trl(ckpt, rollouts, str(tmp_path / "trl"), mask_truncated_completions=True)
    cut = [c[-1] != 1 for g in _jsonl(rollouts)[:2] for c in g["completion_ids"]]
    assert 0 < sum(cut) < len(cut)  # some completions are dropped, not all
    assert (out["completion_mask"].sum(1) == 0).tolist() == cut
    loss, norm, metrics = _trl_step(trainer, out)
    first = _lines(root / "trunc")[0]
    assert first["loss"] == pytest.approx(loss, rel=1e-5, abs=1e-6), (first["loss"], loss)
    assert first["grad_norm"] == pytest.approx(norm, rel=1e-4)
    assert first["entropy"] == pytest.approx(metrics["entropy"], rel=1e-5)
    plain = settings_config(ckpt, rollouts, prompts, "trunc")
    plain.rl.mask_truncated_completions, plain.train.max_steps = False, 1
    run(resolve(plain), ParallelGrid.single(), str(tmp_path / "plain"))
    assert abs(_lines(tmp_path / "plain")[0]["loss"] - first["loss"]) > 1e-3  # the mask changed the loss


def test_top_p_changes_the_draws(inputs):
    """Step 1 of the top_p = 0.7 run and generation 0 of online_mu2 (top_p = 1) sample the same
    prompts from the same weights with the same seeds: only the nucleus differs."""
    root = inputs[3]
    nucleus, full = _jsonl(root / "top_p" / "rollouts.jsonl")[:2], _jsonl(root / "online_mu2" / "rollouts.jsonl")[:2]
    assert [g["prompt_ids"] for g in nucleus] == [g["prompt_ids"] for g in full]
    assert [g["completion_ids"] for g in nucleus] != [g["completion_ids"] for g in full]


def test_a_run_resumed_inside_a_generation_repeats_the_uninterrupted_one(inputs, tmp_path):
    """Online at mu = 2, checkpointed after step 3 (the first step of generation 1) and resumed to
    step 4: the generating weights are gone, so step 4 reads generation 1's groups, rewards and old
    log-probs from RUN_DIR/rl_state, and repeats the uninterrupted run bit for bit. Without the file,
    or at another layout, the resume is refused with the fix."""
    ckpt, rollouts, prompts, root = inputs
    run_dir = tmp_path / "resumed"
    first = settings_config(ckpt, rollouts, prompts, "online_mu2")
    first.train.max_steps, first.train.save_every = 3, 3
    run(resolve(first), ParallelGrid.single(), str(run_dir))
    assert "generation1.rank0.pt" in os.listdir(run_dir / "rl_state")
    shutil.copytree(run_dir, tmp_path / "lost")
    again = settings_config(ckpt, rollouts, prompts, "online_mu2")
    again.train.save_every = 3
    run(resolve(again), ParallelGrid.single(), str(run_dir))
    got, want = _lines(run_dir), _lines(root / "online_mu2")
    assert [line["step"] for line in got] == [1, 2, 3, 4]
    for key in COMPARED:
        assert got[3][key] == want[3][key], key
    assert _jsonl(run_dir / "rollouts.jsonl") == _jsonl(root / "online_mu2" / "rollouts.jsonl")
    assert _jsonl(run_dir / "samples.jsonl") == _jsonl(root / "online_mu2" / "samples.jsonl")

    state = str(tmp_path / "lost")
    with pytest.raises(ValueError, match="at the saved layout"):
        Generation.load(state, 1, 3, ParallelGrid.single(), {"tp": 2})
    os.remove(tmp_path / "lost" / "rl_state" / "generation1.rank0.pt")
    with pytest.raises(ValueError, match="inside generation 1.s rl.num_iterations steps.*fix: resume from a"):
        Trainer(resolve(again), ParallelGrid.single(), state).fit()


def test_validation_of_num_iterations(inputs):
    ckpt, rollouts, prompts, _ = inputs
    for bad in (0, -1):
        cfg = settings_config(ckpt, rollouts, prompts, "mu2")
        cfg.rl.num_iterations = bad
        assert any(f"rl.num_iterations={bad} must be a whole number >= 1" in p and "fix:" in p
                   for p in validate(cfg, 1))
    assert validate(settings_config(ckpt, rollouts, prompts, "mu2"), 1) == []
