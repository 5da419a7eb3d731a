"""Memory of megaft's token-chunked distillation loss against the gathered one, and the time of
megaft's distillation step against TRL's GKDTrainer, on the CPU, each ratio measured in one run
(issue 40).

    python -m benchmarks.distill [--part memory|step|both] [--tokens N] [--vocab V] [--hidden H]
                                 [--teacher-hidden H] [--beta B] [--temperature T] [--chunk C]
                                 [--rows N] [--batch B] [--micro M] [--steps N] [--rounds R] [--warmup W]
                                 [--check C] [--lr LR] [--model-hidden H] [--layers L] [--teacher-layers L]
                                 [--model-vocab V] [--prompt LO-HI] [--completion LO-HI] [--json PATH]

## Memory (--part memory)

The head and loss of one distillation micro-batch, forward and backward, on one process, fp32:
the student's hidden states [N, H] times its output head [V, H] (with grad) give its logits, the
teacher's hidden states [N, Ht] times the teacher's head (no grad) give the teacher's; then

- `gathered`: TRL 1.16's GKDTrainer.generalized_jsd_loss on the full [N, V] logits of both models
  (log-softmax, mixture and divergence terms all [N, V] fp32, held for the backward);
- `megaft`: megaft.distill.losses.token_divergence, which takes the same logits but computes the
  log-softmaxes and the divergence --chunk tokens at a time, recomputing each chunk in the backward
  (nothing of [N, V] beyond the logits themselves and their gradient).

Both are divided by the number of target tokens (TRL's batchmean; a tenth of the tokens are
masked with -100). Before the memory is reported the two must agree: the loss within 1e-5 and
the head's gradient within 1e-4 relative (max-abs difference over max-abs value), or the run exits
with status 1.

What is measured: the peak of the bytes the CPU allocator holds while the forward and backward
run, above what it held before (the inputs and weights), read from torch.profiler's allocation
records (profile_memory=True: every allocation and free with its size, in order; the peak is
the running sum's maximum). That counts every tensor the CPU allocator hands out (the logits,
saved activations, gradients, temporaries), not the Python objects. Under tp each rank holds
V/tp columns of each model's logits and megaft never gathers them; this benchmark runs one
process only.

## Step time (--part step)

One optimizer step of distillation with an online teacher, fp32, off-policy (TRL: lmbda 0, no
seq_kd), temperature 1 (GKDTrainer.compute_loss passes none to its loss), --beta: megaft's
Trainer (train.objective=distill, its `train_step`: batch, student and teacher forwards, the
chunked loss, backward, AdamW) against TRL 1.16's GKDTrainer (its on_step_begin to on_step_end:
its micro-batches' student and teacher forwards, generalized_jsd_loss, backward, AdamW). The
student is benchmarks.preference's random Llama (--model-hidden x --layers, vocabulary
--model-vocab, a character tokenizer), the teacher the same shape with --teacher-layers layers and
other weights. The data is --rows random prompt/completion lines (megaft's sft format); TRL trains
on megaft's own micro-batches (a collator hands it megaft's rows in megaft's order, the labels in
HF's unshifted form: the input gets the last target appended, one token more a row than megaft's),
--batch rows a step in micro-batches of --micro (TRL: gradient_accumulation_steps=--batch/--micro),
AdamW at a constant --lr, no weight decay, clipping at 1. The losses of the first --check steps and
step 1's grad norm agree within 1e-4 relative (and in every timed turn), or the run exits with
status 1. Timing as benchmarks.preference: --rounds ABBA rounds, --warmup untimed steps a turn, the
median step (p20-p80) and its ratio to TRL's (below 1: faster).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch
from torch.profiler import ProfilerActivity, profile

VARIANTS = ("gathered", "megaft")  # the first: the ratio's reference
LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4
STEP_VARIANTS = ("trl", "megaft")  # the first: the ratio's reference
STEP_RTOL = 1e-4  # fp32 agreement of the step's loss and grad norm


@dataclass
class Head:
    tokens: int = 4096
    vocab: int = 32000
    hidden: int = 256
    teacher_hidden: int = 384
    beta: float = 0.5
    temperature: float = 1.0
    chunk: int = 1024
    seed: int = 0


def head_inputs(h: Head) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(h.seed)
    labels = torch.randint(0, h.vocab, (1, h.tokens), generator=g)
    labels[torch.rand(1, h.tokens, generator=g) < 0.1] = -100
    return {"student": torch.randn(h.tokens, h.hidden, generator=g),
            "w_student": (torch.randn(h.vocab, h.hidden, generator=g) / h.hidden ** 0.5).requires_grad_(),
            "teacher": torch.randn(h.tokens, h.teacher_hidden, generator=g),
            "w_teacher": torch.randn(h.vocab, h.teacher_hidden, generator=g) / h.teacher_hidden ** 0.5,
            "labels": labels}


def gathered_loss(x: dict[str, torch.Tensor], h: Head) -> torch.Tensor:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.gkd import GKDTrainer

    student = (x["student"] @ x["w_student"].T)[None]
    with torch.no_grad():
        teacher = (x["teacher"] @ x["w_teacher"].T)[None]
    return GKDTrainer.generalized_jsd_loss(student, teacher, x["labels"], beta=h.beta, temperature=h.temperature)


def megaft_loss(x: dict[str, torch.Tensor], h: Head) -> torch.Tensor:
    from megaft.distill.losses import token_divergence

    student = (x["student"] @ x["w_student"].T)[None]
    with torch.no_grad():
        teacher = (x["teacher"] @ x["w_teacher"].T)[None]
    per_token = token_divergence(student, teacher, x["labels"], beta=h.beta, temperature=h.temperature,
                                 chunk=h.chunk)
    return per_token.sum() / (x["labels"] != -100).sum().clamp_min(1)


LOSSES: dict[str, Callable] = {"gathered": gathered_loss, "megaft": megaft_loss}


def peak_bytes(fn: Callable[[], object]) -> tuple[int, object]:
    """fn's result and the peak of the CPU allocator's bytes while it ran, above where it started:
    the running sum of torch.profiler's allocation records (frees negative), maximised."""
    from torch._C._profiler import _EventType

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    sizes = []

    def walk(node) -> None:
        if node.tag == _EventType.Allocation:
            sizes.append((node.start_time_ns, node.extra_fields.alloc_size))
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    running = peak = 0
    for _, size in sorted(sizes):
        running += size
        peak = max(peak, running)
    return peak, out


def measure(variant: str, h: Head) -> dict:
    """One variant's loss, head gradient and peak bytes over its forward and backward."""
    x = head_inputs(h)

    def step() -> float:
        loss = LOSSES[variant](x, h)
        loss.backward()
        return loss.item()

    peak, loss = peak_bytes(step)
    return {"loss": loss, "grad": x["w_student"].grad, "peak_bytes": peak}


def disagreements(runs: dict[str, dict]) -> list[str]:
    want, bad = runs["gathered"], []
    for name, got in runs.items():
        if abs(got["loss"] - want["loss"]) > LOSS_RTOL * abs(want["loss"]):
            bad.append(f"{name} loss {got['loss']:.8f} against the gathered {want['loss']:.8f}")
        diff = (got["grad"] - want["grad"]).abs().max().item()
        if diff > GRAD_RTOL * want["grad"].abs().max().item():
            bad.append(f"{name} head gradient differs by {diff:.3g} (max-abs) from the gathered one")
    return bad


@dataclass
class Run:
    """The models, data and step settings of the step-time comparison."""
    hidden: int = 256
    layers: int = 2
    teacher_layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 688
    vocab: int = 8192
    rows: int = 64
    prompt: tuple[int, int] = (20, 100)  # characters (= tokens) of a prompt, uniform
    completion: tuple[int, int] = (20, 100)
    batch: int = 8
    micro: int = 2
    beta: float = 0.5
    lr: float = 1e-3
    attn: str = "sdpa"
    seed: int = 0


@dataclass
class StepTurn:
    variant: str
    times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)


def write_run(root: str, r: Run) -> tuple[str, str, str, int]:
    """(student folder, teacher folder, data file, megaft's data.seq_len)."""
    from benchmarks.preference import CHARS, Sizes, write_model

    rng = random.Random(r.seed)
    text = lambda lo_hi: "".join(rng.choice(CHARS) for _ in range(rng.randint(*lo_hi)))  # noqa: E731
    data = os.path.join(root, "sft.jsonl")
    with open(data, "w") as f:
        for _ in range(r.rows):
            f.write(json.dumps({"prompt": text(r.prompt), "completion": text(r.completion)}) + "\n")
    seq_len = 8 * -(-(r.prompt[1] + r.completion[1] + 2) // 8)
    student, teacher = os.path.join(root, "student"), os.path.join(root, "teacher")
    shape = dict(hidden=r.hidden, heads=r.heads, kv_heads=r.kv_heads, intermediate=r.intermediate, vocab=r.vocab)
    write_model(student, Sizes(layers=r.layers, seed=r.seed, **shape), seq_len)
    write_model(teacher, Sizes(layers=r.teacher_layers, seed=r.seed + 1, **shape), seq_len)
    return student, teacher, data, seq_len


def megaft_trainer(inputs: tuple, r: Run, steps: int, run_dir: str):
    from megaft.config import Config
    from megaft.parallel.grid import ParallelGrid
    from megaft.training.loop import Trainer
    from megaft.validation import resolve, validate

    student, teacher, data, seq_len = inputs
    cfg = Config()
    cfg.model.init_from, cfg.data.path, cfg.data.seq_len, cfg.device = student, data, seq_len, "cpu"
    t = cfg.train
    t.objective, t.max_steps, t.global_batch_size, t.micro_batch_size = "distill", steps, r.batch, r.micro
    t.progress, t.eval_every, t.tensorboard, t.log_phases = False, 10 ** 6, "false", False
    cfg.optim.lr = cfg.optim.min_lr = r.lr
    cfg.optim.warmup_steps, cfg.optim.weight_decay = 0, 0.0
    d = cfg.distill
    d.teacher, d.beta, d.temperature, d.alpha = teacher, r.beta, 1.0, 0.0
    d.loss = {0.0: "forward_kl", 1.0: "reverse_kl"}.get(r.beta, "jsd")
    problems = validate(cfg, 1)
    if problems:
        raise SystemExit("megaft config:\n  " + "\n  ".join(problems))
    return Trainer(resolve(cfg), ParallelGrid.single(), run_dir)


def megaft_batches(inputs: tuple, r: Run, steps: int, run_dir: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """megaft's (inputs, labels) of each of the first `steps` steps, every row of the step."""
    os.makedirs(run_dir, exist_ok=True)
    trainer = megaft_trainer(inputs, r, steps, run_dir)
    return [tuple(trainer.parts.data.global_batch(step, r.batch)[:2]) for step in range(steps)]


def megaft_step_turn(inputs: tuple, r: Run, steps: int, run_dir: str) -> StepTurn:
    trainer, turn = megaft_trainer(inputs, r, steps, run_dir), StepTurn("megaft")
    for step in range(steps):
        start = time.perf_counter()
        out = trainer.train_step(step)
        turn.times.append(time.perf_counter() - start)
        turn.losses.append(out["loss"])
        turn.grad_norms.append(out["grad_norm"])
    return turn


def hf_micro_batches(batches: list[tuple[torch.Tensor, torch.Tensor]], micro: int) -> list[dict]:
    """megaft's rows as HF batches: labels[:, t] is position t's target in megaft, position t + 1's
    token in HF (which shifts inside the loss), so the input gets the last target appended and the
    labels a leading -100; the rows' padding (labels -100) comes after every real token, and the
    attention is causal, so an all-ones mask leaves every target's logits as megaft's."""
    out = []
    for ids, labels in batches:
        tail = labels[:, -1:].clamp_min(0)
        full = torch.cat([ids, tail], 1)
        hf = torch.cat([torch.full_like(labels[:, :1], -100), labels], 1)
        for i in range(0, ids.shape[0], micro):
            out.append({"input_ids": full[i:i + micro], "attention_mask": torch.ones_like(full[i:i + micro]),
                        "labels": hf[i:i + micro]})
    return out


def trl_step_turn(inputs: tuple, batches: list, r: Run, steps: int, out_dir: str) -> StepTurn:
    from datasets import Dataset
    from transformers import LlamaForCausalLM
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    from benchmarks.preference import char_tokenizer, step_clock, train_logged, trl_args
    from megaft.config.optim import OptimConfig

    student, teacher, _, _ = inputs
    o, turn = OptimConfig(), StepTurn("trl")
    queue = hf_micro_batches(batches[:steps], r.micro)

    def collate(features):  # megaft's next micro-batch, in megaft's order
        return queue.pop(0)

    tok = char_tokenizer(student)
    args = GKDConfig(output_dir=out_dir, beta=r.beta, lmbda=0.0, seq_kd=False, temperature=1.0,
                     **trl_args(o, r.micro, r.batch // r.micro, steps, r.lr))
    load = lambda p: LlamaForCausalLM.from_pretrained(p, dtype=torch.float32, attn_implementation=r.attn)  # noqa: E731
    trainer = GKDTrainer(model=load(student).train(), teacher_model=load(teacher), args=args,
                         train_dataset=Dataset.from_dict({"row": list(range(steps * r.batch))}),
                         processing_class=tok, data_collator=collate, callbacks=[step_clock(turn.times)])
    train_logged(trainer, turn)
    return turn


def run_step_turn(variant: str, inputs: tuple, batches: list, r: Run, steps: int, root: str) -> StepTurn:
    from benchmarks.preference import in_fresh_dir

    if variant == "megaft":
        return in_fresh_dir(root, variant, lambda out: megaft_step_turn(inputs, r, steps, out))
    return in_fresh_dir(root, variant, lambda out: trl_step_turn(inputs, batches, r, steps, out))


def step_disagreements(turns: dict[str, StepTurn], steps: int) -> list[str]:
    """Where a variant's first `steps` losses or its step-1 grad norm differ from megaft's by more than STEP_RTOL."""
    from benchmarks.versus import curve_disagreements

    return curve_disagreements(turns, steps, STEP_RTOL)


def step_part(a: argparse.Namespace, r: Run) -> dict:
    from benchmarks.preference import quiet
    from benchmarks.train_step.measure import split_steps
    from benchmarks.versus import check_agreement, report_vs_trl, time_in_rounds

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import transformers
    import trl

    quiet()
    per_turn = a.warmup + max(split_steps(a.steps, a.rounds))
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="distill-bench-") as root:
        inputs = write_run(root, r)
        batches = megaft_batches(inputs, r, max(per_turn, a.check), tempfile.mkdtemp(dir=root))
        print(f"\nstep: student random Llama {r.layers} x {r.hidden}, teacher {r.teacher_layers} x {r.hidden}, vocab "
              f"{r.vocab}; {r.rows} rows (prompt {r.prompt[0]}-{r.prompt[1]}, completion {r.completion[0]}-"
              f"{r.completion[1]} tokens); batch {r.batch} rows in micro-batches of {r.micro}; beta {r.beta}, T 1, "
              f"lr {r.lr}, fp32, {torch.get_num_threads()} threads; transformers {transformers.__version__}, trl "
              f"{trl.__version__}; load average {load_start[0]:.2f}")
        checked = {v: run_step_turn(v, inputs, batches, r, a.check, root) for v in STEP_VARIANTS}
        check_agreement(checked, step_disagreements, a.check)
        turns = time_in_rounds(list(STEP_VARIANTS), lambda v, n: run_step_turn(v, inputs, batches, r, n, root),
                               step_disagreements, checked, a)
    rows, load_end = report_vs_trl(turns, a.steps, load_start[0])
    return {"run": asdict(r), "results": rows, "load_average": {"start": load_start[0], "end": load_end},
            "agreement": {v: {"loss": t.losses, "grad_norm": t.grad_norms} for v, t in checked.items()}}


def parse(argv: Optional[list[str]] = None) -> argparse.Namespace:
    from benchmarks.preference import span

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d, r = Head(), Run()
    p.add_argument("--part", default="both", choices=["memory", "step", "both"])
    p.add_argument("--tokens", type=int, default=d.tokens)
    p.add_argument("--vocab", type=int, default=d.vocab, help="the memory part's vocabulary")
    p.add_argument("--hidden", type=int, default=d.hidden, help="the memory part's student hidden size")
    p.add_argument("--teacher-hidden", type=int, default=d.teacher_hidden)
    p.add_argument("--beta", type=float, default=d.beta, help="both parts' beta")
    p.add_argument("--temperature", type=float, default=d.temperature, help="the memory part's temperature")
    p.add_argument("--chunk", type=int, default=d.chunk, help="megaft's tokens per chunk in the memory part")
    p.add_argument("--rows", type=int, default=r.rows)
    p.add_argument("--batch", type=int, default=r.batch, help="rows per optimizer step")
    p.add_argument("--micro", type=int, default=r.micro, help="rows per micro-batch")
    p.add_argument("--steps", type=int, default=6, help="timed steps per variant, over all rounds")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--check", type=int, default=2, help="steps whose losses (and step 1's grad norm) must agree first")
    p.add_argument("--lr", type=float, default=r.lr)
    p.add_argument("--model-hidden", type=int, default=r.hidden)
    p.add_argument("--layers", type=int, default=r.layers, help="the student's layers")
    p.add_argument("--teacher-layers", type=int, default=r.teacher_layers)
    p.add_argument("--model-vocab", type=int, default=r.vocab)
    p.add_argument("--prompt", type=span, default=r.prompt, help="prompt tokens LO-HI")
    p.add_argument("--completion", type=span, default=r.completion, help="completion tokens LO-HI")
    p.add_argument("--attn", default=r.attn, choices=["sdpa", "eager"])
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def memory_part(h: Head) -> dict:
    runs = {v: measure(v, h) for v in VARIANTS}
    logits_mib = h.tokens * h.vocab * 4 / 2 ** 20
    print(f"memory: head and loss, forward + backward: {h.tokens} tokens, vocabulary {h.vocab}, student hidden "
          f"{h.hidden}, teacher hidden {h.teacher_hidden}, beta {h.beta}, T {h.temperature}, megaft chunk {h.chunk}; "
          f"fp32 (one [tokens x vocab] fp32 tensor: {logits_mib:.1f} MiB); torch {torch.__version__}")
    bad = disagreements(runs)
    for v, r in runs.items():
        print(f"  {v:<9} loss {r['loss']:.8f}")
    if bad:
        print("the variants disagree; no memory figure is valid:\n  " + "\n  ".join(bad))
        sys.exit(1)
    rows = {v: {"peak_mib": r["peak_bytes"] / 2 ** 20, "in_logits": r["peak_bytes"] / (logits_mib * 2 ** 20),
                "vs_gathered": r["peak_bytes"] / runs["gathered"]["peak_bytes"]} for v, r in runs.items()}
    print(f"\n{'variant':<9} {'peak MiB':>9} {'x [N,V]':>8} {'vs gathered':>12}")
    for v, row in rows.items():
        print(f"{v:<9} {row['peak_mib']:>9.1f} {row['in_logits']:>8.2f} {row['vs_gathered']:>11.3f}x")
    return {"head": asdict(h), "results": rows, "loss": {v: r["loss"] for v, r in runs.items()}}


def main(argv: Optional[list[str]] = None) -> None:
    a = parse(argv)
    out = {"command": "python -m benchmarks.distill " + " ".join(sys.argv[1:] if argv is None else argv)}
    if a.part in ("memory", "both"):
        h = Head(a.tokens, a.vocab, a.hidden, a.teacher_hidden, a.beta, a.temperature, a.chunk, a.seed)
        out["memory"] = memory_part(h)
    if a.part in ("step", "both"):
        if a.batch % a.micro:
            raise SystemExit(f"--batch={a.batch} must be a multiple of --micro={a.micro}")
        r = Run(hidden=a.model_hidden, layers=a.layers, teacher_layers=a.teacher_layers, vocab=a.model_vocab,
                rows=a.rows, prompt=a.prompt, completion=a.completion, batch=a.batch, micro=a.micro, beta=a.beta,
                lr=a.lr, attn=a.attn, seed=a.seed)
        out["step"] = step_part(a, r)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
