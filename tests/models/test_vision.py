"""Gemma 3 with images (megaft.models.vision) against transformers' Gemma3ForConditionalGeneration
on a tiny random checkpoint it saved: logits, loss and every parameter's gradient at tp=1 (in
process) and tp=2 (gloo), then the export round trip (bit-exact tensors, transformers reloads
it). The bidirectional image mask matters here: the fixture's window (3) is shorter than an
image (4 tokens), and the test checks that a causal-only mask would have given other logits."""
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
from safetensors.torch import load_file, save_file
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from megaft.config import Config
from megaft.config.lora import LoraConfig
from megaft.data.errors import DataError
from megaft.data.formats import parse_record
from megaft.inference.kv_cache import kv_cache
from megaft.inference.vision import generate_with_images
from megaft.models.arch.spec import HFCheckpointError, HFConfigError
from megaft.models.attention.documents import Docs, document_mask, mask_mod
from megaft.models.hf.export import hf_config_dict
from megaft.models.hf.load import checkpoint_files
from megaft.models.vision.config import vision_config_dict, vision_language_config
from megaft.models.vision.hf import export_vision_language, hf_names, load_vision_language_weights
from megaft.models.vision.model import ImageTokenMismatch, VisionLanguageModel, image_blocks
from megaft.parallel.comm import group_rank, group_size
from megaft.parallel.tensor.grads import sync_sequence_parallel_grads
from megaft.parallel.tensor.shard import shard_of
from megaft.peft.lora import adapters
from megaft.peft.vision import apply_vision_lora, export_vision_adapter
from megaft.validation import validate
from models.hf_fixture import checkpoint_tensors
from models.vlm_fixture import IMAGE, hf_gemma3_config, image_batch, make_hf_gemma3

pytestmark = pytest.mark.exact


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gemma3_vlm"))
    make_hf_gemma3(path)
    return path


def _reference(path: str):
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32,
                                                                        attn_implementation="eager")
    return model.train()  # no dropout in the config; train() is what fine-tuning runs


def _batch(seq: int = 20):
    """image_batch() cut to `seq` tokens (an odd length makes sequence parallel pad)."""
    ids, labels, pixels = image_batch()
    labels = labels[:, :seq].clone()
    labels[:, -1] = -100  # its target was cut off
    return ids[:, :seq], labels, pixels


def _reference_run(path: str, seq: int = 20):
    """transformers' logits, loss and gradients (by its parameter names) on _batch(seq)."""
    model = _reference(path)
    ids, labels, pixels = _batch(seq)
    out = model(input_ids=ids, pixel_values=pixels, token_type_ids=(ids == IMAGE).long(),
                labels=F.pad(labels[:, :-1], (1, 0), value=-100))
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return out.logits.detach(), out.loss.detach(), grads


def _local(full: torch.Tensor, param: torch.Tensor, group) -> torch.Tensor:
    """This tp rank's real rows of `full` as `param` holds them (vocabulary padding cropped)."""
    spec = shard_of(param)
    if spec is None:
        return full
    start, end = spec.real_bounds(group_rank(group), group_size(group))
    return full.narrow(spec.dim, start, end - start)


def _scale_close(got: torch.Tensor, want: torch.Tensor, what: str, scale=None) -> None:
    # fp32 both sides, sums in other orders (SDPA vs eager, tp partial sums, the mask path): rounding
    # of ~1e-7 relative to the largest element summed; 1e-5 of the tensor's largest element covers it
    # with margin on any CPU code path (docs/contributing.md "Every CPU")
    scale = want.abs().max() if scale is None else scale
    torch.testing.assert_close(got, want, atol=float(1e-5 * scale), rtol=0, msg=lambda m: f"{what}: {m}")


def check_layout(path: str, out: str, group, sequence_parallel: bool = False, seq: int = 20) -> None:
    """Our model at tp=group's size against transformers; then export and compare."""
    want_logits, want_loss, want_grads = _reference_run(path, seq)
    cfg = vision_language_config(path)
    model = VisionLanguageModel(cfg, group=group, sequence_parallel=sequence_parallel)
    load_vision_language_weights(model, path, tp_rank=group_rank(group), tp_size=group_size(group))
    ids, labels, pixels = _batch(seq)
    logits = model(ids, pixels)
    head = shard_of(model.language_model.lm_head.weight)
    start, end = head.real_bounds(group_rank(group), group_size(group)) if head else (0, want_logits.shape[-1])
    _scale_close(logits[..., :end - start], want_logits[..., start:end], "logits")
    loss = model.loss_sum(ids, labels, pixels) / (labels != -100).sum()
    _scale_close(loss, want_loss, "loss")
    loss.backward()
    sync_sequence_parallel_grads(list(model.parameters()), group)  # what the optimizer does (sp: norms, tower)
    hf_params = set(want_grads)
    checked = 0
    for name, param in model.named_parameters():
        ref_name = next(n for n in ["model." + c if not c.startswith("model.") else c
                                    for c in hf_names(name, cfg.text.arch)] + ["lm_head.weight"]
                        if n in hf_params)
        want = _local(want_grads[ref_name], param, group)
        got = param.grad.narrow(shard_of(param).dim, 0, want.shape[shard_of(param).dim]) \
            if shard_of(param) is not None else param.grad
        scale = None
        if name.startswith("vision_tower.") and name.endswith("k_proj.bias"):
            # zero in exact arithmetic (a key bias shifts every score of a query alike: softmax ignores it),
            # so both sides hold rounding only: measured against the same layer's query-bias gradient
            q_bias = ref_name.replace("k_proj", "q_proj")
            scale = want_grads[q_bias].abs().max()
        else:
            assert want.abs().max() > 0, f"{ref_name}: no gradient in transformers (the test would prove nothing)"
        _scale_close(got, want, f"grad of {name}", scale)
        checked += 1
    assert checked == len(hf_params)  # every parameter (the tied lm_head is the embedding on both sides)
    export_vision_language(model, out, tokenizer_json=path, tp_group=group, is_writer=group_rank(group) == 0)
    original, exported = checkpoint_tensors(path), checkpoint_tensors(out)
    renamed = {n.replace("vision_tower.vision_model.", "vision_tower."): t for n, t in exported.items()}
    assert renamed.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(renamed[name], tensor), name
    assert all(n.startswith(("language_model.model.", "vision_tower.vision_model.", "multi_modal_projector."))
               for n in exported)
    reloaded, info = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensors
    with torch.no_grad():
        again = reloaded(input_ids=ids, pixel_values=pixels, token_type_ids=(ids == IMAGE).long()).logits
    torch.testing.assert_close(again, want_logits, atol=0, rtol=0)


def test_tp1_matches_transformers(hf_dir, tmp_path):
    check_layout(hf_dir, str(tmp_path / "export"), None)


def test_published_layout_round_trip(hf_dir, tmp_path):
    """google/gemma-3-*'s own names (vision_tower.vision_model.*, as transformers 4 saved them) come
    back under the same names, bit for bit."""
    published = tmp_path / "published"
    published.mkdir()
    for name in os.listdir(hf_dir):
        if not name.endswith(".safetensors"):
            shutil.copyfile(os.path.join(hf_dir, name), published / name)
    tensors = {n.replace("vision_tower.", "vision_tower.vision_model.", 1): t
               for n, t in checkpoint_tensors(hf_dir).items()}
    save_file(tensors, str(published / "model.safetensors"), metadata={"format": "pt"})
    model = VisionLanguageModel(vision_language_config(str(published)))
    load_vision_language_weights(model, str(published), tp_rank=0, tp_size=1)
    out = export_vision_language(model, str(tmp_path / "out"), tokenizer_json=str(published), tp_group=None,
                                 is_writer=True, max_shard_bytes=40_000)  # several files and an index
    exported = checkpoint_tensors(out)
    assert len(checkpoint_files(out)) and os.path.isfile(os.path.join(out, "model.safetensors.index.json"))
    assert exported.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert torch.equal(exported[name], tensor), name
    config = json.loads(open(os.path.join(out, "config.json")).read())
    assert (config["model_type"], config["architectures"]) == ("gemma3", ["Gemma3ForConditionalGeneration"])
    first, again = vision_language_config(str(published)), vision_language_config(out)
    assert dataclasses.replace(again, text=None) == dataclasses.replace(first, text=None)
    assert dataclasses.replace(again.text, name="", init_from="") == dataclasses.replace(first.text, name="",
                                                                                         init_from="")


def test_image_mask_and_features_matter(hf_dir):
    """The equality above would be weak if the images changed nothing: a causal-only mask and
    other pixels both move the logits far past the tolerance."""
    cfg = vision_language_config(hf_dir)
    model = VisionLanguageModel(cfg)
    load_vision_language_weights(model, hf_dir, tp_rank=0, tp_size=1)
    ids, _, pixels = image_batch()
    with torch.no_grad():
        logits = model(ids, pixels)
        other = model(ids, pixels.flip(-1))
        model.docs = lambda x: dataclasses.replace(VisionLanguageModel.docs(model, x), image_blocks=None)
        causal = model(ids, pixels)
    scale = logits.abs().max()
    assert (other - logits).abs().max() > 1e-2 * scale
    assert (causal - logits).abs().max() > 1e-2 * scale
    first = int((ids[1] == IMAGE).nonzero()[0])  # row 1's text before its image sees no image: unchanged
    torch.testing.assert_close(other[1, :first], logits[1, :first], atol=0, rtol=0)


def test_refusals(hf_dir, tmp_path):
    cfg = vision_language_config(hf_dir)
    model = VisionLanguageModel(cfg)
    ids, _, pixels = image_batch()
    with pytest.raises(ImageTokenMismatch, match="Image features and image tokens do not match: 8 image tokens, "
                                                 "3 images"):
        model(ids[:1], pixels)  # row 0 alone holds 2 of the 3 images
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in os.listdir(hf_dir):
        shutil.copyfile(os.path.join(hf_dir, name), bad / name)
    raw = json.loads((bad / "config.json").read_text())
    raw["vision_config"]["vision_use_head"] = True
    (bad / "config.json").write_text(json.dumps(raw))
    with pytest.raises(HFConfigError, match="vision_use_head=true: Gemma 3 never reads"):
        vision_language_config(str(bad))
    raw["vision_config"]["vision_use_head"] = False
    raw["mm_tokens_per_image"] = 9
    (bad / "config.json").write_text(json.dumps(raw))
    with pytest.raises(HFConfigError, match="mm_tokens_per_image=9 must be a square whose side divides the 4"):
        vision_language_config(str(bad))
    raw["mm_tokens_per_image"] = 4
    (bad / "config.json").write_text(json.dumps(raw))
    tensors = load_file(str(bad / "model.safetensors"))
    del tensors["multi_modal_projector.mm_soft_emb_norm.weight"]
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(HFCheckpointError, match="missing multi_modal_projector.mm_soft_emb_norm.weight"):
        load_vision_language_weights(model, str(bad), tp_rank=0, tp_size=1)


def _tp2_rank(rank: int, world: int, path: str, out: str) -> None:
    check_layout(path, out, dist.group.WORLD)
    # sequence parallel: 19 tokens padded to shards of 10; row 0 has an image on each rank's shard, row 1's
    # image straddles the two (positions 7-10)
    check_layout(path, out + "-sp", dist.group.WORLD, sequence_parallel=True, seq=19)


def test_tp2_and_sequence_parallel_match_transformers(hf_dir, tmp_path):
    spawn(2, _tp2_rank, hf_dir, str(tmp_path / "export"))


def test_validation_refuses_what_is_not_supported_yet(hf_dir, tmp_path):
    """A vision-language checkpoint in a training config: every unsupported setting named at
    once with its fix, before any rank starts (a supported one trains: test_vision_train.py);
    Qwen2-VL by name."""
    cfg = Config()
    cfg.model.init_from = hf_dir
    cfg.parallel.pp, cfg.parallel.cp, cfg.parallel.tp, cfg.parallel.sequence_parallel = 2, 2, 2, True
    cfg.data.packing = "docs"
    cfg.parallel.zero, cfg.lora.rank, cfg.model.freeze = 3, 4, ["vision", "tower"]
    cfg.lora.targets, cfg.train.export_hf = ["q", "lm_head"], True
    problems = validate(cfg, 16)
    for want in ("data.path must name one JSONL file", "python -m megaft.models.hf.multimodal text",
                 "lora.targets=lm_head with images",
                 "lora.rank=4 with images writes the peft adapter only", "fix: lora.export_merged=false",
                 "model.freeze: 'tower' is not a part",
                 "parallel.cp=2 with images: cp on the text part needs each image's tokens whole in one rank's "
                 "chunk, and megaft does not place them so yet (Gemma 3: an image's tokens attend to each other "
                 "both ways, which the ring does not do across chunks); fix: parallel.cp=1",
                 "data.packing=docs with images", "fix: data.packing=none"):
        assert any(want in p for p in problems), (want, problems)
    assert not any("sequence_parallel" in p for p in problems)  # images work under sequence parallel
    assert not any("zero=3 with images" in p for p in problems)  # and under ZeRO-3 (test_vision_train.py)
    assert not any("parallel.pp" in p for p in problems)  # and at pp, with ZeRO-3 too (test_vision_pp.py)
    plain = Config()
    plain.model.init_from = hf_dir
    plain.data.packing, plain.parallel.pp = "none", 2
    problems = validate(plain, 2)
    assert sum("images" in p for p in problems) == 0  # only the missing data file: pp trains images
    assert any("data.path must name one JSONL file" in p for p in problems)
    text = Config()
    text.model.freeze = ["vision"]
    assert any("only a vision-language model has parts to freeze" in p for p in validate(text, 1))
    qwen = tmp_path / "qwen"
    shutil.copytree(hf_dir, qwen)
    (qwen / "config.json").write_text(json.dumps({"model_type": "qwen2_vl"}))
    plain.model.init_from = str(qwen)
    assert any("model_type qwen2_vl (Qwen2-VL) is not supported yet" in p and "fix:" in p
               for p in validate(plain, 2))


def test_text_data_with_image_parts_is_refused_with_the_way_to_images():
    with pytest.raises(DataError, match=r"'messages'\[0\]: 'content' is a list of parts: megaft-train reads text "
                                        r"conversations .*docs/vision.md"):
        parse_record({"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"}]}]})


def test_image_mask_rule_and_its_flex_form():
    """Docs.image_blocks: the SDPA mask is transformers' rule (causal OR same image, then the
    window), element by element; flex_attention's mask_mod (the CUDA path, forward only on CPU)
    gives the same attention; right padding for sequence parallel sees no image."""
    ids, _, _ = image_batch()
    blocks = image_blocks(ids == IMAGE)
    assert blocks[0].tolist()[:8] == [-1, -1, 0, 0, 0, 0, -1, -1] and blocks[1].max() == 0
    b, s = ids.shape
    docs = Docs(torch.arange(s).expand(b, s), torch.zeros_like(ids), image_blocks=blocks)
    q, k, v = (torch.randn(b, 2, s, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    for window in (None, 3):
        mask = document_mask(docs, window)[:, 0]
        for r in range(b):
            for i in range(s):
                for j in range(s):
                    both_ways = blocks[r, i] >= 0 and blocks[r, i] == blocks[r, j]
                    want = (j <= i or both_ways) and (window is None or j > i - window)
                    assert bool(mask[r, i, j]) == want, (window, r, i, j)
        assert (mask & ~torch.ones(s, s, dtype=torch.bool).tril()).any()  # some key after its query is seen
        block = create_block_mask(mask_mod(docs, window), b, None, s, s, device="cpu")
        flex = flex_attention(q, k, v, block_mask=block)
        sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(docs, window))
        torch.testing.assert_close(flex, sdpa, atol=1e-6, rtol=1e-6)  # softmax of the same scores, other kernels
    padded = docs.padded(s + 3)
    assert (padded.image_blocks[:, s:] == -1).all() and torch.equal(padded.image_blocks[:, :s], blocks)


@pytest.mark.parametrize("name", ["gemma-3-4b-it", "gemma-3-27b-it", "medgemma-27b-it"])
def test_published_configs_read_as_transformers_reads_them(name, tmp_path):
    """The published multimodal configs (tests/models/real_configs) give transformers' Gemma3Config
    shapes; what export writes reads back the same."""
    raw = json.loads(open(os.path.join(os.path.dirname(__file__), "real_configs", f"{name}.json")).read())
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = vision_language_config(str(tmp_path))
    theirs = transformers.Gemma3Config(**raw)
    v, tv, tt = cfg.vision, theirs.vision_config, theirs.text_config
    assert (v.dim, v.ffn_dim, v.n_layers, v.n_heads, v.image_size, v.patch_size, v.channels, v.eps) == (
        tv.hidden_size, tv.intermediate_size, tv.num_hidden_layers, tv.num_attention_heads, tv.image_size,
        tv.patch_size, tv.num_channels, tv.layer_norm_eps)
    assert (cfg.text.dim, cfg.text.n_layers, cfg.text.n_heads, cfg.text.vocab_size) == (
        tt.hidden_size, tt.num_hidden_layers, tt.num_attention_heads, tt.vocab_size)
    assert (cfg.mm_tokens_per_image, cfg.image_token_id, cfg.boi_token_id, cfg.eoi_token_id, cfg.pool) == (
        theirs.mm_tokens_per_image, theirs.image_token_id, theirs.boi_token_id, theirs.eoi_token_id, 4)
    again = tmp_path / "again"
    again.mkdir()
    (again / "config.json").write_text(json.dumps(vision_config_dict(cfg, hf_config_dict(cfg.text), "bfloat16")))
    back = vision_language_config(str(again))
    assert dataclasses.replace(back, text=None) == dataclasses.replace(cfg, text=None)
    assert dataclasses.replace(back.text, name="", init_from="") == dataclasses.replace(cfg.text, name="",
                                                                                       init_from="")


def test_greedy_generation_with_images_equals_transformers(hf_dir):
    """megaft.inference.vision against transformers' generate (greedy) on a prompt with two images,
    with the KV cache (the prompt's image mask cached as attended) and without."""
    ids, _, pixels = image_batch()
    prompt = ids[0, :16]  # ends after the second image
    model = VisionLanguageModel(vision_language_config(hf_dir))
    load_vision_language_weights(model, hf_dir, tp_rank=0, tp_size=1)
    reference = _reference(hf_dir).eval()
    want = reference.generate(input_ids=prompt[None], pixel_values=pixels[:2],
                              token_type_ids=(prompt[None] == IMAGE).long(), max_new_tokens=8, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    got = generate_with_images(model, prompt.tolist(), pixels[:2], max_new_tokens=8, eos_id=None,
                               device=torch.device("cpu"))
    assert got == want and len(got) == 8
    uncached = generate_with_images(model, prompt.tolist(), pixels[:2], max_new_tokens=8, eos_id=None,
                                    device=torch.device("cpu"), cache=False)
    assert uncached == want
    # the cached step's logits, not only their argmax: a new token after the cached image prompt
    full = torch.tensor(prompt.tolist() + got[:3])
    with torch.no_grad(), kv_cache(model, len(full)) as state:
        state.real = len(prompt)
        model(prompt[None], pixels[:2])
        state.advance()
        steps = []
        for token in got[:3]:
            state.real = 1
            steps.append(model(torch.tensor([[token]]))[0, -1])
            state.advance()
        whole = model(full[None], pixels[:2])[0, len(prompt):]
    # fp32, the same sums but for SDPA's path (cached keys vs the whole row): 1e-5 of the largest logit
    torch.testing.assert_close(torch.stack(steps), whole, atol=1e-5 * float(whole.abs().max()), rtol=0)
    other = generate_with_images(model, prompt.tolist(), pixels[:2].flip(-1), max_new_tokens=8, eos_id=None,
                                 device=torch.device("cpu"))
    assert other != got  # the images decide the answer here


def test_untied_head_loads_and_exports(tmp_path):
    """An untied lm_head (language_model.lm_head.weight as transformers saves it) loads, gives
    transformers' logits and exports under the same name."""
    cfg = hf_gemma3_config()
    cfg.tie_word_embeddings = cfg.text_config.tie_word_embeddings = False
    torch.manual_seed(3)
    theirs = transformers.Gemma3ForConditionalGeneration(cfg).float().eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    theirs.save_pretrained(str(tmp_path / "src"))
    ours = VisionLanguageModel(vision_language_config(str(tmp_path / "src")))
    assert not ours.cfg.tie_embeddings
    load_vision_language_weights(ours, str(tmp_path / "src"), tp_rank=0, tp_size=1)
    ids, _, pixels = image_batch()
    with torch.no_grad():
        want = theirs(input_ids=ids, pixel_values=pixels, token_type_ids=(ids == IMAGE).long()).logits
        got = ours(ids, pixels)[..., :want.shape[-1]]
    _scale_close(got, want, "logits")
    out = export_vision_language(ours, str(tmp_path / "out"), tokenizer_json=None, tp_group=None, is_writer=True)
    exported, original = checkpoint_tensors(out), checkpoint_tensors(str(tmp_path / "src"))
    assert torch.equal(exported["language_model.lm_head.weight"], original["language_model.lm_head.weight"])
    assert not torch.equal(original["language_model.lm_head.weight"],
                           original["language_model.model.embed_tokens.weight"])


def test_lora_on_the_language_model_loads_in_peft(hf_dir, tmp_path):
    """Adapters on the language model (tower and projector frozen), exported for peft: peft's
    Gemma3ForConditionalGeneration with the adapter gives our logits, with no adapter in the tower."""
    import peft

    lora = LoraConfig(rank=4, alpha=8.0)
    model = VisionLanguageModel(vision_language_config(hf_dir))
    load_vision_language_weights(model, hf_dir, tp_rank=0, tp_size=1)
    apply_vision_lora(model, lora, seed=0, tp_rank=0, tp_size=1)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        n for n, _ in model.named_parameters() if ".adapter." in n} != set()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, adapter in adapters(model.language_model):  # B starts at zero: give the update a value
            adapter.B.copy_(torch.randn(adapter.B.shape, generator=gen) * 0.1)
    ids, _, pixels = image_batch()
    with torch.no_grad():
        ours = model(ids, pixels)
    out = export_vision_adapter(model, lora, str(tmp_path / "adapter"), tp_group=None, is_writer=True, base=hf_dir)
    theirs_model = peft.PeftModel.from_pretrained(_reference(hf_dir), out).eval()
    lora_modules = [n for n, m in theirs_model.named_modules() if hasattr(m, "lora_A") and len(m.lora_A)]
    assert len(lora_modules) == len(list(adapters(model.language_model))) == 2 * 7
    assert not any("vision_tower" in n or "multi_modal_projector" in n for n in lora_modules)
    with torch.no_grad():
        theirs = theirs_model(input_ids=ids, pixel_values=pixels, token_type_ids=(ids == IMAGE).long()).logits
        base = theirs_model.get_base_model()
        with theirs_model.disable_adapter():
            plain = base(input_ids=ids, pixel_values=pixels, token_type_ids=(ids == IMAGE).long()).logits
    _scale_close(ours[..., :theirs.shape[-1]], theirs, "logits with adapters")
    assert (theirs - plain).abs().max() > 1e-2 * theirs.abs().max()  # the adapters matter


def test_a_wrong_shape_is_named(hf_dir, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(hf_dir, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["multi_modal_projector.mm_input_projection_weight"] = torch.zeros(32, 63)
    save_file(tensors, str(bad / "model.safetensors"))
    model = VisionLanguageModel(vision_language_config(hf_dir))
    with pytest.raises(HFCheckpointError, match=r"multi_modal_projector.mm_input_projection_weight has shape "
                                                r"\[32, 63\], expected \[32, 64\] from config.json"):
        load_vision_language_weights(model, str(bad), tp_rank=0, tp_size=1)
