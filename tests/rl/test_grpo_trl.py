"""megaft.rl equals TRL 1.16's GRPOTrainer (the reference definition): TRL's own trainer, fed
fixed rollouts through its `rollout_func`, scores them with two reward functions (one declining
some completions), computes its advantages and `_compute_loss`; megaft's group_advantages and
grpo_loss, given the same rewards and the same model's log-probs, give the same advantages,
loss, gradient of every weight and metrics, for every loss_type, with and without the KL
term (k3 and TRL's bias-corrected form) and every scale_rewards. One process, no
accumulation: where TRL's normalisations are right (tests/rl/test_grpo_layouts.py covers the rest)."""
from __future__ import annotations

import math

import pytest
import torch

from megaft.rl.advantages import completion_metrics, function_metrics, group_advantages
from megaft.rl.losses import LOSS_TYPES, GlobalCounts, grpo_loss

trl = pytest.importorskip("trl", reason="TRL is the reference (requirements.txt installs it)")
transformers = pytest.importorskip("transformers")

G, EOS, PAD = 2, 1, 0
PROMPTS = [[5, 6, 7], [8, 9]]  # token ids; each prompt is sampled G times
COMPLETIONS = [[10, 11, 12, EOS], [13, 14, 15, 16, 17, 18], [19, EOS], [20, 21, 22, 23, 24, 25]]  # two truncated
CORRECT = [1.0, 0.0, 1.0, 1.0]  # the first function's score of each completion
FORMAT = [0.5, None, 0.25, None]  # the second declines two (None), as TRL allows
WEIGHTS = [1.0, 0.5]
TEMPERATURE = 0.7


def correct(completions, completion_ids, **kwargs):
    return [CORRECT[COMPLETIONS.index(list(ids))] for ids in completion_ids]


def format_ok(completions, completion_ids, **kwargs):
    return [FORMAT[COMPLETIONS.index(list(ids))] for ids in completion_ids]


def rollouts(prompts, trainer):
    # the per-process prompts, each already repeated G times by TRL's sampler
    assert len(prompts) == len(COMPLETIONS)
    return {"prompt_ids": [PROMPTS[i // G] for i in range(len(prompts))], "completion_ids": COMPLETIONS,
            "logprobs": [[0.0] * len(c) for c in COMPLETIONS]}


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    from datasets import Dataset
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("grpo")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    vocab = {f"t{i}": i for i in range(32)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t2")),
                                  pad_token="t0", eos_token="t1")
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    args = trl.GRPOConfig(output_dir=str(root / "out"), per_device_train_batch_size=len(COMPLETIONS),
                          num_generations=G, max_completion_length=6, temperature=TEMPERATURE, beta=0.04,
                          epsilon=0.2, epsilon_high=0.28, reward_weights=WEIGHTS, report_to=[], use_cpu=True,
                          bf16=False, logging_steps=1)
    data = Dataset.from_dict({"prompt": ["t5 t6 t7", "t8 t9"]})
    tr = trl.GRPOTrainer(model=str(root / "model"), reward_funcs=[correct, format_ok], args=args, train_dataset=data,
                         processing_class=tok, rollout_func=rollouts)
    tr.model.train()
    tr.current_gradient_accumulation_steps = 1
    return tr


def _rows(trainer):
    return [{"prompt": "t5 t6 t7"}] * G + [{"prompt": "t8 t9"}] * G


def _our_logps(model, out) -> tuple[torch.Tensor, torch.Tensor]:
    """Per completion token: log-prob and entropy of the model's logits over the temperature."""
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
    mask = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
    logits = model(input_ids=ids, attention_mask=mask).logits.float()
    logits = logits[:, out["prompt_ids"].shape[1] - 1:-1] / TEMPERATURE
    logp = torch.log_softmax(logits, dim=-1)
    token = logp.gather(-1, out["completion_ids"].unsqueeze(-1)).squeeze(-1)
    return token, -(logp.exp() * logp).sum(-1).detach()


def _grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_equal_trl(trainer, scale):
    """The advantages and TRL's reward and completions/* (length) metrics."""
    trainer.scale_rewards = scale
    trainer._metrics["train"].clear()
    out = trainer._generate_and_score_completions(_rows(trainer))
    rewards = torch.tensor([[c, math.nan if f is None else f] for c, f in zip(CORRECT, FORMAT)])
    ours, metrics = group_advantages(rewards, torch.tensor(WEIGHTS), G, scale)
    torch.testing.assert_close(ours, out["advantages"], rtol=1e-6, atol=1e-7)
    theirs = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    metrics.update(function_metrics(rewards, ["correct", "format_ok"]))
    ended = torch.tensor([c[-1] in (EOS, PAD) for c in COMPLETIONS])
    lengths = completion_metrics(torch.tensor([len(c) for c in COMPLETIONS]), ~ended)
    # two of four cut at 6 tokens; the terminated ones are 4 and 2 long: every number is apart from the rest
    assert lengths["completions/clipped_ratio"] == 0.5 and lengths["completions/mean_terminated_length"] == 3.0
    assert lengths.keys() == {k for k in theirs if k.startswith("completions/")}
    metrics.update(lengths)
    for name, value in metrics.items():
        assert value == pytest.approx(theirs[name], rel=1e-6, nan_ok=True), name
    if scale == "batch":  # TRL#3991 took a std per group: here one std of all four, by hand
        r = torch.tensor([1.25, 0.0, 1.125, 1.0])  # 1 + 0.5 * 0.5, 0 + (declined), 1 + 0.5 * 0.25, 1 + (declined)
        mean = torch.tensor([0.625, 0.625, 1.0625, 1.0625])
        torch.testing.assert_close(ours, (r - mean) / (r.std() + 1e-4))


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("kl", ["none", "k3", "k3_bias_corrected"])
def test_loss_gradients_and_metrics_equal_trl(trainer, loss_type, kl):
    trainer.scale_rewards, trainer.loss_type = "group", loss_type
    trainer.beta = 0.0 if kl == "none" else 0.04
    trainer.args.use_bias_correction_kl = kl == "k3_bias_corrected"
    model = trainer.model
    out = trainer._generate_and_score_completions(_rows(trainer))
    # rollouts from slightly older weights: the ratio moves off 1 and both clips engage
    g = torch.Generator().manual_seed(3)
    out["old_per_token_logps"] = (_our_logps(model, out)[0].detach()
                                  + 0.5 * torch.randn(out["completion_ids"].shape, generator=g))
    if trainer.beta:  # a reference apart from the policy: at equal log-probs the k3 term and its gradient are 0
        out["ref_per_token_logps"] = out["ref_per_token_logps"] + 0.3 * torch.randn(out["completion_ids"].shape,
                                                                                    generator=g)
    trainer._metrics["train"].clear()
    model.zero_grad(set_to_none=True)
    theirs = trainer._compute_loss(model, out)
    theirs.backward()
    want = _grads(model)
    logps, entropies = _our_logps(model, out)
    mask = out["completion_mask"]
    counts = GlobalCounts(completions=mask.shape[0], tokens=float(mask.sum()), max_completion_length=6)
    ours, stats = grpo_loss(logps, out["old_per_token_logps"], out.get("ref_per_token_logps"), out["advantages"],
                            mask, counts, loss_type=loss_type, beta=trainer.beta, epsilon=0.2, epsilon_high=0.28,
                            bias_corrected_kl=trainer.args.use_bias_correction_kl, entropies=entropies)
    ours.backward()
    got = _grads(model)
    # fp32: TRL's fused head and these log-softmaxes sum the same 32 logits in other orders
    assert float(ours) == pytest.approx(float(theirs), rel=1e-5, abs=1e-7)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    mine = stats.metrics(trainer.beta)
    assert mine.keys() <= logged.keys()
    for name, value in mine.items():
        assert value == pytest.approx(logged[name], rel=1e-5, abs=1e-7, nan_ok=True), name
    assert mine["clip_ratio/low_mean"] > 0 and mine["clip_ratio/high_mean"] > 0 and mine["clip_ratio/region_mean"] < 1
