"""Rollout throughput of GRPO's generation (rl.prompts) against transformers' `generate` on the
same random Llama and prompts, same sampling (temperature, top_p), KV cache on both, fp32 (issue 39).

    python -m benchmarks.rl_rollouts [--prompts N] [--generations G] [--new-tokens T] [--temperature X]
                                     [--top-p P] [--rounds R] [--hidden H] [--layers L] [--vocab V] ...

Variants, each timed over the same --prompts prompts (--prompt tokens each), --new-tokens new tokens
a completion at most (the eos of a random model is rare: nearly every completion is full length):

- megaft: megaft.training.objectives.grpo's rollout path, megaft.inference.generate on a megaft
  Decoder loaded from the checkpoint, one call for every prompt's G rows, left-padded, each prompt's
  rows drawing from their own generator (seeded by the prompt's position, as a GRPO step draws them);
- megaft_per_prompt: the same draws, one call a prompt of its G rows (the rollout path before
  left padding: prompts of different lengths could not share a batch);
- hf_per_prompt: transformers' `generate(do_sample=True)` with the same G rows a call;
- hf_batched: one transformers `generate` call for every prompt's G rows, left-padded (TRL's way).

Then --steps GRPO steps of megaft's Trainer on the same prompts (rl.prompts, exact_match reward,
one process, all prompts a step), each split into generation, scoring (the reward functions) and
training (the rest: advantages, forward, backward, AdamW).

Reported: new tokens per second (the completion tokens kept, eos included) of each variant, the
median of --rounds rounds run in ABBA order. The draws differ between the two libraries (other
generators); the token counts are each variant's own.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from typing import Optional

import torch

from benchmarks.preference import CHARS, SPECIALS, Sizes, add_model_args, quiet, span, write_model

EOS, PAD = 1, 0
VARIANTS = ("hf_per_prompt", "hf_batched", "megaft_per_prompt", "megaft")


def megaft_rollouts(model, prompts: list[list[int]], g: int, new: int, temperature: float, top_p: float,
                    batched: bool) -> int:
    from megaft.inference.generate import Sampling, generate
    from megaft.rl.online import draw_seed

    sampling = Sampling(temperature=temperature, top_p=top_p, seed=0)
    kw = dict(max_new_tokens=new, eos_id=[EOS], device=torch.device("cpu"), sampling=sampling, keep_eos=True)
    if batched:
        out = generate(model, [p for p in prompts for _ in range(g)],
                       step=[draw_seed(0, j) for j in range(len(prompts)) for _ in range(g)], **kw)
        return sum(len(c) for c in out)
    n = 0
    for j, p in enumerate(prompts):
        n += sum(len(c) for c in generate(model, [p] * g, step=draw_seed(0, j), **kw))
    return n


def _kept(rows: torch.Tensor) -> int:
    """New tokens up to and including each row's first eos (padding after it dropped)."""
    n = 0
    for row in rows.tolist():
        n += row.index(EOS) + 1 if EOS in row else len(row)
    return n


def hf_rollouts(model, prompts: list[list[int]], g: int, new: int, temperature: float, top_p: float,
                batched: bool) -> int:
    kw = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0, max_new_tokens=new, eos_token_id=EOS,
              pad_token_id=PAD, use_cache=True)
    if not batched:
        n = 0
        for p in prompts:
            out = model.generate(torch.tensor([p] * g), **kw)
            n += _kept(out[:, len(p):])
        return n
    rows = [p for p in prompts for _ in range(g)]
    width = max(len(p) for p in rows)
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in rows])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows])
    out = model.generate(input_ids=ids, attention_mask=mask, **kw)
    return _kept(out[:, width:])


def step_split(root: str, prompts: list[list[int]], g: int, new: int, steps: int) -> dict[str, float]:
    """Median seconds of a GRPO step on rl.prompts (megaft's Trainer, one process, the same model and
    prompts, exact_match reward) split into generation (the rollouts), scoring (the reward functions)
    and training (the rest of train_step: advantages, forward, backward, AdamW), over `steps` steps
    after one untimed."""
    import json

    from megaft.config import Config
    from megaft.parallel.grid import ParallelGrid
    from megaft.training.loop import Trainer
    from megaft.validation import resolve, validate

    path = os.path.join(root, "prompts.jsonl")
    with open(path, "w") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": "".join(CHARS[i - len(SPECIALS)] for i in p), "answer": "a"}) + "\n")
    cfg = Config()
    cfg.model.init_from, cfg.data.seq_len, cfg.device = root, 8 * -(-(max(map(len, prompts)) + new) // 8), "cpu"
    cfg.rl.prompts, cfg.rl.reward, cfg.rl.num_generations, cfg.rl.max_completion_length = path, ["exact_match"], g, new
    t = cfg.train
    t.objective, t.max_steps, t.global_batch_size, t.micro_batch_size = "grpo", steps + 1, len(prompts) * g, g
    t.progress, t.eval_every, t.tensorboard, t.log_phases = False, 10 ** 6, "false", False
    cfg.optim.warmup_steps, cfg.optim.weight_decay = 0, 0.0
    problems = validate(cfg, 1)
    if problems:
        raise SystemExit("megaft config:\n  " + "\n  ".join(problems))
    os.makedirs(os.path.join(root, "run"), exist_ok=True)
    trainer = Trainer(resolve(cfg), ParallelGrid.single(), os.path.join(root, "run"))
    data = trainer.parts.data
    spent = {"generation": 0.0, "scoring": 0.0}
    made = [0]  # the new tokens of the timed steps' rollouts

    def timed(name, fn):
        def run(*args):
            start = time.perf_counter()
            try:
                out = fn(*args)
            finally:
                spent[name] += time.perf_counter() - start
            if name == "generation" and step:
                made[0] += sum(len(c) for rows in out.values() for c in rows)
            return out
        return run
    data.online.generate = timed("generation", data.online.generate)
    data.score = timed("scoring", data.score)
    rows: dict[str, list[float]] = {"generation": [], "scoring": [], "training": [], "step": []}
    step = 0
    for step in range(steps + 1):
        spent.update(generation=0.0, scoring=0.0)
        start = time.perf_counter()
        trainer.train_step(step)
        total = time.perf_counter() - start
        if step:
            rows["step"].append(total)
            rows["generation"].append(spent["generation"])
            rows["scoring"].append(spent["scoring"])
            rows["training"].append(total - spent["generation"] - spent["scoring"])
    out = {k: statistics.median(v) for k, v in rows.items()}
    out["generation_tokens_per_s"] = made[0] / sum(rows["generation"])
    return out


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = Sizes()
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--generations", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt", type=span, default=(20, 80), help="prompt tokens LO-HI")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=2, help="timed GRPO steps of the step split (0: none)")
    add_model_args(p, d)
    a = p.parse_args(argv)
    import transformers

    from megaft.chat.load import build_model, locate

    quiet()
    sizes = Sizes(a.hidden, a.layers, a.heads, a.kv_heads, a.intermediate, a.vocab, seed=a.seed)
    rng = random.Random(a.seed)
    first = len(SPECIALS)
    prompts = [[rng.randrange(first, first + len(CHARS)) for _ in range(rng.randint(*a.prompt))]
               for _ in range(a.prompts)]
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="rl-rollouts-") as root:
        write_model(root, sizes, max(len(x) for x in prompts) + a.new_tokens)
        hf = transformers.LlamaForCausalLM.from_pretrained(root).float().eval()
        ours = build_model(locate(root)).eval()
        split = step_split(root, prompts, a.generations, a.new_tokens, a.steps) if a.steps else None
    run = {"megaft": lambda: megaft_rollouts(ours, prompts, a.generations, a.new_tokens, a.temperature, a.top_p,
                                             True),
           "megaft_per_prompt": lambda: megaft_rollouts(ours, prompts, a.generations, a.new_tokens, a.temperature,
                                                        a.top_p, False),
           "hf_per_prompt": lambda: hf_rollouts(hf, prompts, a.generations, a.new_tokens, a.temperature, a.top_p,
                                                False),
           "hf_batched": lambda: hf_rollouts(hf, prompts, a.generations, a.new_tokens, a.temperature, a.top_p, True)}
    rates: dict[str, list[float]] = {v: [] for v in VARIANTS}
    with torch.no_grad():
        for v in VARIANTS:  # warm-up, untimed
            run[v]()
        for r in range(a.rounds):
            for v in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
                start = time.perf_counter()
                n = run[v]()
                rates[v].append(n / (time.perf_counter() - start))
    print(f"random Llama {a.layers} x {a.hidden}, vocab {a.vocab}; {a.prompts} prompts ({a.prompt[0]}-{a.prompt[1]} "
          f"tokens) x {a.generations} completions of <= {a.new_tokens} tokens; temperature {a.temperature}, "
          f"top_p {a.top_p}; fp32, {torch.get_num_threads()} threads; transformers {transformers.__version__}")
    base, batched = statistics.median(rates["hf_per_prompt"]), statistics.median(rates["hf_batched"])
    for v in VARIANTS:
        med = statistics.median(rates[v])
        print(f"{v:<17} {med:>9.1f} tokens/s  {med / base:>6.3f}x hf_per_prompt  {med / batched:>6.3f}x hf_batched")
    if split:
        rate = split.pop("generation_tokens_per_s")
        print(f"GRPO step (rl.prompts, the same prompts, median of {a.steps}): " + ", ".join(
            f"{k} {1e3 * v:.0f} ms" for k, v in split.items()) + f"; generation {rate:.1f} tokens/s")
    print(f"load average {load_start[0]:.2f} at the start, {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
