"""Generated tasks: small prompt/completion problems with an exact answer.

They let a run check end to end that the model learns (exact-match accuracy on
held-out prompts) without any data file, and are sized so that a ~1M-parameter,
2-4 layer transformer learns them within a few hundred optimizer steps.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass, field
from typing import Callable, Optional

from tokenizers import Tokenizer

from megaft.data.errors import DataError
from megaft.data.tokenizer import char_tokenizer


@dataclass(frozen=True)
class TaskSpec:
    """A task family: how to draw a prompt and what its one correct answer is."""

    name: str
    alphabet: str  # every character prompts and completions use
    max_new_tokens: int  # longest completion in tokens (chars), EOS excluded: the decoding budget
    num_prompts: int  # distinct prompts the sampler can produce (bounds task_eval_size)
    sample: Callable[[random.Random], str]  # draws one prompt
    answer: Callable[[str], str]  # the completion of a prompt

    @property
    def max_eval_size(self) -> int:
        """At most half the prompts are held out, so training keeps most problems
        and drawing training prompts outside the eval set stays fast."""
        return self.num_prompts // 2


def _sample_addition(rng: random.Random) -> str:
    # Each operand is below 10 or below 100 with equal odds (digit-count balanced):
    # the easy single-digit sums give a small model a foothold. With uniform
    # 2-digit operands no single input digit says anything about an output digit
    # (mod 10), and a 0.6M-parameter model sat on a loss plateau for ~450 steps.
    def operand():
        return rng.randrange(10 ** rng.randint(1, 2))

    return f"{operand():02d}+{operand():02d}="


def _answer_addition(prompt: str) -> str:
    a, b = prompt.rstrip("=").split("+")
    return f"{int(a) + int(b):03d}"[::-1]


def _sample_reverse(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 6))) + "="


def _answer_reverse(prompt: str) -> str:
    return prompt.rstrip("=")[::-1]


TASKS: dict[str, TaskSpec] = {
    # "07+45=" -> "250": operands up to two digits, zero-padded so every prompt has the
    # same length (batched greedy decoding needs no padding); the 3-digit sum is
    # written least significant digit first, so each output digit needs only the
    # operand digits of its column and the carry of the column just written,
    # which a small causal model learns far faster than most-significant-first.
    "addition": TaskSpec("addition", "0123456789+=", 3, 100 * 100,
                         _sample_addition, _answer_addition),
    # "abcd=" -> "dcba": lowercase strings of length 3-6; prompts vary in length.
    "reverse": TaskSpec("reverse", string.ascii_lowercase + "=", 6,
                        sum(26 ** n for n in range(3, 7)), _sample_reverse, _answer_reverse),
}


def exact_match(predictions: list[str], examples: list[dict]) -> float:
    """Fraction of predictions equal to their example's completion."""
    if len(predictions) != len(examples):
        raise ValueError(f"{len(predictions)} predictions for {len(examples)} examples")
    if not examples:
        return 0.0
    return sum(p == ex["completion"] for p, ex in zip(predictions, examples)) / len(examples)


@dataclass
class Task:
    """A generated data set: train and held-out eval prompt/completion dicts."""

    name: str
    alphabet: str
    max_new_tokens: int
    train: list[dict] = field(repr=False)
    eval: list[dict] = field(repr=False)

    def score(self, predictions: list[str], eval_examples: Optional[list[dict]] = None) -> float:
        """Exact-match accuracy of decoded predictions (text generated after the
        prompt, cut at EOS, special tokens dropped) against `eval_examples`
        (default: this task's eval set)."""
        return exact_match(predictions, self.eval if eval_examples is None else eval_examples)


def make_task(name: str, train_size: int, eval_size: int, seed: int) -> Task:
    """Generate a task: `eval_size` distinct prompts held out, then `train_size`
    prompts (repeats allowed) drawn from the rest, so no eval prompt is trained on.
    Deterministic in (name, train_size, eval_size, seed)."""
    if name not in TASKS:
        raise DataError(f"unknown task {name!r}; fix: use one of {sorted(TASKS)}")
    spec = TASKS[name]
    if not 0 <= eval_size <= spec.max_eval_size:
        raise DataError(f"task {name!r} holds out at most {spec.max_eval_size} of its "
                        f"{spec.num_prompts} prompts; fix: set data.task_eval_size in "
                        f"[0, {spec.max_eval_size}]")
    rng = random.Random(seed)
    held_out: dict[str, None] = {}  # a dict keeps draw order, unlike a set
    while len(held_out) < eval_size:
        held_out.setdefault(spec.sample(rng))
    train = []
    while len(train) < train_size:
        prompt = spec.sample(rng)
        if prompt not in held_out:
            train.append(prompt)

    def examples(prompts):
        return [{"prompt": p, "completion": spec.answer(p)} for p in prompts]

    return Task(name, spec.alphabet, spec.max_new_tokens, examples(train), examples(held_out))


def task_tokenizer(task) -> Tokenizer:
    """The character tokenizer of a Task (or TaskSpec): `char_tokenizer(task.alphabet)`."""
    return char_tokenizer(task.alphabet)
