"""On-policy distillation (distill.lmbda, distill.seq_kd: TRL 1.16's GKDTrainer).

- which steps generate is a pure function of (train.seed, step) at rate lmbda, and a prompt is an
  example's tokens before its last completion (a conversation's turns before its last assistant turn,
  with the template's generation prompt: what rl.prompts renders from messages[:-1]);
- 2 steps on the student's (or the teacher's, seq_kd) sampled completions equal a torch loop over the
  same completions through transformers' models with TRL's own code: GKDTrainer.generate_on_policy_outputs
  (fed the completions by a stub model) builds the batch, GKDTrainer.compute_loss scores it; the loss,
  the grad norm and every trained weight; and on the student's first generated batch, the gradient of
  every weight against transformers' under GKDTrainer.compute_loss;
- at sampling temperature 0 the student's and the teacher's completions are transformers' greedy generate;
- lmbda = 0 keeps sft's data part, and a step lmbda leaves to the data is that run's step bit for bit;
- a resumed run generates and trains as the uninterrupted one, bit for bit;
- dp2 ZeRO-3, tp2 sp, pp2 and cp2 equal the single process (marked exact: one spawn);
- validation refuses a stored top-k teacher, packed rows and plain text with generation, each with its fix.
"""
from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch
import transformers
from models.hf_fixture import checkpoint_tensors, make_hf_llama
from multirank import spawn
from train_cases import read_rows, run

from distill.distill_cases import (
    POLICY_LAYOUTS,
    policy_config,
    policy_layout_config,
    policy_layouts_rank,
    write_sft,
)
from megaft.data.templates import load_chat_template
from megaft.distill.policy import DATA, STUDENT, TEACHER, batch_source, prompt_of
from megaft.parallel.grid import ParallelGrid
from megaft.training.loop import Trainer
from megaft.training.objectives.distill_policy import PolicyData
from megaft.training.objectives.sft import DataParts
from megaft.validation import resolve, validate

trl_gkd = pytest.importorskip("trl.experimental.gkd.gkd_trainer")
GKD = trl_gkd.GKDTrainer
PROMPT = 4  # every prompt's tokens: TRL's batch then needs no left padding
EOS, PAD = 1, 0  # the fixture tokenizer's


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill_policy")
    ckpt, teacher, data = str(root / "student"), str(root / "teacher"), str(root / "sft.jsonl")
    make_hf_llama(ckpt, seed=1)
    make_hf_llama(teacher, seed=2)
    write_sft(data, prompt_len=PROMPT)
    return ckpt, teacher, data, root


def _fit(cfg, run_dir, parts: bool = False) -> tuple:
    """Train `cfg` in `run_dir`; (its train lines, the step batches its data part gave[, its data part])."""
    os.makedirs(run_dir, exist_ok=True)
    trainer = Trainer(cfg, ParallelGrid.single(), str(run_dir))
    data, seen = trainer.parts.data, []
    given = data.batch
    data.batch = lambda step: seen.append(given(step)) or seen[-1]
    trainer.fit()
    rows = [r for r in read_rows(str(run_dir)) if "loss" in r]
    return (rows, seen, data) if parts else (rows, seen)


def test_the_draws_are_a_pure_function_of_seed_and_step_and_prompts_end_before_the_completion():
    draws = [batch_source(7, s, 0.3, False) for s in range(4000)]
    assert draws == [batch_source(7, s, 0.3, False) for s in range(4000)]  # every rank, every resume
    # binomial(4000, 0.3): std 29, so 5 std either side
    assert abs(draws.count(STUDENT) - 1200) < 145 and set(draws) == {STUDENT, DATA}
    assert {batch_source(7, s, 0.3, True) for s in range(50)} == {STUDENT, TEACHER}
    assert {batch_source(s, 0, 1.0, False) for s in range(50)} == {STUDENT}
    assert {batch_source(s, 3, 0.0, True) for s in range(50)} == {TEACHER}
    assert [batch_source(0, s, 0.3, False) for s in range(200)] != [batch_source(1, s, 0.3, False)
                                                                   for s in range(200)]  # the seed matters
    # prompt/completion: the prompt; text: its first token; a long prompt keeps its last seq_len - 1
    assert prompt_of([5, 6, 7, 8, 9], [False, False, False, True, True], 16) == [5, 6, 7]
    assert prompt_of([5, 6, 7], [False, True, True], 16) == [5]
    assert prompt_of([5, 6, 7, 8, 9], [False, False, False, False, True], 3) == [7, 8]


def test_a_conversations_prompt_is_its_turns_before_the_last_assistant_turn(inputs):
    """What the chat encoder trains, cut by prompt_of, is messages[:-1] rendered with the generation prompt
    (TRL's DataCollatorForChatML prompt; megaft's rl.prompts rendering)."""
    from tokenizers import Tokenizer

    from megaft.data.chat import ChatEncoder
    from megaft.data.prompts import render_prompt

    ckpt = inputs[0]
    tok = Tokenizer.from_file(f"{ckpt}/tokenizer.json")
    template = load_chat_template("chatml", ckpt)
    messages = [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "cd"},
                {"role": "user", "content": "ef"}, {"role": "assistant", "content": "gh"}]
    enc = ChatEncoder(tok, template).encode(messages)
    want = tok.encode(render_prompt({"messages": messages[:-1]}, template), add_special_tokens=False).ids
    assert prompt_of(enc.ids, enc.target, 1000) == want and len(want) < len(enc.ids)


# the data's rows are cut at 64 tokens (the generated rows are not: each prompt leaves room for its completion)
@pytest.mark.filterwarnings("ignore:8 of 8 documents are longer than seq_len")
def test_a_chat_runs_prompts_are_its_conversations_before_the_last_assistant_turn(inputs, tmp_path):
    """End to end through the prepared store: every generated row starts with one of the file's
    conversations' messages[:-1] rendered with the generation prompt, and its completion follows it."""
    from tokenizers import Tokenizer

    from megaft.data.prompts import render_prompt

    ckpt, teacher, _, root = inputs
    chats = str(tmp_path / "chat.jsonl")
    with open(chats, "w") as f:
        for i in range(8):
            f.write(json.dumps({"messages": [{"role": "user", "content": "ab"[:1 + i % 2] + "xy"[i % 2:]},
                                             {"role": "assistant", "content": "cdefg"[:2 + i % 3]}]}) + "\n")
    cfg = policy_config(ckpt, teacher, chats, sampling_temperature=0.0, steps=1)
    # chatml in the fixture's character vocabulary: ~52 prompt tokens, and the model holds 64 positions
    cfg.data.chat_template, cfg.data.seq_len, cfg.data.long_docs = "chatml", 64, "truncate"
    _, seen = _fit(resolve(cfg), root / "chat")
    tok, template = Tokenizer.from_file(f"{ckpt}/tokenizer.json"), load_chat_template("chatml", ckpt)
    with open(chats) as f:
        prompts = [tok.encode(render_prompt({"messages": json.loads(line)["messages"][:-1]}, template),
                              add_special_tokens=False).ids for line in f]
    rows = 0
    for ids, labels in zip(seen[0].inputs, seen[0].labels):
        for row, lab in zip(ids, labels):
            first = int((lab != -100).nonzero()[0]) + 1  # the completion's first token
            assert row[:first].tolist() in prompts
            rows += 1
    assert rows == 4


def _trl_batch(ids: torch.Tensor, labels: torch.Tensor, gen_cfg) -> dict:
    """TRL's GKD batch of megaft's generated rows: generate_on_policy_outputs on a stub model whose
    generate returns them (the prompts, then the completions, pads after a finished one)."""
    width = int((labels != -100).nonzero()[:, 1].max()) + 2  # the longest row's tokens
    seqs = ids[:, :width]
    stub = SimpleNamespace(generate=lambda **kw: SimpleNamespace(sequences=seqs))
    prompts = {"prompts": seqs[:, :PROMPT], "prompt_attention_mask": torch.ones_like(seqs[:, :PROMPT])}
    new_ids, mask, new_labels = GKD.generate_on_policy_outputs(stub, prompts, gen_cfg)
    assert torch.equal(new_labels[:, 1:], labels[:, :width - 1])  # megaft's rows are TRL's, shifted
    return {"input_ids": new_ids, "attention_mask": mask, "labels": new_labels}


def _reference(cfg, seen) -> tuple[list[float], list[float], dict]:
    """(losses, grad norms, trained weights) of the torch loop with TRL's GKD code on the batches `seen`."""
    load = lambda p: transformers.LlamaForCausalLM.from_pretrained(  # noqa: E731
        p, dtype=torch.float32, attn_implementation="eager")
    student, teacher = load(cfg.model.init_from).train(), load(cfg.distill.teacher).eval()
    # a sampled completion may hold the pad id (the fixture's random model draws <pad>); HF's nn.Embedding(
    # padding_idx) never trains that row, megaft's embedding trains every row it reads: the same as megaft here
    student.model.embed_tokens.padding_idx = None
    trainer = SimpleNamespace(teacher_model=teacher, beta=cfg.distill.effective_beta,
                              generalized_jsd_loss=GKD.generalized_jsd_loss)
    gen_cfg = transformers.GenerationConfig(eos_token_id=EOS, pad_token_id=PAD)
    o = cfg.optim
    opt = torch.optim.AdamW(student.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=0.0)
    losses, norms = [], []
    for batch in seen:
        micro = [_trl_batch(i, lab, gen_cfg) for i, lab in zip(batch.inputs, batch.labels)]
        n = sum((m["labels"][:, 1:] != -100).sum() for m in micro)
        assert n == batch.n_targets  # the divisor: the generated batch's completion tokens
        total = 0.0
        for m in micro:
            loss = GKD.compute_loss(trainer, student, m, num_items_in_batch=n)
            loss.backward()
            total += loss.item()
        norms.append(torch.nn.utils.clip_grad_norm_(student.parameters(), o.clip_grad).item())
        losses.append(total)
        opt.step()
        opt.zero_grad()
    return losses, norms, {k: v.detach() for k, v in student.state_dict().items()}


@pytest.mark.parametrize("lmbda,seq_kd,beta", [(1.0, False, 0.5), (0.0, True, 0.0), (1.0, False, 1.0)])
def test_generated_steps_equal_trl_gkd(inputs, lmbda, seq_kd, beta):
    ckpt, teacher, data, root = inputs
    cfg = policy_config(ckpt, teacher, data, lmbda=lmbda, seq_kd=seq_kd, beta=beta)
    cfg.distill.loss = {0.0: "forward_kl", 1.0: "reverse_kl"}.get(beta, "jsd")
    cfg.train.export_hf = True
    cfg = resolve(cfg)
    run_dir = root / f"trl_{lmbda}_{seq_kd}_{beta}"
    rows, seen = _fit(cfg, run_dir)
    source = STUDENT if lmbda else TEACHER
    assert [b.source for b in seen] == [source] * 2 and all(r["on_policy"] == float(lmbda == 1) for r in rows)
    with open(data) as f:
        prompts = {json.loads(line)["prompt"] for line in f}
    letters = {i: ch for ch, i in json.load(open(f"{ckpt}/tokenizer.json"))["model"]["vocab"].items()}
    for b in seen:
        for ids in b.inputs:
            assert all("".join(letters[int(t)] for t in row[:PROMPT]) in prompts for row in ids)
    losses, norms, weights = _reference(cfg, seen)
    assert len(rows) == 2 and losses[0] > 1e-3 and losses[0] != losses[1]
    for row, loss, norm in zip(rows, losses, norms):
        # fp32 sums in another order (megaft's vocab slices and chunks, HF's eager attention): relative 1e-5
        assert row["loss"] == pytest.approx(loss, rel=1e-5), (row, loss)
        assert row["grad_norm"] == pytest.approx(norm, rel=1e-5), (row, norm)
    got = checkpoint_tensors(str(run_dir / "hf"))
    moved = 0
    for name, want in weights.items():
        if name in got:
            torch.testing.assert_close(got[name], want, rtol=1e-4, atol=1e-5, msg=name)  # after 2 Adam updates
            moved += 1
    assert moved >= 10


def test_every_gradient_on_a_generated_batch_is_trls(inputs):
    """The student's first generated batch: megaft's Decoder and loss (megaft.distill.losses, in chunks)
    against transformers' Llama under GKDTrainer.compute_loss on TRL's batch of the same completions;
    the loss and the gradient of every weight."""
    from megaft.distill.losses import token_divergence
    from megaft.models.decoder import Decoder
    from megaft.models.hf.config import hf_model_config
    from megaft.models.hf.export import hf_tensors
    from megaft.models.hf.load import load_hf_weights

    ckpt, teacher, data, root = inputs
    cfg = resolve(policy_config(ckpt, teacher, data, lmbda=1.0, steps=1))
    _, seen = _fit(cfg, root / "grads")
    batch = seen[0]
    inputs_, labels = torch.cat(batch.inputs), torch.cat(batch.labels)

    def decoder(path):
        model = Decoder(hf_model_config(path))
        load_hf_weights(model, path, tp_rank=0, tp_size=1)
        return model
    ours, ours_teacher = decoder(ckpt), decoder(teacher).eval()
    with torch.no_grad():
        t = ours_teacher(inputs_)
    loss = token_divergence(ours(inputs_), t, labels, beta=0.5, vocab_size=cfg.model.vocab_size, chunk=5).sum()
    (loss / batch.n_targets).backward()

    load = lambda p: transformers.LlamaForCausalLM.from_pretrained(  # noqa: E731
        p, dtype=torch.float32, attn_implementation="eager")
    hf, hf_teacher = load(ckpt).train(), load(teacher).eval()
    hf.model.embed_tokens.padding_idx = None  # as in _reference: megaft trains the pad id's row
    trainer = SimpleNamespace(teacher_model=hf_teacher, beta=0.5, generalized_jsd_loss=GKD.generalized_jsd_loss)
    gen_cfg = transformers.GenerationConfig(eos_token_id=EOS, pad_token_id=PAD)
    want_loss = GKD.compute_loss(trainer, hf, _trl_batch(inputs_, labels, gen_cfg), num_items_in_batch=batch.n_targets)
    want_loss.backward()
    torch.testing.assert_close(loss / batch.n_targets, want_loss, rtol=1e-5, atol=1e-7)
    want = {n: p.grad for n, p in hf.named_parameters()}
    got = {k: v for n, p in ours.named_parameters() for k, v in hf_tensors(n, p.grad, cfg.model).items()}
    assert set(got) == set(want)
    for name, grad in want.items():
        assert grad.abs().max() > 0, name
        # the same fp32 math in two programs: sums in other orders (a few ulps of the largest element)
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-6 * float(grad.abs().max()), msg=name)


@pytest.mark.parametrize("seq_kd", [False, True])
def test_greedy_completions_are_transformers_generate(inputs, seq_kd):
    ckpt, teacher, data, root = inputs
    cfg = resolve(policy_config(ckpt, teacher, data, lmbda=0.0 if seq_kd else 1.0, seq_kd=seq_kd,
                                sampling_temperature=0.0, steps=1))
    _, seen = _fit(cfg, root / f"greedy_{seq_kd}")
    model = transformers.LlamaForCausalLM.from_pretrained(teacher if seq_kd else ckpt, dtype=torch.float32,
                                                          attn_implementation="eager").eval()
    for ids, labels in zip(seen[0].inputs, seen[0].labels):
        for row, lab in zip(ids, labels):
            mine = row[PROMPT:][lab[PROMPT - 1:-1] != -100].tolist()
            want = model.generate(row[None, :PROMPT], attention_mask=torch.ones(1, PROMPT, dtype=torch.long),
                                  do_sample=False, max_new_tokens=8, eos_token_id=EOS, pad_token_id=PAD)[0, PROMPT:]
            want = want.tolist()
            want = want[:want.index(EOS) + 1] if EOS in want else want
            assert mine == want and len(mine) >= 1


def test_lmbda_zero_and_the_data_steps_are_the_off_policy_run(inputs):
    ckpt, teacher, data, root = inputs
    off = resolve(policy_config(ckpt, teacher, data, lmbda=0.0))
    off_rows, off_seen, off_data = _fit(off, root / "off", parts=True)
    assert type(off_data) is DataParts  # lmbda = 0 without seq_kd: sft's data part, the run as before
    mixed = resolve(policy_config(ckpt, teacher, data, lmbda=0.5))
    assert [batch_source(0, s, 0.5, False) for s in range(2)] == [DATA, STUDENT]  # train.seed 0's draws
    rows, seen, mixed_data = _fit(mixed, root / "mixed", parts=True)
    assert isinstance(mixed_data, PolicyData) and [type(b).__name__ for b in seen] == ["StepBatch", "GeneratedBatch"]
    for a, b in zip(seen[0].inputs + seen[0].labels, off_seen[0].inputs + off_seen[0].labels):
        assert torch.equal(a, b)
    assert rows[0]["loss"] == off_rows[0]["loss"] and rows[0]["grad_norm"] == off_rows[0]["grad_norm"]
    assert rows[0]["on_policy"] == 0.0 and rows[1]["on_policy"] == 1.0
    assert rows[1]["loss"] != off_rows[1]["loss"]  # the student's completions: another batch


def test_a_resumed_run_generates_and_trains_as_the_uninterrupted_one(inputs):
    ckpt, teacher, data, root = inputs

    def config():
        cfg = policy_config(ckpt, teacher, data, lmbda=0.5, seq_kd=True, steps=3)
        cfg.train.save_every = 10
        return resolve(cfg)
    whole, _ = _fit(config(), root / "whole")
    run_dir = root / "resumed"
    os.makedirs(run_dir)
    Trainer(config(), ParallelGrid.single(), str(run_dir)).fit(stop_after=1)  # a checkpoint at step 1
    run(config(), ParallelGrid.single(), str(run_dir))
    got = [r for r in read_rows(str(run_dir)) if "loss" in r]
    assert [r["step"] for r in got] == [1, 2, 3] and {r["on_policy"] for r in got} == {0.0, 1.0}
    for a, b in zip(got, whole):
        for key in ("loss", "grad_norm", "on_policy", "teacher_completions"):
            assert a[key] == b[key], (a["step"], key)  # one process, the same operations: bit for bit


@pytest.mark.exact  # make test runs these on a pinned CPU code path (docs/contributing.md)
def test_every_layout_generates_and_trains_as_the_single_process(inputs):
    ckpt, teacher, data, root = inputs
    spawn(2, policy_layouts_rank, ckpt, teacher, data, str(root / "layouts"))
    run(policy_layout_config(ckpt, teacher, data, None), ParallelGrid.single(), str(root / "policy_single"))
    want = [r for r in read_rows(str(root / "policy_single")) if "loss" in r]
    assert [r["on_policy"] for r in want] == [0.0, 1.0] and [r["teacher_completions"] for r in want] == [1.0, 0.0]
    failures = []
    for name in POLICY_LAYOUTS:
        got = [r for r in read_rows(str(root / "layouts" / name)) if "loss" in r]
        assert len(got) == len(want), name
        for g, w in zip(got, want):
            assert g["on_policy"] == w["on_policy"], name
            for key in ("loss", "grad_norm"):
                # the layouts reorder fp32 sums (vocabulary slices, tokens over ranks); the completions are
                # the same tokens (or the loss would differ by far more): distill's layout tolerance
                if abs(g[key] - w[key]) > 5e-5 * max(abs(w[key]), 1e-1):
                    failures.append(f"{name} step {w['step']} {key}: layout {g[key]} single {w[key]}")
    assert not failures, "\n".join(failures)


def test_validation_names_what_generation_cannot_do(inputs, tmp_path):
    ckpt, teacher, data, _ = inputs
    assert validate(resolve(policy_config(ckpt, teacher, data)), 1) == []
    cases = [(dict(top_k=8), "fix: distill.top_k=null"), (dict(lmbda=1.5), "distill.lmbda=1.5 must be in [0, 1]"),
             (dict(max_new_tokens=0), "distill.max_new_tokens=0 must be >= 1"),
             (dict(sampling_temperature=-1.0), "distill.sampling_temperature=-1.0 must be >= 0")]
    for change, words in cases:
        cfg = policy_config(ckpt, teacher, data)
        for k, v in change.items():
            setattr(cfg.distill, k, v)
        problems = validate(resolve(cfg), 1)
        assert any(words in p for p in problems), (change, problems)
    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"completion": "ab", "prompt": "cdef"}) + "\n" + json.dumps({"text": "abcdef"}) + "\n")
    problems = validate(resolve(policy_config(ckpt, teacher, str(text))), 1)
    assert any(f"{text} holds plain text (example 2)" in p and "fix: prompt/completion or chat" in p
               for p in problems), problems
    packed = policy_config(ckpt, teacher, data, lmbda=0.0, seq_kd=True)
    packed.data.packing = "docs"
    problems = validate(resolve(packed), 1)
    assert any("data.packing=docs" in p and "fix: data.packing=none" in p for p in problems), problems
