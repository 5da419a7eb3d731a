"""`make rl`: GRPO that learns. From a short run of `make train`'s task (reverse a lowercase
string, "abcd=" -> "dcba"), GRPO with the built-in exact_match reward on the task's training
prompts raises the exact-match accuracy on its 256 held-out prompts.

    python -m benchmarks.rl_demo [--out DIR] [--sft-steps 120] [--grpo-steps 60]

1. SFT: `megaft-train` on the embedded default (tp=2 on 2 CPU ranks) for --sft-steps, exported
   as a Hugging Face folder (RUN/hf);
2. GRPO: `megaft-train model.init_from=RUN/hf recipe=grpo` on the task's training prompts
   (`{"prompt", "answer"}` lines: rl.prompts), G completions a prompt sampled at the training
   layout, `rl.reward=[exact_match]`;
3. the held-out accuracy of both checkpoints, greedy, as megaft-train's eval_accuracy computes it
   (megaft.training.evaluate.eval_accuracy), printed with the commands and written to
   OUT/rl_demo.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from contextlib import nullcontext

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(os.path.dirname(sys.executable), "megaft-train")


def _train(overrides: list[str]) -> float:
    """Run megaft-train with `overrides`; its wall seconds. Raises with the log's tail on failure."""
    start = time.monotonic()
    out = subprocess.run([TRAIN, *overrides], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"megaft-train {' '.join(overrides)} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return time.monotonic() - start


def held_out_accuracy(hf_dir: str, task) -> float:
    """Greedy exact-match accuracy of `hf_dir` on the task's held-out prompts, one process."""
    from tokenizers import Tokenizer

    from megaft.chat.load import build_model, locate
    from megaft.data.tokenizer import special_ids
    from megaft.parallel.grid import ParallelGrid
    from megaft.training.evaluate import eval_accuracy

    tok = Tokenizer.from_file(os.path.join(hf_dir, "tokenizer.json"))
    model = build_model(locate(hf_dir))
    return eval_accuracy(model, task, tok, special_ids(tok, None)[0], ParallelGrid.single(), nullcontext)


def write_prompts(path: str, task, n: int) -> None:
    """The first `n` distinct training prompts of the task (none held out), with their answers."""
    seen: dict[str, str] = {}
    for ex in task.train:
        seen.setdefault(ex["prompt"], ex["completion"])
        if len(seen) == n:
            break
    with open(path, "w") as f:
        f.writelines(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in seen.items())


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "outputs", "rl_demo"))
    ap.add_argument("--sft-steps", type=int, default=120)
    ap.add_argument("--grpo-steps", type=int, default=60)
    ap.add_argument("--prompts", type=int, default=2000)
    args = ap.parse_args(argv)
    from omegaconf import OmegaConf

    from megaft.data.tasks import make_task

    sft, grpo, prompts = (os.path.join(args.out, n) for n in ("sft", "grpo", "prompts.jsonl"))
    os.makedirs(args.out, exist_ok=True)
    sft_args = [f"hydra.run.dir={sft}", f"train.max_steps={args.sft_steps}", "train.export_hf=true",
                "train.progress=false"]
    sft_s = _train(sft_args)
    data = OmegaConf.load(os.path.join(sft, "config.yaml")).data
    task = make_task(data.task, data.task_train_size, data.task_eval_size, data.seed)
    write_prompts(prompts, task, args.prompts)
    # lr: the tiny model's (recipe=grpo's 1e-6 is for billion-parameter checkpoints); 8 prompts x G=8 a step
    grpo_args = [f"hydra.run.dir={grpo}", f"model.init_from={sft}/hf", "recipe=grpo", f"rl.prompts={prompts}",
                 "rl.reward=[exact_match]", "rl.num_generations=8", "rl.max_completion_length=8",
                 "train.global_batch_size=64", "train.micro_batch_size=32", f"train.max_steps={args.grpo_steps}",
                 "train.epochs=null", "optim.lr=3e-4", "optim.warmup_steps=5", "optim.warmup_ratio=null",
                 "train.export_hf=true", "train.progress=false", "data.seq_len=16"]
    grpo_s = _train(grpo_args)
    before, after = held_out_accuracy(f"{sft}/hf", task), held_out_accuracy(f"{grpo}/hf", task)
    with open(os.path.join(grpo, "metrics.jsonl")) as f:
        rewards = [(r["step"], r["reward"]) for r in map(json.loads, f) if "reward" in r]
    result = {"sft": "megaft-train " + " ".join(sft_args), "grpo": "megaft-train " + " ".join(grpo_args),
              "held_out": len(task.eval), "accuracy_before": before, "accuracy_after": after,
              "reward_first": rewards[0][1], "reward_last": rewards[-1][1], "sft_s": round(sft_s, 1),
              "grpo_s": round(grpo_s, 1), "rewards": rewards}
    with open(os.path.join(args.out, "rl_demo.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"SFT  ({sft_s:.0f} s): {result['sft']}")
    print(f"GRPO ({grpo_s:.0f} s): {result['grpo']}")
    print(f"held-out exact match ({len(task.eval)} prompts, greedy): {before:.1%} after SFT -> {after:.1%} after GRPO; "
          f"mean reward {rewards[0][1]:.3f} at step {rewards[0][0]} -> {rewards[-1][1]:.3f} at step {rewards[-1][0]}")
    return result


if __name__ == "__main__":
    main()
