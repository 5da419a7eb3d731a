"""benchmarks/rl_demo.py (`make rl`): its prompts are the task's training prompts, never a held-out
one, each with its exact answer; what exact_match then scores is the task's own answer."""
from __future__ import annotations

import json

from benchmarks.rl_demo import write_prompts
from megaft.data.tasks import make_task
from megaft.rl.rewards import exact_match


def test_demo_prompts_are_training_prompts_with_their_answers(tmp_path):
    task = make_task("reverse", 500, 64, 7)
    path = str(tmp_path / "prompts.jsonl")
    write_prompts(path, task, 100)
    lines = [json.loads(line) for line in open(path)]
    held_out = {ex["prompt"] for ex in task.eval}
    assert len(lines) == 100 == len({line["prompt"] for line in lines})
    assert not held_out & {line["prompt"] for line in lines}
    assert all(line["answer"] == line["prompt"].rstrip("=")[::-1] for line in lines)
    assert exact_match([line["answer"] for line in lines] + ["zz"], [line["answer"] for line in lines] + ["z"]) == \
        [1.0] * 100 + [0.0]
