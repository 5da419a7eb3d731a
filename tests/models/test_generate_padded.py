"""Prompts of different lengths decoded as one left-padded batch (megaft.inference.generate with
megaft.inference.kv_cache's DecodeState.pad), single process:

- greedy: token-identical to transformers' batched `generate` with left padding and an
  attention_mask, and to each prompt decoded alone, in one batch (one forward a new token);
- sampled with a step per prompt (GRPO's rollouts): each prompt's rows draw what they draw alone,
  whichever prompts are batched beside them and in whichever order;
- the log-probs of the sampled tokens, read from the padded batch's logits as they were drawn,
  equal the trainer's recomputation on the unpadded rows (megaft.pref.logps.decoder_token_logps, the
  GRPO step's), so padding brings no rollout/trainer mismatch on the CPU;
- each row's positions start at its first real token; an M-RoPE offset (images) with padded rows is
  refused with its fix.

tp, sp, pp, sliding-window, soft-capped and latent-attention families decode PROMPTS' three lengths
in one padded batch in tests/models/test_generate.py; dp and ZeRO-3 in tests/rl/test_grpo_online.py.
"""
from __future__ import annotations

import pytest
import torch

from megaft.inference.generate import Sampling, generate
from megaft.models.decoder import Decoder
from megaft.models.hf.config import hf_model_config
from megaft.models.hf.load import load_hf_weights
from megaft.pref.batches import row_of
from megaft.pref.logps import decoder_token_logps
from models.hf_fixture import load_reference, make_hf_llama

CPU = torch.device("cpu")
NEW, EOS, PAD = 10, 1, 0
PROMPTS = [[11, 22, 33, 44, 55, 6, 7], [8, 30], [5, 17, 9, 33, 21]]  # 7, 2 and 5 tokens
SAMPLED = Sampling(temperature=0.9, top_p=0.95, seed=3)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("hf_llama_padded"))
    make_hf_llama(path, seed=1)
    return path


def _decoder(path: str) -> Decoder:
    model = Decoder(hf_model_config(path))
    load_hf_weights(model, path, tp_rank=0, tp_size=1)
    return model


def _forwards(model: Decoder) -> list[int]:
    """A counter of the model's forwards (a hook kept for the module's life)."""
    calls = []
    model.register_forward_hook(lambda m, args, out: calls.append(args[0].shape[0]))
    return calls


def test_greedy_left_padded_batch_equals_transformers_batched_and_each_prompt_alone(checkpoint):
    ref = load_reference(checkpoint)
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in PROMPTS])
    mask = (torch.arange(width) >= torch.tensor([width - len(p) for p in PROMPTS]).unsqueeze(1)).long()
    with torch.no_grad():
        out = ref.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=EOS,
                           pad_token_id=PAD)[:, width:].tolist()
    want = [row[:row.index(EOS)] if EOS in row else row for row in out]
    model = _decoder(checkpoint)
    calls = _forwards(model)
    got = generate(model, PROMPTS, max_new_tokens=NEW, eos_id=EOS, device=CPU)
    assert got == want
    # one batch of every prompt: a forward per step until the last row's eos (or its NEW tokens)
    assert calls == [len(PROMPTS)] * max(len(g) + (len(g) < NEW) for g in got)
    assert [generate(model, [p], max_new_tokens=NEW, eos_id=EOS, device=CPU)[0] for p in PROMPTS] == want
    assert sum(len(w) for w in want) > 3 * len(PROMPTS)  # several decode steps per row
    # no eos: every row runs to its own limit (one per prompt), still one batch
    limits = [3, 9, 6]
    free = generate(model, PROMPTS, max_new_tokens=limits, eos_id=None, device=CPU)
    assert [len(f) for f in free] == limits
    assert free == [generate(model, [p], max_new_tokens=n, eos_id=None, device=CPU)[0]
                    for p, n in zip(PROMPTS, limits)]


def test_rows_run_to_their_own_positions_past_the_batchs_width(checkpoint):
    """A 50-token prompt beside a 2-token one, 30 new tokens, model.max_seq_len 64: the long row stops
    at 64 positions (14 new), the short one runs its 30 although the batch spans 80 cache slots: each
    row's RoPE positions start at its first real token (not at the batch's first slot, which would
    run past the position table), so each row equals its prompt decoded alone."""
    model = _decoder(checkpoint)
    assert model.cfg.max_seq_len == 64
    prompts = [[3 + (7 * i) % 55 for i in range(50)], [8, 30]]
    got = generate(model, prompts, max_new_tokens=30, eos_id=None, device=CPU)
    assert [len(g) for g in got] == [14, 30]
    assert got == [generate(model, [p], max_new_tokens=30, eos_id=None, device=CPU)[0] for p in prompts]


def test_each_prompts_draws_are_its_own_in_any_batch(checkpoint):
    """A step per prompt (GRPO: draw_seed(step, j)): prompt j's G rows draw from their own generator,
    so a batch of three prompts gives each what it gets alone, in any order, and the batch is
    reproducible."""
    model, g = _decoder(checkpoint), 3
    steps = [101, 205, 309]
    kw = dict(max_new_tokens=NEW, eos_id=EOS, device=CPU, sampling=SAMPLED, keep_eos=True)
    batched = generate(model, [p for p in PROMPTS for _ in range(g)], step=[s for s in steps for _ in range(g)], **kw)
    alone = [generate(model, [p] * g, step=s, **kw) for p, s in zip(PROMPTS, steps)]
    assert batched == [row for rows in alone for row in rows]
    order = [2, 0, 1]
    shuffled = generate(model, [PROMPTS[i] for i in order for _ in range(g)],
                        step=[steps[i] for i in order for _ in range(g)], **kw)
    assert shuffled == [row for i in order for row in alone[i]]
    assert len({tuple(r) for r in batched}) > len(PROMPTS)  # drawn, not one row per prompt repeated
    other = generate(model, [p for p in PROMPTS for _ in range(g)], step=[s + 1 for s in steps for _ in range(g)], **kw)
    assert other != batched


def test_the_rollouts_log_probs_equal_the_trainers_recomputed_ones(checkpoint):
    model, t = _decoder(checkpoint), SAMPLED.temperature
    rows = [p for p in PROMPTS for _ in range(2)]
    seen = []  # the last position's logits of every forward, as the draws read them
    model.register_forward_hook(lambda m, args, out: seen.append(out[:, -1].detach()))
    completions = generate(model, rows, max_new_tokens=NEW, eos_id=EOS, device=CPU, sampling=SAMPLED, step=4,
                           keep_eos=True)
    rollout = []  # each completion's tokens' log-probs under the padded batch's logits
    for r, c in enumerate(completions):
        logps = [torch.log_softmax(seen[k][r, :model.cfg.vocab_size] / t, dim=-1)[tok] for k, tok in enumerate(c)]
        rollout.append(torch.stack(logps))
    seq = max(len(p) + len(c) for p, c in zip(rows, completions))
    batch = [row_of(p, c, seq, PAD) for p, c in zip(rows, completions)]
    inputs, labels = (torch.tensor([b[i] for b in batch]) for i in (0, 1))
    model.eval()
    with torch.no_grad():
        recomputed = decoder_token_logps(model, inputs, labels, temperature=t)
    for r, (p, c) in enumerate(zip(rows, completions)):
        # fp32; padding, the cache and the batch's shapes change only SDPA's and the matmuls' summation order
        torch.testing.assert_close(recomputed[r, len(p) - 1:len(p) - 1 + len(c)], rollout[r], atol=2e-5, rtol=1e-5)
    assert len({len(c) for c in completions}) > 1 and min(map(len, completions)) >= 1


def test_left_padding_with_an_m_rope_offset_is_refused():
    """M-RoPE's offset (a prompt with images, set by Qwen2.5-VL's prefill) is one per batch: with
    left-padded rows the cache refuses it, naming the fix, rather than rotate the rows wrongly."""
    from megaft.inference.kv_cache import DecodeState, LayerCache

    cache = LayerCache(DecodeState(pad=torch.tensor([0, 2])), capacity=8)
    assert cache.positions(3, 16, CPU).tolist() == [[0, 1, 2], [0, 0, 0]]  # a pad's position clamped to 0
    cache.state.pos = 3
    assert cache.positions(1, 16, CPU).tolist() == [[3], [1]]  # each row's own next position
    cache.state.rope_offset = 4
    with pytest.raises(ValueError, match="left-padded rows with an M-RoPE offset .* one at a time"):
        cache.positions(1, 16, CPU)
