"""Step time of megaft's GRPO step against TRL's GRPOTrainer on the same model and logged
rollouts, on the CPU, with the ratio measured in one run (issue 39).

    python -m benchmarks.rl [--prompts N] [--generations G] [--batch B] [--micro M] [--steps N]
                            [--rounds R] [--warmup W] [--loss-type dapo|grpo|dr_grpo|bnpo] [--lr LR]
                            [--hidden H] [--layers L] [--heads A] [--kv-heads K] [--intermediate I]
                            [--vocab V] [--prompt LO-HI] [--completion LO-HI] [--attn sdpa|eager] [--json PATH]

The model and tokenizer are benchmarks.preference's (a random transformers Llama, default
4 x 256, vocabulary 8192, a character tokenizer). The rollouts are --prompts random prompts of
--prompt tokens with --generations completions of --completion tokens each and random rewards,
one JSONL line a prompt (megaft's rl.rollouts form). No generation is timed: both sides train on
the same logged rollouts, megaft reading the file (train.objective=grpo rl.rollouts=FILE), TRL
through its `rollout_func` (the documented way to feed it rollouts made elsewhere), scoring them
with a reward function returning the logged rewards. --batch completions a step in micro-batches
of --micro (TRL: per_device_train_batch_size=--micro, gradient_accumulation_steps=--batch/--micro,
its generation batch the step's), AdamW at a constant --lr, no weight decay, clipping at 1, fp32,
rl.beta 0 (TRL's default), on-policy.

A step is one optimizer step: megaft's `train_step` (its batch, forward, backward, AdamW, the
loss and TRL's metrics); TRL's from its on_step_begin to its on_step_end callback, which holds
its scoring of the step's rollouts (decode, rewards, advantages) and its micro-batches. Before
any timing is trusted, the losses of the first --check steps and step 1's grad norm must equal
megaft's within 1e-4 relative, in every timed turn too, or the run exits with status 1. Timing
as benchmarks.preference: --rounds ABBA rounds, --warmup untimed steps a turn, the median step
(p20-p80) and its ratio to TRL's (below 1: faster).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Optional

import torch

from benchmarks.preference import (
    CHARS,
    SPECIALS,
    Sizes,
    Turn,
    add_model_args,
    char_tokenizer,
    in_fresh_dir,
    quiet,
    span,
    step_clock,
    train_logged,
    trl_args,
    write_model,
)
from benchmarks.train_step.measure import split_steps
from benchmarks.versus import check_agreement, curve_disagreements, report_vs_trl, time_in_rounds
from megaft.config.rl import LOSS_TYPES

VARIANTS = ("trl", "megaft")  # the first: the ratios' reference
RTOL = 1e-4  # fp32 agreement of loss and grad norm


@dataclass
class Rollouts:
    prompts: int = 32
    generations: int = 4
    prompt: tuple[int, int] = (20, 80)  # tokens of a prompt, uniform
    completion: tuple[int, int] = (10, 120)  # tokens of a completion, uniform
    seed: int = 0


@dataclass
class Settings:
    batch: int = 16  # completions per optimizer step (whole groups)
    micro: int = 4  # completions per micro-batch
    loss_type: str = "dapo"
    lr: float = 1e-5
    attn: str = "sdpa"


def write_rollouts(path: str, r: Rollouts) -> int:
    """r.prompts lines of random token ids (never a special token) and rewards; the longest row."""
    rng = random.Random(r.seed)
    first = len(SPECIALS)

    def ids(lo_hi: tuple[int, int]) -> list[int]:
        return [rng.randrange(first, first + len(CHARS)) for _ in range(rng.randint(*lo_hi))]

    longest = 0
    with open(path, "w") as f:
        for _ in range(r.prompts):
            prompt, completions = ids(r.prompt), [ids(r.completion) for _ in range(r.generations)]
            longest = max(longest, len(prompt) + max(map(len, completions)))
            f.write(json.dumps({"prompt_ids": prompt, "completion_ids": completions,
                                "rewards": [float(rng.randint(0, 4)) for _ in completions]}) + "\n")
    return longest


def megaft_turn(ckpt: str, path: str, seq_len: int, r: Rollouts, s: Settings, steps: int, run_dir: str) -> Turn:
    from megaft.config import Config
    from megaft.parallel.grid import ParallelGrid
    from megaft.training.loop import Trainer
    from megaft.validation import resolve, validate

    cfg = Config()
    cfg.model.init_from, cfg.data.seq_len, cfg.device = ckpt, seq_len, "cpu"
    cfg.rl.rollouts, cfg.rl.num_generations, cfg.rl.loss_type = path, r.generations, s.loss_type
    cfg.rl.max_completion_length = r.completion[1]
    t = cfg.train
    t.objective, t.max_steps, t.global_batch_size, t.micro_batch_size = "grpo", steps, s.batch, s.micro
    t.progress, t.eval_every, t.tensorboard, t.log_phases = False, 10 ** 6, "false", False
    cfg.optim.lr = cfg.optim.min_lr = s.lr
    cfg.optim.warmup_steps, cfg.optim.weight_decay = 0, 0.0
    problems = validate(cfg, 1)
    if problems:
        raise SystemExit("megaft config:\n  " + "\n  ".join(problems))
    trainer = Trainer(resolve(cfg), ParallelGrid.single(), run_dir)
    turn = Turn("megaft")
    for step in range(steps):
        start = time.perf_counter()
        out = trainer.train_step(step)
        turn.times.append(time.perf_counter() - start)
        turn.losses.append(out["loss"])
        turn.grad_norms.append(out["grad_norm"])
    return turn


def trl_turn(ckpt: str, path: str, r: Rollouts, s: Settings, steps: int, out_dir: str) -> Turn:
    from datasets import Dataset
    from transformers import LlamaForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from megaft.config.optim import OptimConfig

    o, turn = OptimConfig(), Turn("trl")
    groups = [json.loads(line) for line in open(path)]
    rewards = {(k, g): reward for k, line in enumerate(groups) for g, reward in enumerate(line["rewards"])}

    def rollout(prompts, trainer):  # each prompt (a group's index) comes G times in a row
        seen: dict[str, int] = {}
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "group": [], "generation": []}
        for p in prompts:
            k, g = int(p), seen.get(p, 0)
            seen[p] = g + 1
            out["prompt_ids"].append(groups[k]["prompt_ids"])
            out["completion_ids"].append(groups[k]["completion_ids"][g])
            out["logprobs"].append([0.0] * len(groups[k]["completion_ids"][g]))
            out["group"].append(k)
            out["generation"].append(g)
        return out

    def logged(completions, group, generation, **kwargs):
        return [rewards[(k, g)] for k, g in zip(group, generation)]

    tok = char_tokenizer(ckpt)
    args = GRPOConfig(output_dir=out_dir, beta=0.0, loss_type=s.loss_type, num_generations=r.generations,
                      shuffle_dataset=False, max_completion_length=r.completion[1],
                      **trl_args(o, s.micro, s.batch // s.micro, steps, s.lr))
    model = LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation=s.attn).train()
    data = Dataset.from_dict({"prompt": [str(k) for k in range(len(groups))]})
    trainer = GRPOTrainer(model=model, reward_funcs=logged, args=args, train_dataset=data, processing_class=tok,
                          rollout_func=rollout, callbacks=[step_clock(turn.times)])
    train_logged(trainer, turn)
    return turn


def run_turn(variant: str, inputs: tuple, r: Rollouts, s: Settings, steps: int, root: str) -> Turn:
    ckpt, path, seq_len = inputs
    if variant == "megaft":
        return in_fresh_dir(root, variant, lambda out: megaft_turn(ckpt, path, seq_len, r, s, steps, out))
    return in_fresh_dir(root, variant, lambda out: trl_turn(ckpt, path, r, s, steps, out))


def disagreements(turns: dict[str, Turn], steps: int) -> list[str]:
    """Where a variant's first `steps` losses or its step-1 grad norm differ from megaft's by more than RTOL."""
    return curve_disagreements(turns, steps, RTOL, floor=1e-3)  # grpo's on-policy loss is ~0: an absolute floor


def parse(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d, r, e = Sizes(), Rollouts(), Settings()
    p.add_argument("--prompts", type=int, default=r.prompts)
    p.add_argument("--generations", type=int, default=r.generations, help="completions per prompt (G)")
    p.add_argument("--batch", type=int, default=e.batch, help="completions per optimizer step (whole groups)")
    p.add_argument("--micro", type=int, default=e.micro, help="completions per micro-batch")
    p.add_argument("--steps", type=int, default=6, help="timed steps per variant, over all rounds")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--check", type=int, default=2, help="steps whose losses (and step 1's grad norm) must agree first")
    p.add_argument("--loss-type", default=e.loss_type, choices=LOSS_TYPES)
    p.add_argument("--lr", type=float, default=e.lr)
    p.add_argument("--attn", default=e.attn, choices=["sdpa", "eager"])
    add_model_args(p, d)
    p.add_argument("--prompt", type=span, default=r.prompt, help="prompt tokens LO-HI")
    p.add_argument("--completion", type=span, default=r.completion, help="completion tokens LO-HI")
    p.add_argument("--seed", type=int, default=r.seed)
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> None:
    a = parse(argv)
    sizes = Sizes(a.hidden, a.layers, a.heads, a.kv_heads, a.intermediate, a.vocab, seed=a.seed)
    r = Rollouts(a.prompts, a.generations, a.prompt, a.completion, a.seed)
    s = Settings(a.batch, a.micro, a.loss_type, a.lr, a.attn)
    per_turn = a.warmup + max(split_steps(a.steps, a.rounds))
    if a.batch % a.micro or a.batch % a.generations:
        raise SystemExit(f"--batch={a.batch} must be a multiple of --micro={a.micro} and --generations={a.generations}")
    if max(per_turn, a.check) * a.batch > a.prompts * a.generations:
        raise SystemExit(f"a turn of {max(per_turn, a.check)} steps needs --prompts >= "
                         f"{max(per_turn, a.check) * a.batch // a.generations} (TRL's epoch then repeats megaft's)")
    load_start = os.getloadavg()
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func: TRL calls it experimental
    import transformers
    import trl

    quiet()
    with tempfile.TemporaryDirectory(prefix="rl-bench-") as root:
        ckpt, path = os.path.join(root, "ckpt"), os.path.join(root, "rollouts.jsonl")
        seq_len = 8 * -(-write_rollouts(path, r) // 8)
        write_model(ckpt, sizes, seq_len)
        inputs = (ckpt, path, seq_len)
        print(f"model: random Llama {a.layers} x {a.hidden}, vocab {a.vocab}; {a.prompts} prompts x {a.generations} "
              f"completions (prompt {a.prompt[0]}-{a.prompt[1]}, completion {a.completion[0]}-{a.completion[1]} "
              f"tokens); batch {a.batch} completions in micro-batches of {a.micro}; {a.loss_type}, lr {a.lr}, fp32, "
              f"{torch.get_num_threads()} threads; torch {torch.__version__}, transformers "
              f"{transformers.__version__}, trl {trl.__version__}; load average {load_start[0]:.2f}")
        checked = {v: run_turn(v, inputs, r, s, a.check, root) for v in VARIANTS}
        check_agreement(checked, disagreements, a.check)
        turns = time_in_rounds(list(VARIANTS), lambda v, n: run_turn(v, inputs, r, s, n, root), disagreements,
                               checked, a)
    rows, load_end = report_vs_trl(turns, a.steps, load_start[0])
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": "python -m benchmarks.rl " + " ".join(sys.argv[1:] if argv is None else argv),
                       "sizes": asdict(sizes), "rollouts": asdict(r), "settings": asdict(s), "results": rows,
                       "agreement": {v: {"loss": t.losses, "grad_norm": t.grad_norms} for v, t in checked.items()},
                       "load_average": {"start": load_start[0], "end": load_end}}, f, indent=1)


if __name__ == "__main__":
    main()
