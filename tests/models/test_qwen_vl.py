"""Qwen2.5-VL (megaft.models.vision.qwen_*) against transformers' Qwen2_5_VLForConditionalGeneration
on a tiny random checkpoint it saved (transformers 5's nested config): M-RoPE positions,
logits, loss and every parameter's gradient at tp=1 (in process) and tp=2 with and without
sequence parallel (gloo; the tower replicated on both ranks), then the export round trip
(the published names and flat config.json, tensors bit-exact, transformers reloads it with
the same logits). The fixture's images have three grid shapes, windows cut by the image's
edge and one full-attention block among three, so the window order, the 2-D rotary and the
merger's order all enter the comparison."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from multirank import spawn

from megaft.models.arch.spec import HFConfigError
from megaft.models.vision.hf import export_vision_language, load_vision_language_weights, qwen_hf_names
from megaft.models.vision.model import ImageTokenMismatch
from megaft.models.vision.qwen_config import qwen_vl_config
from megaft.models.vision.qwen_model import QwenVLModel, mrope_positions
from megaft.parallel.comm import group_rank, group_size
from megaft.parallel.tensor.grads import sync_sequence_parallel_grads
from megaft.parallel.tensor.shard import shard_of
from models.hf_fixture import checkpoint_tensors
from models.qwen_vl_fixture import IMAGE, MERGE, make_hf_qwen_vl, qwen_batch

pytestmark = pytest.mark.exact


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen_vl"))
    make_hf_qwen_vl(path)
    return path


def _reference(path: str):
    return transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").train()


def _batch(seq: int = 24):
    """qwen_batch() cut to `seq` tokens (19: an odd length, sequence parallel pads; no image is cut)."""
    ids, labels, pixels, grid = qwen_batch()
    labels = labels[:, :seq].clone()
    labels[:, -1] = -100  # its target was cut off
    return ids[:, :seq], labels, pixels, grid


def _hf_inputs(ids, pixels, grid):
    return dict(input_ids=ids, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=(ids == IMAGE).int())


def _reference_run(path: str, seq: int = 24):
    model = _reference(path)
    ids, labels, pixels, grid = _batch(seq)
    out = model(**_hf_inputs(ids, pixels, grid), labels=F.pad(labels[:, :-1], (1, 0), value=-100))
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _local(full: torch.Tensor, param: torch.Tensor, group) -> torch.Tensor:
    spec = shard_of(param)
    if spec is None:
        return full
    start, end = spec.real_bounds(group_rank(group), group_size(group))
    return full.narrow(spec.dim, start, end - start)


def _scale_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    # fp32 both sides, sums in other orders (SDPA vs eager, tp partial sums, the gathered rotary): rounding of
    # ~1e-7 relative to the largest element summed; 1e-5 of the tensor's largest element holds on any CPU path
    torch.testing.assert_close(got, want, atol=float(1e-5 * want.abs().max()), rtol=0, msg=lambda m: f"{what}: {m}")


def check_layout(path: str, out: str, group, sequence_parallel: bool = False, seq: int = 24) -> None:
    """Our model at tp=group's size against transformers; then export and compare."""
    want_logits, want_loss, want_grads = _reference_run(path, seq)
    cfg = qwen_vl_config(path)
    model = QwenVLModel(cfg, group=group, sequence_parallel=sequence_parallel)
    load_vision_language_weights(model, path, tp_rank=group_rank(group), tp_size=group_size(group))
    ids, labels, pixels, grid = _batch(seq)
    logits = model(ids, pixels, grid)
    head = shard_of(model.language_model.lm_head.weight)
    start, end = head.real_bounds(group_rank(group), group_size(group)) if head else (0, want_logits.shape[-1])
    _scale_close(logits[..., :end - start], want_logits[..., start:end], "logits")
    loss = model.loss_sum(ids, labels, pixels, grid) / (labels != -100).sum()
    _scale_close(loss, want_loss, "loss")
    loss.backward()
    sync_sequence_parallel_grads(list(model.parameters()), group)  # what the optimizer does (sp: norms, tower)
    checked = set()
    for name, param in model.named_parameters():
        ref_name = next(n for n in qwen_hf_names(name, cfg.text.arch) if n in want_grads)
        want = _local(want_grads[ref_name], param, group)
        assert want.abs().max() > 0, f"{ref_name}: no gradient in transformers (the test would prove nothing)"
        spec = shard_of(param)
        got = param.grad.narrow(spec.dim, 0, want.shape[spec.dim]) if spec is not None else param.grad
        _scale_close(got, want, f"grad of {name}")
        checked.add(ref_name)
    assert checked == set(want_grads)  # every parameter of transformers' model
    export_vision_language(model, out, tokenizer_json=path, tp_group=group, is_writer=group_rank(group) == 0)
    original, exported = checkpoint_tensors(path), checkpoint_tensors(out)
    assert exported.keys() == original.keys()  # transformers saves the published names: model.*, visual.*
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    reloaded, info = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensors
    with torch.no_grad():
        again = reloaded(**_hf_inputs(ids, pixels, grid)).logits
    torch.testing.assert_close(again, want_logits, atol=0, rtol=0)


def test_mrope_positions_equal_get_rope_index(hf_dir):
    model = _reference(hf_dir)
    ids, _, _, grid = qwen_batch()
    want, _ = model.model.get_rope_index(ids, (ids == IMAGE).int(), grid)
    assert torch.equal(mrope_positions(ids, IMAGE, grid, MERGE), want)
    with pytest.raises(ImageTokenMismatch, match="a run of 6 image tokens for an image of 4"):
        mrope_positions(ids, IMAGE, grid[[2, 1, 0]], MERGE)


def test_tp1_matches_transformers(hf_dir, tmp_path):
    check_layout(hf_dir, str(tmp_path / "export"), None)


def _tp2_rank(rank: int, world: int, path: str, out: str) -> None:
    check_layout(path, out, dist.group.WORLD)
    # sequence parallel: 19 tokens padded to shards of 10; row 0 has an image on each rank's shard, row 1's
    # image straddles the two (positions 7-10)
    check_layout(path, out + "-sp", dist.group.WORLD, sequence_parallel=True, seq=19)


def test_tp2_and_sequence_parallel_match_transformers(hf_dir, tmp_path):
    spawn(2, _tp2_rank, hf_dir, str(tmp_path / "export"))


def test_windows_and_mrope_matter(hf_dir):
    """The equality above would be weak if the windows or the 3-D positions changed nothing:
    full attention in every tower block, or 1-D positions, move the logits far past the tolerance."""
    cfg = qwen_vl_config(hf_dir)
    model = QwenVLModel(cfg)
    load_vision_language_weights(model, hf_dir, tp_rank=0, tp_size=1)
    ids, _, pixels, grid = qwen_batch()
    with torch.no_grad():
        logits = model(ids, pixels, grid)
        model.visual.cfg = dataclasses.replace(cfg.vision, full_attention=(0, 1, 2))
        full = model(ids, pixels, grid)
        model.visual.cfg = cfg.vision
        model.docs = lambda x, g: dataclasses.replace(QwenVLModel.docs(model, x, g), dim_positions=None)
        flat = model(ids, pixels, grid)
    scale = logits.abs().max()
    assert (full - logits).abs().max() > 1e-2 * scale
    assert (flat - logits).abs().max() > 1e-2 * scale


def test_published_config_round_trip(hf_dir, tmp_path):
    """The exported flat config.json (the published checkpoints' form) reads back to the same
    config as transformers 5's nested one; wrong shapes of the rotary or windows are named."""
    model = QwenVLModel(qwen_vl_config(hf_dir))
    load_vision_language_weights(model, hf_dir, tp_rank=0, tp_size=1)
    out = export_vision_language(model, str(tmp_path / "out"), tokenizer_json=hf_dir, tp_group=None, is_writer=True)
    raw = json.loads(open(os.path.join(out, "config.json")).read())
    assert "text_config" not in raw and raw["rope_scaling"] == {"type": "mrope", "mrope_section": [2, 3, 3]}
    first, again = qwen_vl_config(hf_dir), qwen_vl_config(out)
    assert dataclasses.replace(again, text=None) == dataclasses.replace(first, text=None)
    assert dataclasses.replace(again.text, name="", init_from="") == dataclasses.replace(first.text, name="",
                                                                                         init_from="")
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    raw["rope_scaling"]["mrope_section"] = [2, 3, 4]
    (bad / "config.json").write_text(json.dumps(raw))
    with pytest.raises(HFConfigError, match=r"mrope_section \[2, 3, 4\] sums to 9, not head_dim / 2 = 8"):
        qwen_vl_config(str(bad))
    raw["rope_scaling"]["mrope_section"] = [2, 3, 3]
    raw["vision_config"]["window_size"] = 12
    (bad / "config.json").write_text(json.dumps(raw))
    with pytest.raises(HFConfigError, match="window_size=12 must be a multiple of spatial_merge_size"):
        qwen_vl_config(str(bad))
    ids, _, pixels, grid = qwen_batch()
    with pytest.raises(ImageTokenMismatch, match="Image features and image tokens do not match: 16 image tokens, "
                                                 "12 image features"):
        model.embed(ids, pixels, grid[:2])


def test_lora_on_the_language_model_loads_in_peft(hf_dir, tmp_path):
    """Adapters on the language model (the tower frozen), exported for peft: peft's
    Qwen2_5_VLForConditionalGeneration with the adapter gives our logits, with no adapter in the
    tower (whose MLP has the language model's gate/up/down names)."""
    import peft

    from megaft.config.lora import LoraConfig
    from megaft.peft.lora import adapters
    from megaft.peft.vision import apply_vision_lora, export_vision_adapter

    lora = LoraConfig(rank=4, alpha=8.0)
    model = QwenVLModel(qwen_vl_config(hf_dir))
    load_vision_language_weights(model, hf_dir, tp_rank=0, tp_size=1)
    apply_vision_lora(model, lora, seed=0, tp_rank=0, tp_size=1)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        n for n, _ in model.named_parameters() if ".adapter." in n} != set()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, adapter in adapters(model.language_model):  # B starts at zero: give the update a value
            adapter.B.copy_(torch.randn(adapter.B.shape, generator=gen) * 0.1)
    ids, _, pixels, grid = qwen_batch()
    with torch.no_grad():
        ours = model(ids, pixels, grid)
    out = export_vision_adapter(model, lora, str(tmp_path / "adapter"), tp_group=None, is_writer=True, base=hf_dir)
    theirs_model = peft.PeftModel.from_pretrained(_reference(hf_dir), out).eval()
    lora_modules = [n for n, m in theirs_model.named_modules() if hasattr(m, "lora_A") and len(m.lora_A)]
    assert len(lora_modules) == len(list(adapters(model.language_model))) == 2 * 7
    assert not any(".visual." in n for n in lora_modules)
    with torch.no_grad():
        theirs = theirs_model(**_hf_inputs(ids, pixels, grid)).logits
        with theirs_model.disable_adapter():
            plain = theirs_model.get_base_model()(**_hf_inputs(ids, pixels, grid)).logits
    _scale_close(ours[..., :theirs.shape[-1]], theirs, "logits with adapters")
    assert (theirs - plain).abs().max() > 1e-2 * theirs.abs().max()  # the adapters matter


def test_greedy_generation_with_images_equals_transformers(hf_dir):
    """megaft.inference.vision against transformers' generate (greedy) on a prompt with two images,
    with the KV cache (the prompt's M-RoPE positions, then the text continuing at the last one + 1:
    the cache's rope_offset, transformers' rope_deltas) and without."""
    from megaft.inference.kv_cache import kv_cache
    from megaft.inference.vision import generate_with_images

    ids, _, pixels, grid = qwen_batch()
    prompt = ids[0, :21]  # both images of row 0, then one text token
    patches, grids = pixels[:48], grid[:2]
    model = QwenVLModel(qwen_vl_config(hf_dir))
    load_vision_language_weights(model, hf_dir, tp_rank=0, tp_size=1)
    reference = _reference(hf_dir).eval()
    want = reference.generate(**_hf_inputs(prompt[None], patches, grids), max_new_tokens=8, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    cpu = torch.device("cpu")
    got = generate_with_images(model, prompt.tolist(), (patches, grids), max_new_tokens=8, eos_id=None, device=cpu)
    assert got == want and len(got) == 8
    uncached = generate_with_images(model, prompt.tolist(), (patches, grids), max_new_tokens=8, eos_id=None,
                                    device=cpu, cache=False)
    assert uncached == want
    # the cached steps' logits, not only their argmax, against the whole sequence's
    full = torch.tensor(prompt.tolist() + got[:3])
    with torch.no_grad(), kv_cache(model, len(full)) as state:
        state.real = len(prompt)
        model(prompt[None], patches, grids)
        assert state.rope_offset == -2 * (6 - 3)  # each image: 6 tokens (2x3 merged) advance the text by 3
        state.advance()
        steps = []
        for token in got[:3]:
            state.real = 1
            steps.append(model(torch.tensor([[token]]))[0, -1])
            state.advance()
        whole = model(full[None], patches, grids)[0, len(prompt):]
    torch.testing.assert_close(torch.stack(steps), whole, atol=1e-5 * float(whole.abs().max()), rtol=0)
    with torch.no_grad(), kv_cache(model, len(full)) as state:  # the offset matters: without it, other logits
        state.real = len(prompt)
        model(prompt[None], patches, grids)
        state.advance()
        state.rope_offset, state.real = 0, 1
        plain = model(torch.tensor([[got[0]]]))[0, -1]
    assert (plain - whole[0]).abs().max() > 1e-3 * whole.abs().max()


QWEN25_VL_7B_TEXT = {"attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu",
                     "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944,
                     "max_position_embeddings": 128000, "max_window_layers": 28, "num_attention_heads": 28,
                     "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
                     "use_cache": True, "use_sliding_window": False, "vocab_size": 152064}


@pytest.mark.parametrize("form", ["4.49", "4.53"])
def test_published_qwen2_5_vl_7b_config_forms(tmp_path, form):
    """Qwen2.5-VL-7B-Instruct's config.json, transcribed here in two forms: the 4.53.1 one as a public
    repository vendors the hub's file (the text fields at the top and again in a text_config with
    model_type qwen2_5_vl_text, layer_types and null token ids; rope_type default beside type;
    in_chans beside in_channels), and the older flat one without text_config (rope_scaling type
    mrope). Both read to the 7B's shapes."""
    vision = {"depth": 32, "fullatt_block_indexes": [7, 15, 23, 31], "hidden_act": "silu", "hidden_size": 1280,
              "in_chans": 3, "intermediate_size": 3420, "model_type": "qwen2_5_vl", "num_heads": 16,
              "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "spatial_patch_size": 14,
              "temporal_patch_size": 2, "tokens_per_second": 2, "window_size": 112}
    raw = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], **QWEN25_VL_7B_TEXT, "image_token_id": 151655,
           "model_type": "qwen2_5_vl", "sliding_window": 32768, "tie_word_embeddings": False,
           "torch_dtype": "bfloat16", "video_token_id": 151656, "vision_end_token_id": 151653,
           "vision_start_token_id": 151652, "vision_token_id": 151654}
    if form == "4.49":
        raw.update(rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}, vision_config=vision,
                   transformers_version="4.49.0.dev0")
    else:
        rope = {"mrope_section": [16, 24, 24], "rope_type": "default", "type": "default"}
        raw.update(rope_scaling=rope, transformers_version="4.53.1",
                   vision_config={**vision, "in_channels": 3, "initializer_range": 0.02, "torch_dtype": "float32"},
                   text_config={"architectures": ["Qwen2_5_VLForConditionalGeneration"], **QWEN25_VL_7B_TEXT,
                                "image_token_id": None, "layer_types": ["full_attention"] * 28,
                                "model_type": "qwen2_5_vl_text", "rope_scaling": rope, "sliding_window": None,
                                "torch_dtype": "float32", "video_token_id": None, "vision_end_token_id": 151653,
                                "vision_start_token_id": 151652, "vision_token_id": 151654})
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = qwen_vl_config(str(tmp_path))
    t, v = cfg.text, cfg.vision
    assert (t.arch, t.dim, t.n_layers, t.n_heads, t.kv_heads, t.hd, t.ffn_dim, t.vocab_size) == (
        "qwen2", 3584, 28, 28, 4, 128, 18944, 152064)
    assert (t.rope_theta, t.norm_eps, t.qkv_bias, t.tie_embeddings, t.window(0)) == (1e6, 1e-6, True, False, None)
    assert cfg.mrope_section == (16, 24, 24) and cfg.image_token_id == 151655 and cfg.vision_start_token_id == 151652
    assert (v.dim, v.ffn_dim, v.n_layers, v.n_heads, v.out_dim, v.patch_size, v.merge, v.window_size,
            v.full_attention, v.channels) == (1280, 3420, 32, 16, 3584, 14, 2, 112, (7, 15, 23, 31), 3)
