"""The KV cache's buffers (megaft.inference.kv_cache): written in place, sized at the prompt by
the decoding loop (megaft.inference.generate), the same keys and values as appending with torch.cat."""
from __future__ import annotations

import torch

import megaft.inference.generate as gen
from megaft.config.model import ModelConfig
from megaft.inference.kv_cache import DecodeState, LayerCache
from megaft.models.decoder import Decoder

CPU = torch.device("cpu")


def _steps(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """(k, v, real) of a prompt and several decode forwards, one of them padded (real < seq)."""
    g = torch.Generator().manual_seed(seed)
    shape = lambda s: (2, 3, s, 8)  # noqa: E731
    out = []
    for seq, real in ((5, 5), (1, 1), (2, 2), (2, 1), (1, 1), (1, 1)):
        out.append((torch.randn(shape(seq), generator=g), torch.randn(shape(seq), generator=g), real))
    return out


def _run(cache: LayerCache, steps) -> list[tuple[torch.Tensor, torch.Tensor, int, int, int]]:
    """Extend `cache` by each step; (k view, v view, k buffer's data_ptr, v buffer's, its size) after each."""
    seen = []
    for k, v, real in steps:
        cache.state.real = real
        ck, cv = cache.extend(k, v)
        seen.append((ck.clone(), cv.clone(), cache.k_buf.data_ptr(), cache.v_buf.data_ptr(), cache.k_buf.shape[2]))
        cache.state.advance()
    return seen


def test_extend_writes_in_place_and_equals_concatenation():
    steps = _steps()
    total = sum(real for _, _, real in steps)
    cache = LayerCache(DecodeState(), capacity=total)
    seen = _run(cache, steps)
    assert len({s[2] for s in seen}) == 1 and len({s[3] for s in seen}) == 1  # one buffer, never reallocated
    assert cache.k_buf.shape == (2, 3, total, 8)
    k_cat = v_cat = None
    for (k, v, real), (ck, cv, *_) in zip(steps, seen):
        k_cat = k[:, :, :real] if k_cat is None else torch.cat([k_cat, k[:, :, :real]], dim=2)
        v_cat = v[:, :, :real] if v_cat is None else torch.cat([v_cat, v[:, :, :real]], dim=2)
        assert torch.equal(ck, k_cat) and torch.equal(cv, v_cat)
    assert cache.k.data_ptr() == cache.k_buf.data_ptr()  # the result is a view of the buffer


def test_without_capacity_the_buffer_grows_by_doubling_and_keeps_the_cache():
    steps = _steps(1)
    sized = _run(LayerCache(DecodeState(), capacity=64), steps)
    grown = LayerCache(DecodeState())
    unsized = _run(grown, steps)
    for a, b in zip(sized, unsized):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    # 5 (the prompt), then 10 and 20 positions: two reallocations for 6 forwards, not one per forward
    assert [s[4] for s in unsized] == [5, 10, 10, 10, 10, 20]
    assert [s[4] for s in sized] == [64] * 6


def test_decoding_sizes_the_cache_once_per_prompt_batch(monkeypatch):
    torch.manual_seed(0)
    model = Decoder(ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=50,
                                max_seq_len=64))
    buffers: list[tuple[int, int, int]] = []  # (capacity, k buffer data_ptr, filled) per extend
    extend = LayerCache.extend

    def spy(self, k, v):
        out = extend(self, k, v)
        if self is model.layers[0].self_attn.cache:
            buffers.append((self.capacity, self.k_buf.data_ptr(), self.filled))
        return out

    monkeypatch.setattr(LayerCache, "extend", spy)
    prompt = [3, 9, 4, 7]
    out = gen.generate(model, [prompt], max_new_tokens=6, eos_id=None, device=CPU)
    assert len(out[0]) == 6
    assert {b[0] for b in buffers} == {len(prompt) + 6}  # prompt + new tokens
    assert len({b[1] for b in buffers}) == 1  # one allocation for the whole generation
    assert [b[2] for b in buffers] == [4, 5, 6, 7, 8, 9]
