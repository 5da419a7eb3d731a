"""HF Llama import/export against transformers itself, at tp=1 (in process) and tp=2 (gloo).

One spawned group checks every variant at tp=2: logits, token-weighted loss, export
round trip (bit-exact tensors, transformers reload) and a sharded export.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from multirank import spawn
from safetensors.torch import load_file, save_file

from megaft.config.model import ModelConfig
from megaft.inference.generate import full_logits
from megaft.models.decoder import Decoder
from megaft.models.hf.config import hf_model_config
from megaft.models.hf.export import export_hf
from megaft.models.hf.load import HFCheckpointError, checkpoint_files, load_hf_weights
from models.hf_fixture import LLAMA3_ROPE, VOCAB, checkpoint_tensors, load_reference, make_hf_llama, padded_lines

# fp32 on both sides; the only differences are summation orders (sdpa vs eager
# attention, tp partial sums), worth ~1e-6 on logits of magnitude ~1.
ATOL = RTOL = 1e-5
VARIANTS = {
    "plain": dict(bias=True),  # untied, q/k/v/o and MLP biases
    "tied": dict(tie=True, seed=1),
    "sharded": dict(bias=True, max_shard_size=100_000),  # same weights as plain, 3 files + index
    "llama3": dict(rope=LLAMA3_ROPE, seed=2),
}
TP2_VARIANTS = ("plain", "tied", "sharded")  # llama3 rope does not depend on tp


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    for name, kwargs in VARIANTS.items():
        make_hf_llama(str(root / name), **kwargs)
    return {name: str(root / name) for name in VARIANTS}


def _read_json(file: str) -> dict:
    with open(file) as f:
        return json.load(f)


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded lines of different lengths; labels are next tokens, -100 on padding."""
    return padded_lines([13, 5, 9], seed=seed)


def _reference_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum over lines of each line's summed CE, over the batch's target count."""
    total = sum(F.cross_entropy(logits[i], labels[i], ignore_index=-100, reduction="sum")
                for i in range(len(labels)))
    return total / (labels != -100).sum()


def check_variant(path: str, out: str, *, tp_rank: int, tp_size: int, group, max_shard_bytes: int) -> None:
    """Import `path`, compare logits and loss with transformers, export to `out` and reload."""
    cfg = hf_model_config(path)
    model = Decoder(cfg, group=group)
    load_hf_weights(model, path, tp_rank=tp_rank, tp_size=tp_size)
    reference = load_reference(path)
    ids = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(ids).logits
        torch.testing.assert_close(full_logits(model, ids), expected, atol=ATOL, rtol=RTOL)
        # (b) token-weighted loss over right-padded lines of unequal length
        ids, labels = _batch(1)
        loss = model.loss_sum(ids, labels) / (labels != -100).sum()
        torch.testing.assert_close(loss, _reference_loss(reference(ids).logits, labels), atol=ATOL, rtol=RTOL)
    # (c) export: every tensor comes back bit-exact and transformers loads the directory
    export_hf(model, cfg, out, tokenizer_json=path, tp_group=group, is_writer=tp_rank == 0,
              max_shard_bytes=max_shard_bytes)
    exported, original = checkpoint_tensors(out), checkpoint_tensors(path)
    assert exported.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    assert os.path.isfile(os.path.join(out, "tokenizer.json"))
    assert (max_shard_bytes < 10**6) == os.path.isfile(os.path.join(out, "model.safetensors.index.json"))
    assert not [n for n in os.listdir(os.path.dirname(out)) if n.startswith(".")], "temp dir left behind"
    config = _read_json(os.path.join(out, "config.json"))
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (2, 1, 0)
    reloaded = load_reference(out)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, reference(ids).logits, atol=0, rtol=0)


def _tp2_rank(rank: int, world: int, dirs: dict[str, str], out_root: str) -> None:
    for name in TP2_VARIANTS:
        # A small shard limit on one variant exercises the multi-file export path.
        limit = 50_000 if name == "plain" else 10**9
        check_variant(dirs[name], os.path.join(out_root, name, "export"), tp_rank=rank, tp_size=world,
                      group=dist.group.WORLD, max_shard_bytes=limit)


def test_tp1_matches_transformers(hf_dirs, tmp_path):
    for name, path in hf_dirs.items():
        check_variant(path, str(tmp_path / name / "export"), tp_rank=0, tp_size=1, group=None,
                      max_shard_bytes=10**9)


def test_tp2_matches_transformers(hf_dirs, tmp_path):
    spawn(2, _tp2_rank, hf_dirs, str(tmp_path))


def test_sharded_checkpoint_equals_single_file(hf_dirs):
    assert os.path.isfile(os.path.join(hf_dirs["sharded"], "model.safetensors.index.json"))
    assert len(set(checkpoint_files(hf_dirs["sharded"]).values())) > 1
    a, b = checkpoint_tensors(hf_dirs["plain"]), checkpoint_tensors(hf_dirs["sharded"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_config_mapping(hf_dirs, tmp_path):
    cfg = hf_model_config(hf_dirs["plain"], base=ModelConfig(max_seq_len=4096, dropout=0.1))
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.kv_heads, cfg.hd, cfg.ffn_dim) == (64, 2, 4, 2, 16, 96)
    assert (cfg.vocab_size, cfg.norm_eps, cfg.rope_theta, cfg.rope_scaling) == (VOCAB, 1e-5, 10000.0, None)
    assert cfg.attention_bias and cfg.mlp_bias and not cfg.tie_embeddings
    assert cfg.max_seq_len == 64 and cfg.dropout == 0.1  # max_position_embeddings; base's other fields kept
    assert cfg.extra == {"bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0, "max_position_embeddings": 64}
    # The checkpoint's limit, not the preset's (issue 14): max_position_embeddings sets max_seq_len.
    assert hf_model_config(hf_dirs["tied"], base=ModelConfig(max_seq_len=32)).max_seq_len == 64
    assert hf_model_config(hf_dirs["tied"]).tie_embeddings
    llama3 = hf_model_config(hf_dirs["llama3"])
    assert llama3.rope_theta == 500000.0
    assert llama3.rope_scaling == {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
    # Pre-transformers-5 layout: top-level rope_theta and rope_scaling with "type".
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    raw = _read_json(os.path.join(hf_dirs["llama3"], "config.json"))
    raw.pop("rope_parameters")
    raw["rope_theta"] = 500000.0
    raw["rope_scaling"] = {"type": "llama3", **{k: v for k, v in LLAMA3_ROPE.items()
                                                if k not in ("rope_theta", "rope_type")}}
    (legacy / "config.json").write_text(json.dumps(raw))
    old = hf_model_config(str(legacy))
    assert (old.rope_theta, old.rope_scaling) == (llama3.rope_theta, llama3.rope_scaling)


def _expect(match: str, fn, *args, **kwargs) -> str:
    with pytest.raises(HFCheckpointError) as info:
        fn(*args, **kwargs)
    assert match in str(info.value), str(info.value)
    return str(info.value)


def test_config_errors(hf_dirs, tmp_path):
    _expect(f"{tmp_path}/config.json: not found", hf_model_config, str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    _expect(f"{tmp_path}/config.json: cannot read it as JSON", hf_model_config, str(tmp_path))
    raw = _read_json(os.path.join(hf_dirs["plain"], "config.json"))
    for change, match in (({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
                          ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
                          ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1.0}}, "rope type 'longrope'")):
        (tmp_path / "config.json").write_text(json.dumps({**raw, **change}))
        _expect(f"{tmp_path}/config.json: {match}", hf_model_config, str(tmp_path))


def _model(path: str) -> Decoder:
    return Decoder(hf_model_config(path))


def test_weight_errors(hf_dirs, tmp_path):
    plain = hf_dirs["plain"]
    bad = tmp_path / "bad"
    bad.mkdir()
    shutil.copy(os.path.join(plain, "config.json"), bad)
    model, file = _model(plain), str(bad / "model.safetensors")
    _expect(f"{bad}: no model.safetensors or model.safetensors.index.json", load_hf_weights, model, str(bad),
            tp_rank=0, tp_size=1)
    tensors = load_file(os.path.join(plain, "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"}, file)
    _expect(f"{file}: tensors missing from the checkpoint: model.layers.1.mlp.up_proj.weight",
            load_hf_weights, model, str(bad), tp_rank=0, tp_size=1)
    save_file({**tensors, "model.layers.0.mlp.up_proj.weight": tensors["model.layers.0.mlp.up_proj.weight"][:95]},
              file)
    _expect(f"{file}: tensor model.layers.0.mlp.up_proj.weight has shape [95, 64], expected [96, 64]",
            load_hf_weights, model, str(bad), tp_rank=0, tp_size=1)
    # Unexpected tensors are errors unless strict=False; rotary inv_freq buffers are tolerated.
    save_file({**tensors, "model.layers.0.extra.weight": torch.zeros(2),
               "model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(8)}, file)
    message = _expect(f"{file}: unexpected tensors (not in the model; strict=False ignores them): "
                      "model.layers.0.extra.weight", load_hf_weights, model, str(bad), tp_rank=0, tp_size=1)
    assert "inv_freq" not in message
    load_hf_weights(model, str(bad), tp_rank=0, tp_size=1, strict=False)
    # A sharded checkpoint whose index names a file that is gone.
    sharded = tmp_path / "sharded"
    shutil.copytree(hf_dirs["sharded"], sharded)
    os.remove(sharded / "model-00002-of-00003.safetensors")
    _expect(f"{sharded}/model-00002-of-00003.safetensors: listed in {sharded}/model.safetensors.index.json "
            "but not found", load_hf_weights, model, str(sharded), tp_rank=0, tp_size=1)


def test_failed_load_leaves_model_untouched(hf_dirs, tmp_path):
    """Names and shapes are checked before any parameter is written."""
    model = _model(hf_dirs["plain"])
    with torch.no_grad():
        for p in model.parameters():  # built with torch.empty: give it comparable values
            p.fill_(0.25)
    tensors = load_file(os.path.join(hf_dirs["plain"], "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:3]
    shutil.copy(os.path.join(hf_dirs["plain"], "config.json"), tmp_path)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(HFCheckpointError):
        load_hf_weights(model, str(tmp_path), tp_rank=0, tp_size=1)
    assert all(bool((p == 0.25).all()) for p in model.parameters())


def test_export_copies_the_tokenizer_chat_template_and_generation_files(hf_dirs, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(hf_dirs["tied"], src)
    sidecars = {"tokenizer_config.json": '{"model_max_length": 64}', "special_tokens_map.json": "{}",
                "chat_template.jinja": "{{ messages[0]['content'] }}", "tokenizer.model": "\x00spm",
                "generation_config.json": '{"eos_token_id": [1, 3]}', "notes.txt": "not exported"}
    for name, text in sidecars.items():
        (src / name).write_text(text)
    model = _model(str(src))
    load_hf_weights(model, str(src), tp_rank=0, tp_size=1)
    out = tmp_path / "out"
    export_hf(model, model.cfg, str(out), tokenizer_json=str(src), tp_group=None, is_writer=True)
    for name, text in sidecars.items():
        assert (out / name).is_file() == (name != "notes.txt"), name
        if name != "notes.txt":
            assert (out / name).read_text() == text, name
    assert (out / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()


def test_export_replaces_existing_dir(hf_dirs, tmp_path):
    """An older export is replaced whole (no stale files); no temp dirs remain."""
    model = _model(hf_dirs["tied"])
    load_hf_weights(model, hf_dirs["tied"], tp_rank=0, tp_size=1)
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.safetensors").write_text("old")
    export_hf(model, model.cfg, str(out), tokenizer_json=None, tp_group=None, is_writer=True)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert os.listdir(tmp_path) == ["out"]
