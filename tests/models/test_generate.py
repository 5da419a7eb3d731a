"""Decoding (megaft.inference.generate) with the KV cache (megaft.inference.kv_cache) against
transformers' `generate(do_sample=False)` on the same random Llama (GQA: 4 query heads over
2 kv heads, odd vocabulary), prompts of three lengths in one left-padded batch: single process,
and in one spawned 2-rank group at tp=2 (with
and without sequence parallel, and over one kv head replicated on both ranks) and pp=2;
the cached path against the recomputing one; nucleus filtering against transformers'
TopPLogitsWarper; seeded sampling identical on every rank, equal to the single process's
draws and reproducible.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import transformers
from multirank import spawn

from megaft.inference.generate import Sampling, generate, pipeline_generate, top_p_filter
from megaft.inference.kv_cache import kv_cache
from megaft.models.decoder import Decoder
from megaft.models.hf.config import hf_model_config
from megaft.models.hf.load import load_hf_weights
from megaft.parallel.grid import ParallelGrid
from megaft.pipeline.runtime import PipelineRuntime
from megaft.pipeline.stage import StageModel
from models.hf_fixture import hf_config, load_reference, make_hf_llama, write_char_tokenizer

CPU = torch.device("cpu")
NEW = 12
# three lengths decoded as one left-padded batch (two prompts of one length, one longer, one
# shorter), odd lengths among them (sequence parallel pads the forward)
PROMPTS = [[5, 17, 9, 33, 21], [40, 3, 12, 7, 58], [11, 22, 33, 44, 55, 6, 7], [8, 30]]
EOS = 1
SAMPLED = Sampling(temperature=0.9, top_p=0.9, seed=3)
STEPS = [5, 5, 8, 9]  # a draw step per prompt (the first two draw together): megaft.inference.generate.Draws


def _hf_greedy(path: str) -> list[list[int]]:
    """transformers' greedy continuations of PROMPTS (cut at eos)."""
    ref, want = load_reference(path), []
    with torch.no_grad():
        for p in PROMPTS:
            out = ref.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False)[0, len(p):].tolist()
            want.append(out[:out.index(EOS)] if EOS in out else out)
    return want


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random HF Llama and transformers' greedy continuations of PROMPTS."""
    path = str(tmp_path_factory.mktemp("hf_llama"))
    make_hf_llama(path, seed=1)
    return path, _hf_greedy(path)


@pytest.fixture(scope="module")
def one_kv_head(tmp_path_factory):
    """The same shape with one kv head: at tp=2 each rank holds a replica of it (megaft.models.attention.kv_heads)."""
    path = str(tmp_path_factory.mktemp("hf_llama_kv1"))
    torch.manual_seed(2)
    config = hf_config()
    config.num_key_value_heads = 1
    model = transformers.LlamaForCausalLM(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + torch.randn_like(p) * 0.1 if name.endswith("norm.weight") else torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    write_char_tokenizer(path)
    return path, _hf_greedy(path)


def _decoder(path: str, *, tp_rank: int = 0, tp_size: int = 1, group=None, sp: bool = False) -> Decoder:
    model = Decoder(hf_model_config(path), group=group, sequence_parallel=sp)
    load_hf_weights(model, path, tp_rank=tp_rank, tp_size=tp_size)
    return model


def test_cached_greedy_equals_transformers_and_the_recomputing_path(checkpoint):
    path, want = checkpoint
    model = _decoder(path)
    cached = generate(model, PROMPTS, max_new_tokens=NEW, eos_id=EOS, device=CPU)
    assert cached == want
    assert generate(model, PROMPTS, max_new_tokens=NEW, eos_id=EOS, device=CPU, cache=False) == want
    assert all(len(w) > 3 for w in want)  # the comparison covers several decode steps per prompt
    # several eos ids (a chat model's end of turn beside its eos): each ends a sequence
    stop = want[0][2]
    cut = [w[:w.index(stop)] if stop in w else w for w in want]
    assert generate(model, PROMPTS, max_new_tokens=NEW, eos_id=[EOS, stop], device=CPU) == cut != want


def test_cached_logits_equal_the_whole_forward(checkpoint):
    """Prefill then one token at a time: every position's logits equal the uncached forward's."""
    path, _ = checkpoint
    model = _decoder(path).eval()
    ids = torch.tensor([PROMPTS[2] + [9, 14, 27]])
    with torch.no_grad():
        whole = model(ids)
        with kv_cache(model) as state:
            steps = []
            for chunk in (ids[:, :7], ids[:, 7:8], ids[:, 8:10]):  # prompt, one token, two at once
                state.real = chunk.shape[1]
                steps.append(model(chunk))
                state.advance()
            assert state.pos == 10
    # fp32; the cache changes only the attention's shapes (summation order within SDPA)
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, atol=1e-5, rtol=1e-5)
    assert all(layer.self_attn.cache is None for layer in model.layers)  # the training model again


def test_top_p_filter_equals_transformers():
    torch.manual_seed(0)
    scores = torch.randn(4, 61) * 3
    for top_p in (0.3, 0.8, 0.95):
        want = transformers.TopPLogitsWarper(top_p)(None, scores.clone())
        torch.testing.assert_close(top_p_filter(scores, top_p), want, atol=0, rtol=0)
    assert torch.isinf(top_p_filter(scores, 0.3)).any()


def test_sampling_is_seeded_and_differs_from_greedy(checkpoint):
    path, want = checkpoint
    model = _decoder(path)
    kw = dict(max_new_tokens=NEW, eos_id=None, device=CPU)
    one = generate(model, PROMPTS, sampling=SAMPLED, step=5, **kw)
    assert one == generate(model, PROMPTS, sampling=SAMPLED, step=5, **kw)
    assert one != generate(model, PROMPTS, sampling=SAMPLED, step=6, **kw)
    assert one != generate(model, PROMPTS, **kw)
    assert all(len(o) == NEW for o in one)  # eos_id=None: every row runs to max_new_tokens


@pytest.mark.parametrize("arch", ["qwen2", "mistral", "gemma3", "gemma2"])
def test_sliding_window_and_softcapped_layers_cache_and_equal_transformers(tmp_path, arch):
    """Windows of 5-6 positions, prompts of 5-7 and 12 new tokens: the windows cut in during
    decoding, on every layer (Mistral), on all but the first (Qwen2) or alternating (Gemma 3,
    and Gemma 2 with soft-capped attention and final logits)."""
    from models.arch_fixture import load_reference as load_arch
    from models.arch_fixture import make_hf

    make_hf(str(tmp_path), arch, seed=3)
    ref, want = load_arch(str(tmp_path)), []
    with torch.no_grad():
        for p in PROMPTS:
            out = ref.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(p):].tolist()
            want.append(out)
    model = _decoder(str(tmp_path))
    assert any(model.cfg.window(i) is not None for i in range(model.cfg.n_layers))
    assert generate(model, PROMPTS, max_new_tokens=NEW, eos_id=None, device=CPU) == want
    assert generate(model, PROMPTS, max_new_tokens=NEW, eos_id=None, device=CPU, cache=False) == want


def _ranks(rank: int, world: int, path: str, want: list[list[int]], sampled: list[list[int]],
           kv1: tuple[str, list[list[int]]], per_prompt: list[list[int]]) -> None:
    failures = []
    kw = dict(max_new_tokens=NEW, eos_id=EOS, device=CPU)
    tp = ParallelGrid.build(tp=2, dp=1, pp=1, device=CPU)
    replicated = _decoder(kv1[0], tp_rank=rank, tp_size=2, group=tp.tp_group)
    assert replicated.layers[0].self_attn.replicas == 2
    got = generate(replicated, PROMPTS, **kw)
    if got != kv1[1]:
        failures.append(f"tp=2 over one replicated kv head: {got} != {kv1[1]}")
    for sp in (False, True):
        model = _decoder(path, tp_rank=rank, tp_size=2, group=tp.tp_group, sp=sp)
        for cache in (True, False):
            got = generate(model, PROMPTS, cache=cache, **kw)
            if got != want:
                failures.append(f"tp=2 sp={sp} cache={cache}: {got} != {want}")
        drawn = generate(model, PROMPTS, max_new_tokens=NEW, eos_id=None, device=CPU, sampling=SAMPLED, step=5)
        every = [None, None]
        dist.all_gather_object(every, drawn, group=tp.tp_group)
        if every[0] != every[1]:
            failures.append(f"tp=2 sp={sp}: the ranks drew different tokens {every}")
        if drawn != sampled:  # the same draws as one process (logits equal to ~1e-6)
            failures.append(f"tp=2 sp={sp} sampled {drawn} != single process {sampled}")
        drawn = generate(model, PROMPTS, max_new_tokens=NEW, eos_id=None, device=CPU, sampling=SAMPLED, step=STEPS)
        if drawn != per_prompt:  # a generator per prompt (GRPO's rollouts), the same on every tp rank
            failures.append(f"tp=2 sp={sp} per-prompt draws {drawn} != single process {per_prompt}")
    pp = ParallelGrid.build(tp=1, dp=1, pp=2, device=CPU)
    stage = StageModel(hf_model_config(path), pp=2, pp_rank=rank)
    load_hf_weights(stage, path, tp_rank=0, tp_size=1, strict=False)
    runtime = PipelineRuntime(stage, pp, "1f1b", 1)
    for cache in (True, False):
        got = pipeline_generate(runtime, PROMPTS, max_new_tokens=NEW, eos_id=EOS, cache=cache)
        if got != want:
            failures.append(f"pp=2 cache={cache} on pp rank {rank}: {got} != {want}")
    drawn = pipeline_generate(runtime, PROMPTS, max_new_tokens=NEW, eos_id=None, sampling=SAMPLED, step=5)
    if drawn != sampled:
        failures.append(f"pp=2 sampled on pp rank {rank}: {drawn} != single process {sampled}")
    drawn = pipeline_generate(runtime, PROMPTS, max_new_tokens=NEW, eos_id=None, sampling=SAMPLED, step=STEPS)
    if drawn != per_prompt:
        failures.append(f"pp=2 per-prompt draws on pp rank {rank}: {drawn} != single process {per_prompt}")
    assert not failures, "\n".join(failures)


def test_tp2_and_pp2_equal_transformers(checkpoint, one_kv_head):
    path, want = checkpoint
    sampled = generate(_decoder(path), PROMPTS, max_new_tokens=NEW, eos_id=None, device=CPU, sampling=SAMPLED,
                       step=5)
    assert generate(_decoder(one_kv_head[0]), PROMPTS, max_new_tokens=NEW, eos_id=EOS, device=CPU) == one_kv_head[1]
    per_prompt = generate(_decoder(path), PROMPTS, max_new_tokens=NEW, eos_id=None, device=CPU, sampling=SAMPLED,
                          step=STEPS)
    assert per_prompt != sampled
    spawn(2, _ranks, path, want, sampled, one_kv_head, per_prompt)


@pytest.mark.parametrize("variant", ["latent_q", "plain_q"])
def test_latent_attention_caches_and_equals_transformers(tmp_path, variant):
    """DeepSeek-V3's MLA (a query latent with interleaved RoPE; one q_proj with YaRN, whose
    softmax scale is not head_dim^-1/2) decodes from its cache as transformers' generate does."""
    from models.deepseek_fixture import load_reference as load_deepseek
    from models.deepseek_fixture import make_hf_deepseek

    make_hf_deepseek(str(tmp_path), variant, seed=5)
    ref, want = load_deepseek(str(tmp_path)), []
    with torch.no_grad():
        for p in PROMPTS:
            want.append(ref.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                                     pad_token_id=0)[0, len(p):].tolist())
    model = _decoder(str(tmp_path))
    assert model.cfg.mla
    assert generate(model, PROMPTS, max_new_tokens=NEW, eos_id=None, device=CPU) == want
    assert generate(model, PROMPTS, max_new_tokens=NEW, eos_id=None, device=CPU, cache=False) == want
