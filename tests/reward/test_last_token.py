"""A reward is read at each row's last real token, found from the attention mask or the row
lengths, never by searching for the pad id: right padding, left padding and pad == eos
(transformers#35352, TRL#937, #2778) all give the reward of the unpadded row."""
from __future__ import annotations

import pytest
import torch
import transformers
from models.hf_fixture import make_hf_llama

from megaft.models.decoder import Decoder
from megaft.models.hf.config import hf_model_config
from megaft.models.hf.load import load_hf_weights
from megaft.reward.losses import last_token_mask, length_mask, reward_loss, sequence_rewards
from reward.reward_cases import make_hf_reward

EOS = 1  # the fixture tokenizer's <eos>; <pad> is 0


def test_the_mask_finds_the_last_real_token_for_right_and_left_padding():
    right = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    left = right.flip(1)
    assert last_token_mask(right).nonzero().tolist() == [[0, 2], [1, 4], [2, 0]]
    assert last_token_mask(left).nonzero().tolist() == [[0, 4], [1, 4], [2, 4]]
    assert torch.equal(length_mask(torch.tensor([3, 5, 1]), 5), last_token_mask(right))


def test_the_reward_reads_only_the_last_token():
    scores = torch.tensor([[1.0, 2.0, 3.0, float("nan")], [4.0, 5.0, 6.0, 7.0]])  # padding may hold anything
    assert sequence_rewards(scores, length_mask(torch.tensor([3, 4]), 4)).tolist() == [3.0, 7.0]


def test_the_loss_is_trls_bradley_terry_with_margin_and_centering():
    chosen, rejected, margin = torch.tensor([1.0, -0.5]), torch.tensor([0.2, 0.5]), torch.tensor([0.3, 0.0])
    losses, metrics = reward_loss(chosen, rejected, margin, 0.01)
    # TRL 1.16 RewardTrainer.compute_loss, written out
    want = -torch.nn.functional.logsigmoid(chosen - rejected - margin).mean() + 0.01 * ((chosen + rejected) ** 2).mean()
    torch.testing.assert_close(losses.mean(), want)
    assert metrics["accuracy"].tolist() == [1.0, 0.0]


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("last_token")
    make_hf_llama(str(root / "lm"), seed=2)
    make_hf_reward(str(root / "rm"), str(root / "lm"), seed=3)
    cfg = hf_model_config(str(root / "rm"))
    cfg.score_head = True
    model = Decoder(cfg)
    load_hf_weights(model, str(root / "rm"), tp_rank=0, tp_size=1)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(root / "rm"), dtype=torch.float32,
                                                                         attn_implementation="eager")
    return model.eval(), hf.eval()


@torch.no_grad()
def test_pad_equal_to_eos_scores_the_eos_token(reward_model):
    """Rows ending in eos, right-padded with eos (pad == eos, a tokenizer without a pad token):
    megaft's reward is the unpadded row's score at its final eos; transformers' search for the
    last non-pad token lands before the eos (the bug this avoids)."""
    model, hf = reward_model
    rows = [[5, 9, 13, 22, EOS], [7, 8, 30, 31, 40, 41, 50, EOS], [12, EOS]]
    lengths = torch.tensor([len(r) for r in rows])
    ids = torch.full((len(rows), int(lengths.max())), EOS)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
    got = sequence_rewards(model(ids), length_mask(lengths, ids.shape[1]))
    want = torch.cat([hf(torch.tensor([r])).logits[:, 0] for r in rows])  # unpadded, one row at a time:
    # transformers reads the last position when no token is the pad (its config's pad is 0 here)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    hf.config.pad_token_id = EOS  # what transformers does with pad == eos
    try:
        searched = hf(ids).logits[:, 0]
    finally:
        hf.config.pad_token_id = 0
    assert (searched - want).abs().max() > 1e-3  # the token before the eos: a different reward


@torch.no_grad()
def test_left_padding_gives_the_unpadded_rewards_in_transformers_and_the_mask(reward_model):
    """The exported class with left padding (pad != eos) reads the same rewards as megaft's
    right-padded rows: both land on the last real token."""
    model, hf = reward_model
    rows = [[5, 9, 13, 22, EOS], [7, 8, 30, 31, 40, 41, 50, EOS]]
    n = max(map(len, rows))
    left = torch.tensor([[0] * (n - len(r)) + r for r in rows])
    right = torch.tensor([r + [0] * (n - len(r)) for r in rows])
    mask = (left != 0).long()
    hf_left = hf(left, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits[:, 0]
    ours = sequence_rewards(model(right), length_mask(torch.tensor([len(r) for r in rows]), n))
    torch.testing.assert_close(ours, hf_left, rtol=1e-5, atol=1e-5)
    assert torch.equal(last_token_mask(mask)[:, -1], torch.tensor([True, True]))
