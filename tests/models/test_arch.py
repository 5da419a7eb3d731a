"""Every supported family (Llama 3.x tied and untied, Qwen2, Qwen3, Mistral, Gemma)
against transformers: tp=1 in process, tp=2 and pp=2 in one 2-rank spawn each, and tp=4
over 2 kv heads (replicated kv heads) in one 4-rank spawn. See arch_cases.py for what
each check compares and arch_fixture.py for what each checkpoint exercises."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from multirank import spawn

from megaft.inference.generate import full_logits
from megaft.models.decoder import Decoder
from megaft.models.hf.config import hf_model_config
from megaft.models.hf.load import load_hf_weights
from models.arch_cases import check_tp, pp2_rank_fn, raise_failures, tp_rank_fn, wide_tp_rank_fn
from models.arch_fixture import ARCHS, MODEL_TYPE, make_hf, sample_ids


@pytest.fixture(scope="module")
def arch_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("arch")
    for name in ARCHS:
        make_hf(str(root / name), name)
    return {name: str(root / name) for name in ARCHS}


def test_tp1_matches_transformers(arch_dirs, tmp_path):
    failures = []
    for name, path in arch_dirs.items():
        assert hf_model_config(path).arch == MODEL_TYPE.get(name, name)
        failures += check_tp(path, str(tmp_path / name), tag=f"{name} tp=1", tp_rank=0, tp_size=1, group=None)
    raise_failures(failures, "tp=1")


# The family's difference, switched off: the logits must move by far more than ATOL,
# so the equality above is not vacuous (each feature is really exercised).
WITHOUT = {
    "llama3": dict(rope_scaling=None), "qwen2": dict(qkv_bias=False), "qwen3": dict(qk_norm=False),
    "mistral": dict(sliding_window=None), "gemma": dict(scale_embeddings=False),
    "gemma2": [dict(attn_softcap=None), dict(final_softcap=None)],
    "gemma3": [dict(sandwich_norms=False), dict(query_pre_attn_scalar=None), dict(rope_local=None),
               dict(sliding_window=None, layer_types=None)],
}


def test_each_feature_moves_the_logits(arch_dirs):
    ids = sample_ids()
    for name, change in [(n, c) for n, cs in WITHOUT.items() for c in (cs if isinstance(cs, list) else [cs])]:
        cfg = hf_model_config(arch_dirs[name])
        logits = []
        for c in (cfg, dataclasses.replace(cfg, **change)):
            model = Decoder(c)
            load_hf_weights(model, arch_dirs[name], tp_rank=0, tp_size=1, strict=False)
            with torch.no_grad():
                logits.append(full_logits(model, ids))
        assert (logits[0] - logits[1]).abs().max() > 1e-3, f"{name}: {change} does not change the logits"


def test_qwen2_window_only_on_upper_layers(arch_dirs):
    cfg = hf_model_config(arch_dirs["qwen2"])  # max_window_layers=1: layer 0 full, layer 1 sliding
    assert (cfg.window(0), cfg.window(1)) == (None, 5)
    assert cfg.layer_types == ["full_attention", "sliding_attention"]


def test_tp2_matches_transformers(arch_dirs, tmp_path):
    spawn(2, tp_rank_fn, arch_dirs, str(tmp_path))


def test_pp2_matches_transformers(arch_dirs, tmp_path):
    spawn(2, pp2_rank_fn, arch_dirs, str(tmp_path))


def test_tp4_replicated_kv_heads_equal_tp1(arch_dirs, tmp_path):
    """2 kv heads over 4 ranks: each kv head on 2 ranks."""
    spawn(4, wide_tp_rank_fn, arch_dirs, str(tmp_path))


def test_summary_names_the_attention_each_run_computes_with(arch_dirs):
    from megaft.models.attention.gqa import attention_record

    cpu = torch.device("cpu")
    mistral, llama = hf_model_config(arch_dirs["mistral"]), hf_model_config(arch_dirs["llama3"])  # window 6, none

    def record(cfg, **kw):
        return attention_record(cfg, **{"packing": "stream", "cp": 1, "seq_len": 16, "device": cpu, **kw})

    assert record(mistral) == "sdpa_window_mask" and record(mistral, seq_len=6) == "sdpa_causal"
    assert record(llama) == "sdpa_causal" and record(llama, packing="docs") == "sdpa_mask"
    assert record(mistral, cp=2) == record(llama, cp=2, packing="docs") == "ring"
    gemma2 = hf_model_config(arch_dirs["gemma2"])  # soft-capped scores: the explicit form, packed or not
    assert record(gemma2) == record(gemma2, packing="docs") == "explicit_softcap"
