"""Step time of megaft's DPO step against TRL's DPOTrainer on the same model and pairs, on
the CPU, with the ratio measured in one run (issue 27).

    python -m benchmarks.preference [--pairs N] [--batch B] [--micro M] [--steps N] [--rounds R]
                                    [--warmup W] [--beta B] [--lr LR] [--hidden H] [--layers L] [--heads A]
                                    [--kv-heads K] [--intermediate I] [--vocab V] [--prompt LO-HI]
                                    [--answer LO-HI] [--attn sdpa|eager] [--json PATH]

The model is a random transformers LlamaForCausalLM (default 4 x 256, 4 heads over 2 kv
heads, MLP 688, vocabulary 8192: the head's share of the work is a real model's, though
the character tokenizer only reads its first rows) saved with save_pretrained into a
temporary folder, beside a character-level tokenizer.json whose <pad>, <eos> and <unk> are
special added tokens (TRL's appended eos text is one token, as in a real tokenizer). The
pairs are --pairs random text pairs (prompts of --prompt and answers of --answer
characters: rows of ~50-250 tokens by default) in a JSONL file.

Five variants, each trained from the same weights on the same pairs in the same order
(megaft's epoch-shuffled order; TRL reads them in that order through a SequentialSampler)
with the same batches: --batch pairs a step, split in micro-batches of --micro pairs (TRL:
per_device_train_batch_size=--micro, gradient_accumulation_steps=--batch/--micro), AdamW at
a constant --lr, no weight decay, clipping at 1, fp32:

- `trl`: DPOTrainer(loss_type="sigmoid") with a second copy of the model as ref_model,
  scored online (a reference forward in every step): the reference of the ratios;
- `trl-precomp`: the same with precompute_ref_log_probs=True: the policy, before its first
  update, scores every pair in batches of --micro (timed apart) and no second copy is kept;
- `megaft`: megaft.training.loop.Trainer with train.objective=dpo on a single-process grid;
  it scores the reference once while it is built (its own timing: summary.json's reference_s),
  then `train_step(step)`;
- `megaft-packed`: the same with data.packing=docs: each micro-batch's pairs packed into rows
  of up to 2 x data.seq_len tokens, each answer a document (megaft.pref.packing);
- `megaft-shared`: packed with pref.share_prompt=true: a pair's prompt once in its row, both
  answers attending to it (a tree mask), p + c + r + 1 tokens a pair instead of 2p + c + r.

A step is one optimizer step: megaft's `train_step` call (its batch, forward, backward,
AdamW, the loss and TRL's metrics); TRL's from its on_step_begin to its on_step_end
callback (its micro-batches were already collated, the logging comes after). Before any
timing is trusted the variants must agree: the losses of the first --check steps and the
step-1 grad norm (before clipping; it scales with beta) equal megaft's within 1e-4
relative (step 1's loss is ln 2 on every side: the policy is its own reference), and so
must every timed turn's, or the run exits with status 1. The timing
follows benchmarks.train_step: --rounds interleaved rounds (ABBA: the order reversed every
other round), each turn rebuilt from the checkpoint and started with --warmup untimed
steps; the median (p20-p80) over all of a variant's timed steps, per step and per pair, and
its ratio to `trl` (below 1: faster).

Tokens computed per step: the rows times the length of each micro-batch as it goes
through the model (megaft crops each micro-batch to its longest row, TRL pads it to the
same), counted twice under `trl` (the policy's forward and backward, the reference's
forward); the reference scoring before training is counted apart. With long prompts
(`--prompt 150-250 --answer 10-40`) the shared prompt's saving is the largest.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import statistics
import string
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional, TypeVar

import torch

from benchmarks.kernels.harness import quantile
from benchmarks.train_step.measure import round_orders, split_steps

VARIANTS = ("trl", "trl-precomp", "megaft", "megaft-packed", "megaft-shared")  # the first: the ratios' reference
# megaft's variants: data.packing and pref.share_prompt
MEGAFT = {"megaft": ("none", False), "megaft-packed": ("docs", False), "megaft-shared": ("docs", True)}
SPECIALS = ("<pad>", "<eos>", "<unk>")  # ids 0, 1, 2
# the characters of the pairs' text: no space (a WordLevel word each) and no '<' or '>', so
# no random text spells a special token
CHARS = string.ascii_letters + string.digits + ".,;:!?-'()"
T = TypeVar("T")
RTOL = 1e-4  # fp32 agreement of loss and grad norm (tests/pref: ten steps within 1e-4)


@dataclass
class Sizes:
    """The random model and pairs."""
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 688
    vocab: int = 8192  # model rows; the tokenizer uses the first len(SPECIALS) + len(CHARS)
    pairs: int = 64
    prompt: tuple[int, int] = (20, 120)  # characters (= tokens) of a prompt, uniform
    answer: tuple[int, int] = (30, 130)  # characters of each answer, + 1 eos token
    seed: int = 0


@dataclass
class Settings:
    """How every variant trains."""
    batch: int = 8  # pairs per optimizer step
    micro: int = 2  # pairs per micro-batch
    beta: float = 0.1
    lr: float = 1e-3
    attn: str = "sdpa"  # the transformers models' attention (TRL's default)


@dataclass
class Turn:
    """One variant's turn: every step's seconds (warm-up included), loss, grad norm, tokens."""
    variant: str
    times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # computed per step (see the module docstring)
    build_s: float = 0.0  # construction, the reference scoring included
    reference_s: Optional[float] = None  # the reference scoring before step 1 (megaft, trl-precomp)
    reference_tokens: int = 0


def write_tokenizer(path: str) -> None:
    """A character-level WordLevel tokenizer.json: <pad>=0, <eos>=1, <unk>=2 (special added
    tokens), then CHARS."""
    from tokenizers import AddedToken, Regex, Tokenizer, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIALS + tuple(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.save(os.path.join(path, "tokenizer.json"))


@torch.no_grad()
def write_model(path: str, sizes: Sizes, max_len: int) -> None:
    """A random fp32 LlamaForCausalLM (transformers' init, seeded) and the tokenizer in `path`."""
    import transformers

    if sizes.vocab < len(SPECIALS) + len(CHARS):
        raise SystemExit(f"--vocab={sizes.vocab} is below the tokenizer's {len(SPECIALS) + len(CHARS)} tokens")
    cfg = transformers.LlamaConfig(
        vocab_size=sizes.vocab, hidden_size=sizes.hidden, num_hidden_layers=sizes.layers,
        num_attention_heads=sizes.heads, num_key_value_heads=sizes.kv_heads, intermediate_size=sizes.intermediate,
        max_position_embeddings=max(64 * math.ceil(max_len / 64), 64), rms_norm_eps=1e-5, tie_word_embeddings=False,
        pad_token_id=0, eos_token_id=1, bos_token_id=2)
    torch.manual_seed(sizes.seed)
    transformers.LlamaForCausalLM(cfg).float().save_pretrained(path)
    write_tokenizer(path)


def write_pairs(path: str, sizes: Sizes) -> int:
    """sizes.pairs random {"prompt", "chosen", "rejected"} lines; returns the longest row's tokens."""
    rng = random.Random(sizes.seed)

    def text(lo_hi: tuple[int, int]) -> str:
        return "".join(rng.choice(CHARS) for _ in range(rng.randint(*lo_hi)))

    longest = 0
    with open(path, "w") as f:
        for _ in range(sizes.pairs):
            pair = {"prompt": text(sizes.prompt), "chosen": text(sizes.answer), "rejected": text(sizes.answer)}
            longest = max(longest, len(pair["prompt"]) + 1 + max(len(pair["chosen"]), len(pair["rejected"])))
            f.write(json.dumps(pair) + "\n")
    return longest


def write_inputs(root: str, sizes: Sizes) -> tuple[str, str, int]:
    """(checkpoint folder, pairs file, megaft's data.seq_len: the longest row, a multiple of 8)."""
    ckpt, pairs = os.path.join(root, "ckpt"), os.path.join(root, "pairs.jsonl")
    seq_len = 8 * math.ceil(write_pairs(pairs, sizes) / 8)
    write_model(ckpt, sizes, seq_len)
    return ckpt, pairs, seq_len


def megaft_config(ckpt: str, pairs: str, seq_len: int, s: Settings, steps: int, variant: str = "megaft"):
    """train.objective=dpo on one CPU process: constant LR, no weight decay, fp32; the
    packing of `variant` (MEGAFT)."""
    from megaft.config import Config
    from megaft.validation import resolve, validate

    cfg = Config()
    cfg.model.init_from, cfg.data.path, cfg.data.seq_len, cfg.device = ckpt, pairs, seq_len, "cpu"
    t = cfg.train
    t.objective, t.max_steps, t.global_batch_size, t.micro_batch_size = "dpo", steps, s.batch, s.micro
    t.progress, t.eval_every, t.tensorboard, t.log_phases = False, 10 ** 6, "false", False
    o = cfg.optim
    o.lr = o.min_lr = s.lr
    o.warmup_steps, o.weight_decay = 0, 0.0
    cfg.pref.beta = s.beta
    cfg.data.packing, cfg.pref.share_prompt = MEGAFT[variant]
    problems = validate(cfg, 1)
    if problems:
        raise SystemExit("megaft config:\n  " + "\n  ".join(problems))
    return resolve(cfg)


def scored_tokens(rows, micro: int) -> int:
    """The tokens of megaft's reference scoring: every chunk of `micro` pairs (2 rows each),
    in pair order, cropped to its longest row."""
    return sum(2 * len(c) * int(rows.lengths[torch.cat([2 * c, 2 * c + 1])].max())
               for c in torch.arange(len(rows)).split(micro))


def megaft_turn(ckpt: str, pairs: str, seq_len: int, s: Settings, steps: int, run_dir: str,
                variant: str = "megaft") -> Turn:
    """Build megaft's Trainer (scoring the reference) and run `steps` optimizer steps."""
    from megaft.parallel.grid import ParallelGrid
    from megaft.training.loop import Trainer

    cfg = megaft_config(ckpt, pairs, seq_len, s, steps, variant)
    turn = Turn(variant)
    start = time.perf_counter()
    trainer = Trainer(cfg, ParallelGrid.single(), run_dir)
    turn.build_s = time.perf_counter() - start
    turn.reference_s = trainer.parts.step.reference_s  # what summary.json records as reference_s
    turn.reference_tokens = scored_tokens(trainer.parts.data.rows, s.micro)
    for step in range(steps):
        turn.tokens.append(sum(x.numel() for x in trainer.parts.data.batch(step).inputs))
        start = time.perf_counter()
        out = trainer.train_step(step)
        turn.times.append(time.perf_counter() - start)
        turn.losses.append(out["loss"])
        turn.grad_norms.append(out["grad_norm"])
    return turn


def megaft_order(ckpt: str, pairs: str, seq_len: int, s: Settings, steps: int, root: str) -> list[int]:
    """The pair indices megaft trains in its first `steps` steps, in order (a run folder under `root`)."""
    from megaft.parallel.grid import ParallelGrid
    from megaft.training.loop import Trainer

    cfg = megaft_config(ckpt, pairs, seq_len, s, steps)
    cfg.train.objective = "simpo"  # the same order, built without scoring a reference
    rows = Trainer(cfg, ParallelGrid.single(), tempfile.mkdtemp(prefix="order-", dir=root)).parts.data.rows
    return [int(i) for step in range(steps) for i in rows.pair_ids(step, s.batch)]


def trl_turn(ckpt: str, pairs: str, order: list[int], s: Settings, steps: int, *, precompute: bool,
             out_dir: str) -> Turn:
    """TRL's DPOTrainer on the pairs in `order`, `steps` optimizer steps, each timed from its
    on_step_begin to its on_step_end callback."""
    from datasets import Dataset
    from torch.utils.data import SequentialSampler
    from transformers import LlamaForCausalLM
    from trl import DPOConfig, DPOTrainer

    from megaft.config.optim import OptimConfig

    o = OptimConfig()  # megaft's AdamW betas, eps and clipping, which megaft_config keeps
    turn = Turn("trl-precomp" if precompute else "trl")
    micro_tokens: list[int] = []
    accumulation = s.batch // s.micro

    class Timed(DPOTrainer):
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)  # megaft's order, as given

        def _precompute_ref_logps(self, dataset, name, batch_size):
            start = time.perf_counter()
            out = super()._precompute_ref_logps(dataset, name, batch_size)
            turn.reference_s = time.perf_counter() - start
            return out

        def compute_ref_log_probs(self, model, inputs):
            turn.reference_tokens += inputs["input_ids"].numel()  # the precomputation's batches
            return super().compute_ref_log_probs(model, inputs)

        def compute_loss(self, model, inputs, *args, **kwargs):
            micro_tokens.append(inputs["input_ids"].numel())  # 2 * micro rows x the padded length
            return super().compute_loss(model, inputs, *args, **kwargs)

    records = [json.loads(line) for line in open(pairs)]
    data = Dataset.from_list([records[i] for i in order])
    tok = char_tokenizer(ckpt)
    args = DPOConfig(output_dir=out_dir, beta=s.beta, loss_type="sigmoid", max_length=None, dataloader_drop_last=False,
                     precompute_ref_log_probs=precompute, **trl_args(o, s.micro, accumulation, steps, s.lr))

    def load():
        return LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation=s.attn)

    start = time.perf_counter()
    # precompute: TRL scores with the policy before training (ref_model=None keeps no second copy)
    trainer = Timed(model=load().train(), ref_model=None if precompute else load().eval(), args=args,
                    train_dataset=data, processing_class=tok, callbacks=[step_clock(turn.times)])
    turn.build_s = time.perf_counter() - start
    train_logged(trainer, turn)
    per_step = [sum(micro_tokens[i:i + accumulation]) for i in range(0, len(micro_tokens), accumulation)]
    turn.tokens = [n * (1 if precompute else 2) for n in per_step]
    return turn


def step_clock(times: list[float]):
    """A transformers callback appending each optimizer step's seconds (on_step_begin to on_step_end) to `times`."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - self.start)

    return Clock()


def trl_args(o, micro: int, accumulation: int, steps: int, lr: float) -> dict:
    """The TRL config fields every TRL-side turn shares (benchmarks.preference, .rl, .distill): CPU and fp32,
    megaft's AdamW betas, eps and clip, a constant LR without decay, a log line each step, nothing saved."""
    return dict(report_to="none", use_cpu=True, bf16=False, seed=0, per_device_train_batch_size=micro,
                gradient_accumulation_steps=accumulation, max_steps=steps, learning_rate=lr,
                lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=o.beta1,
                adam_beta2=o.beta2, adam_epsilon=o.eps, max_grad_norm=o.clip_grad, logging_steps=1,
                save_strategy="no", disable_tqdm=True)


def train_logged(trainer, turn) -> None:
    """Train a TRL trainer without its printed log lines; turn.losses and turn.grad_norms from its log history."""
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)
    trainer.train()
    logs = [r for r in trainer.state.log_history if "loss" in r and "train_runtime" not in r]
    turn.losses, turn.grad_norms = [r["loss"] for r in logs], [r["grad_norm"] for r in logs]


def in_fresh_dir(root: str, variant: str, run: Callable[[str], T]) -> T:
    """run(a new folder under `root` named for the variant), then collect what the turn left (models, optimizers)."""
    out = tempfile.mkdtemp(prefix=f"{variant}-", dir=root)
    try:
        return run(out)
    finally:
        gc.collect()


def char_tokenizer(model_dir: str):
    """The model's character tokenizer (write_model's tokenizer.json) as the TRL trainers take it."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=os.path.join(model_dir, "tokenizer.json"), pad_token="<pad>",
                                   eos_token="<eos>", unk_token="<unk>")


def quiet() -> None:
    """No progress bars or per-step log lines from datasets, transformers and TRL."""
    import warnings

    import datasets
    import transformers

    os.environ["TQDM_DISABLE"] = "1"  # TRL's reference precomputation reads it
    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    transformers.logging.set_verbosity_error()
    # transformers 5 renames gradient checkpointing; TRL 1.16 still calls the old names
    warnings.filterwarnings("ignore", category=FutureWarning, message=".*gradient_checkpointing.*")


def run_turn(variant: str, inputs: tuple[str, str, int], order: list[int], s: Settings, steps: int,
             root: str) -> Turn:
    """One turn of `variant`, built from the checkpoint, in a fresh folder under `root`."""
    ckpt, pairs, seq_len = inputs
    if variant in MEGAFT:
        return in_fresh_dir(root, variant, lambda out: megaft_turn(ckpt, pairs, seq_len, s, steps, out, variant))
    return in_fresh_dir(root, variant, lambda out: trl_turn(ckpt, pairs, order, s, steps,
                                                            precompute=variant == "trl-precomp", out_dir=out))


def disagreements(turns: dict[str, Turn], steps: int) -> list[str]:
    """Where a variant's loss over the first `steps` steps, or its step-1 grad norm (which
    scales with beta), differs from megaft's by more than RTOL relative (and megaft's step-1
    loss from ln 2). Later grad norms are not compared: a DPO gradient is the difference of
    the chosen and rejected rows' gradients, whose fp32 rounding it keeps, and AdamW's first
    update moves every weight by about lr however small its gradient, so the two sides'
    rounding reaches the step-2 grad norm at ~2e-4 (the default model) while the losses
    still agree to ~1e-6."""
    want = turns["megaft"]
    bad = [f"megaft step 1 loss {want.losses[0]:.8f}, not ln 2"] if abs(want.losses[0] - math.log(2)) > 1e-6 else []
    for name, got in turns.items():
        if len(got.losses) < steps:
            bad.append(f"{name}: {len(got.losses)} steps logged, {steps} expected")
            continue
        for i in range(steps):
            compared = [("loss", got.losses[i], want.losses[i])]
            if i == 0:
                compared.append(("grad_norm", got.grad_norms[0], want.grad_norms[0]))
            for what, g, w in compared:
                if abs(g - w) > RTOL * abs(w):
                    bad.append(f"{name} step {i + 1} {what}: {g:.8f} against megaft's {w:.8f}")
    return bad


def agreement(inputs: tuple[str, str, int], order: list[int], s: Settings, steps: int,
              root: str) -> tuple[dict[str, Turn], list[str]]:
    """Every variant's first `steps` steps, and where they disagree with megaft's."""
    turns = {v: run_turn(v, inputs, order, s, steps, root) for v in VARIANTS}
    return turns, disagreements(turns, steps)


def rounds(inputs: tuple[str, str, int], order: list[int], s: Settings, *, steps: int, rounds: int, warmup: int,
           root: str, checked: Turn) -> dict[str, list[Turn]]:
    """Every variant's turns, ABBA-interleaved, each `warmup` untimed + its share of `steps`;
    each turn's first steps must repeat the `checked` megaft turn's losses and grad norms."""
    turns: dict[str, list[Turn]] = {v: [] for v in VARIANTS}
    for variants, n in zip(round_orders(list(VARIANTS), rounds), split_steps(steps, rounds)):
        for v in variants:
            turn = run_turn(v, inputs, order, s, warmup + n, root)
            bad = disagreements({"megaft": checked, v: turn}, min(len(checked.losses), warmup + n))
            if bad:
                print(f"a {v} turn left the checked curve; no timing is valid:\n  " + "\n  ".join(bad))
                sys.exit(1)
            turn.times, turn.tokens = turn.times[warmup:], turn.tokens[warmup:]
            turns[v].append(turn)
            print(f"  {v:<12} {len(turn.times)} steps, median {1e3 * statistics.median(turn.times):.0f} ms",
                  flush=True)
    return turns


def report(turns: dict[str, list[Turn]], batch: int) -> dict[str, dict]:
    """Per variant: the step time's median and p20/p80 (ms, per step and per pair), the ratio
    to TRL online, the reference scoring time and tokens, tokens computed per step."""
    out = {}
    for v in VARIANTS:
        times = [t for turn in turns[v] for t in turn.times]
        refs = [turn.reference_s for turn in turns[v] if turn.reference_s is not None]
        out[v] = {"step_ms": 1e3 * statistics.median(times), "p20_ms": 1e3 * quantile(times, 0.2),
                  "p80_ms": 1e3 * quantile(times, 0.8), "pair_ms": 1e3 * statistics.median(times) / batch,
                  "steps": len(times), "tokens_per_step": statistics.mean(n for turn in turns[v] for n in turn.tokens),
                  "reference_s": statistics.median(refs) if refs else None,
                  "reference_tokens": turns[v][0].reference_tokens or None,
                  "build_s": statistics.median(turn.build_s for turn in turns[v])}
    for v in VARIANTS:
        out[v]["vs_trl"] = out[v]["step_ms"] / out["trl"]["step_ms"]
    return out


def print_report(rows: dict[str, dict]) -> None:
    print(f"\n{'variant':<12} {'step_ms':>9} {'p20-p80':>13} {'pair_ms':>8} {'vs trl':>7} {'tokens/step':>12} "
          f"{'ref_s (once)':>12} {'ref_tokens':>10} {'build_s':>8}")
    for v, r in rows.items():
        ref = f"{r['reference_s']:.2f}" if r["reference_s"] is not None else "-"
        print(f"{v:<12} {r['step_ms']:>9.1f} {r['p20_ms']:>6.0f}-{r['p80_ms']:<6.0f} {r['pair_ms']:>8.1f} "
              f"{r['vs_trl']:>6.3f}x {r['tokens_per_step']:>12.0f} {ref:>12} {r['reference_tokens'] or '-':>10} "
              f"{r['build_s']:>8.2f}")


def add_model_args(p: argparse.ArgumentParser, d) -> None:
    """The random Llama's shape options (--hidden ... --vocab), defaulting to `d`'s (a Sizes);
    benchmarks.rl takes the same."""
    p.add_argument("--hidden", type=int, default=d.hidden)
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--heads", type=int, default=d.heads)
    p.add_argument("--kv-heads", type=int, default=d.kv_heads)
    p.add_argument("--intermediate", type=int, default=d.intermediate)
    p.add_argument("--vocab", type=int, default=d.vocab, help="the model's vocabulary rows")


def span(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    return int(lo), int(hi or lo)


def parse(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d, e = Sizes(), Settings()
    p.add_argument("--pairs", type=int, default=d.pairs, help="random pairs in the JSONL file")
    p.add_argument("--batch", type=int, default=e.batch, help="pairs per optimizer step")
    p.add_argument("--micro", type=int, default=e.micro,
                   help="pairs per micro-batch (TRL: per_device_train_batch_size; accumulation batch/micro)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per variant, over all rounds")
    p.add_argument("--rounds", type=int, default=2,
                   help="interleaved rounds, the order reversed every other (2: ABBA)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps at the start of each turn")
    p.add_argument("--check", type=int, default=2, help="steps whose losses (and step 1's grad norm) must agree first")
    p.add_argument("--beta", type=float, default=e.beta)
    p.add_argument("--lr", type=float, default=e.lr)
    p.add_argument("--attn", default=e.attn, choices=["sdpa", "eager"], help="the transformers models' attention")
    add_model_args(p, d)
    p.add_argument("--prompt", type=span, default=d.prompt, help="prompt characters LO-HI (one token each)")
    p.add_argument("--answer", type=span, default=d.answer, help="answer characters LO-HI (+ 1 eos token)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--json", default=None, help="also write the settings, agreement and results to this file")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> None:
    a = parse(argv)
    sizes = Sizes(a.hidden, a.layers, a.heads, a.kv_heads, a.intermediate, a.vocab, a.pairs, a.prompt, a.answer,
                  a.seed)
    s = Settings(a.batch, a.micro, a.beta, a.lr, a.attn)
    per_turn = a.warmup + max(split_steps(a.steps, a.rounds))
    if a.batch % a.micro:
        raise SystemExit(f"--batch={a.batch} must be a multiple of --micro={a.micro}")
    if max(per_turn, a.check) * a.batch > a.pairs:
        raise SystemExit(f"a turn of {max(per_turn, a.check)} steps of {a.batch} pairs needs --pairs >= "
                         f"{max(per_turn, a.check) * a.batch} (one epoch: TRL's order then repeats megaft's)")
    load_start = os.getloadavg()
    import transformers
    import trl

    quiet()

    with tempfile.TemporaryDirectory(prefix="pref-bench-") as root:
        inputs = write_inputs(root, sizes)
        epoch = megaft_order(*inputs, s, math.ceil(a.pairs / a.batch), root)[:a.pairs]
        print(f"model: random Llama {a.layers} x {a.hidden}, {a.heads} heads / {a.kv_heads} kv, MLP "
              f"{a.intermediate}, vocab {a.vocab}; {a.pairs} pairs (prompt {a.prompt[0]}-{a.prompt[1]}, answers "
              f"{a.answer[0]}-{a.answer[1]} characters), data.seq_len {inputs[2]}; batch {a.batch} pairs in "
              f"micro-batches of {a.micro}; beta {a.beta}, lr {a.lr}, fp32, {torch.get_num_threads()} threads; "
              f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}; "
              f"load average {load_start[0]:.2f} at the start")
        checked, bad = agreement(inputs, epoch, s, a.check, root)
        print(f"\nagreement over the first {a.check} steps (loss / grad norm before clipping, rel {RTOL}):")
        for v, t in checked.items():
            print(f"  {v:<12} " + "  ".join(f"{loss:.8f} / {norm:.6f}" for loss, norm in
                                            zip(t.losses[:a.check], t.grad_norms[:a.check])))
        if bad:
            print("the variants disagree; no timing is valid:\n  " + "\n  ".join(bad))
            sys.exit(1)
        print(f"\n{a.rounds} rounds of {', '.join(VARIANTS)} (reversed every other), {a.warmup} warm-up step(s) "
              "per turn:")
        turns = rounds(inputs, epoch, s, steps=a.steps, rounds=a.rounds, warmup=a.warmup, root=root,
                       checked=checked["megaft"])
    rows = report(turns, a.batch)
    load_end = os.getloadavg()
    print_report(rows)
    print(f"\nper step and per pair: medians over {a.steps} timed steps; vs trl: below 1 is faster than TRL's "
          f"online reference. load average {load_start[0]:.2f} at the start, {load_end[0]:.2f} at the end")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": "python -m benchmarks.preference " + " ".join(sys.argv[1:] if argv is None else argv),
                       "sizes": asdict(sizes), "settings": asdict(s), "steps": a.steps, "rounds": a.rounds,
                       "warmup": a.warmup, "threads": torch.get_num_threads(), "torch": torch.__version__,
                       "transformers": transformers.__version__, "trl": trl.__version__,
                       "agreement": {v: {"loss": t.losses, "grad_norm": t.grad_norms} for v, t in checked.items()},
                       "load_average": {"start": load_start[0], "end": load_end[0]}, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
