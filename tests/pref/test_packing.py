"""Preference pairs packed into rows (megaft.pref.packing): the layouts, and the shared
prompt's tree mask giving the same answer log-probs and gradients as the unpacked rows."""
from __future__ import annotations

from typing import Optional

import pytest
import torch

from megaft.config.model import ModelConfig
from megaft.models.decoder import Decoder
from megaft.models.init import init_params
from megaft.pref.batches import PairRows, chosen_rows, rejected_rows
from megaft.pref.data import Pair
from megaft.pref.logps import decoder_token_logps, sequence_logps
from megaft.pref.packing import first_fit, pack_pairs, packed_length, packed_tokens, segment_sums

PAIRS = [Pair([5, 6, 7], [8, 9, 1], [10, 1]), Pair([11], [12, 1], [13, 14, 15, 1]),
         Pair([16, 17, 18, 19, 20], [21, 1], [22, 23, 1]), Pair([24, 25], [26, 27, 28, 1], [29, 1])]


def test_a_shared_pair_lays_out_the_prompt_once_and_each_answer_after_its_last_token():
    packed = pack_pairs(PAIRS[:1], 32, 0, share_prompt=True)
    row = packed.inputs[0].tolist()
    # S = prompt[:-1]; then [7, chosen], [7, rejected]; then padding
    assert row[:9] == [5, 6, 7, 8, 9, 1, 7, 10, 1]
    assert packed.docs.position_ids[0, :9].tolist() == [0, 1, 2, 3, 4, 5, 2, 3, 4]
    assert packed.docs.doc_ids[0, :9].tolist() == [0, 0, 1, 1, 1, 1, 2, 2, 2]
    assert packed.docs.prefix_ids[0, :9].tolist() == [0, 0, 0, 0, 0, 0, 0, 0, 0]
    # the answers' labels; ORPO's: the prompt's next tokens and the chosen answer's
    assert packed.labels[0, :9].tolist() == [-100, -100, 8, 9, 1, -100, 10, 1, -100]
    assert packed.whole[0, :9].tolist() == [6, 7, 8, 9, 1, -100, -100, -100, -100]
    assert packed.segments[0, :9].tolist() == [0, 0, 0, 0, 0, 0, 1, 1, 1]
    assert packed.segments[0, 9:].eq(-1).all()
    assert packed_length(PAIRS[0], True) == 9 and packed_length(PAIRS[0], False) == 3 * 2 + 3 + 2


def test_rows_are_filled_first_fit_with_whole_pairs():
    assert first_fit([5, 4, 3, 2, 6], 8) == [[0, 2], [1, 3], [4]]
    with pytest.raises(ValueError, match="does not fit"):
        first_fit([9], 8)
    packed = pack_pairs(PAIRS, 16, 0, share_prompt=False, multiple=4)
    assert packed.inputs.shape[1] % 4 == 0 and packed.inputs.shape[1] <= 16
    for j in range(len(PAIRS)):  # each pair's two answers in one row
        rows = {int(r) for r in (packed.segments == 2 * j).nonzero()[:, 0]} | {
            int(r) for r in (packed.segments == 2 * j + 1).nonzero()[:, 0]}
        assert len(rows) == 1
    assert int((packed.segments >= 0).sum()) == packed_tokens(PAIRS, False)
    wide = pack_pairs(PAIRS, 16, 0, share_prompt=True, min_rows=5, min_length=20)
    assert tuple(wide.inputs.shape) == (5, 20) and wide.segments[-1].eq(-1).all()


def _model() -> Decoder:
    # max_seq_len 12: the unpacked rows' length; the packed rows are longer (each document's positions from 0)
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=40, max_seq_len=12)
    model = Decoder(cfg)
    init_params(model, cfg, seed=3, tp_rank=0, tp_size=1)
    return model


def _answer_logps(model: Decoder, share: Optional[bool]) -> tuple[torch.Tensor, torch.Tensor]:
    """([pairs] chosen sums, [pairs] rejected sums) of PAIRS: unpacked rows (share None), packed, or
    packed with shared prompts."""
    if share is None:
        rows = PairRows(PAIRS, 12, seed=0, pad_id=0)
        inputs, labels = rows.rows(torch.arange(len(PAIRS)))
        seq = sequence_logps(decoder_token_logps(model, inputs, labels), labels)
        return chosen_rows(seq.sum), rejected_rows(seq.sum)
    packed = pack_pairs(PAIRS, 24, 0, share_prompt=share)
    assert packed.inputs.shape[1] > model.cfg.max_seq_len
    logps = decoder_token_logps(model, packed.inputs, packed.labels, packed.docs)
    sums, counts = segment_sums(logps, packed.labels, packed.segments, 2 * len(PAIRS))
    assert counts.tolist() == [len(a) for p in PAIRS for a in (p.chosen_ids, p.rejected_ids)]
    return chosen_rows(sums), rejected_rows(sums)


def test_packed_and_shared_prompts_give_the_unpacked_log_probs_and_gradients():
    """A DPO-like loss of the answers' log-probs: packed (each answer a document) and packed with
    shared prompts (the tree mask) give the unpacked rows' values and every parameter's gradient."""
    model = _model()
    out = {}
    for share in (None, False, True):
        model.zero_grad()
        chosen, rejected = _answer_logps(model, share)
        loss = -torch.nn.functional.logsigmoid(0.5 * (chosen - rejected)).sum() - 0.1 * chosen.sum()
        loss.backward()
        out[share] = (chosen.detach(), rejected.detach(),
                      {n: p.grad.clone() for n, p in model.named_parameters()})
    want = out[None]
    for share in (False, True):
        got = out[share]
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
        for name, grad in want[2].items():
            torch.testing.assert_close(got[2][name], grad, rtol=1e-4, atol=1e-6, msg=f"{share} {name}")
    assert want[0].abs().min() > 0.1  # real log-probs, not zeros


def test_the_tree_mask_lets_an_answer_see_its_prompt_and_not_the_other_answer():
    from megaft.models.attention.documents import document_mask

    packed = pack_pairs(PAIRS[:1], 16, 0, share_prompt=True)
    mask = document_mask(packed.docs)[0, 0]
    prompt, chosen, rejected = [0, 1], [2, 3, 4, 5], [6, 7, 8]
    assert mask[rejected][:, prompt].all() and mask[chosen][:, prompt].all()
    assert not mask[rejected][:, chosen].any() and not mask[chosen][:, rejected].any()
    assert not mask[prompt][:, chosen].any()
