"""The built-in `math` reward equals TRL's accuracy_reward (math-verify), declines what TRL declines,
and a missing math-verify is named with the fix before any rank starts."""
from __future__ import annotations

import math
import sys

import pytest

from megaft.rl.math_reward import math_reward
from megaft.rl.rewards import load_reward, score

# (completion, gold): equal in value under other forms, wrong, unanchored, a gold that does not parse
CASES = [
    (r"So the probability is \boxed{\frac{1}{3}}.", r"\frac{1}{3}"),
    (r"My answer is \boxed{\frac{1}{2}}", r"\frac{1}{3}"),  # wrong
    (r"Half of it: \boxed{\frac{1}{2}}", "0.5"),
    (r"\boxed{0.5}", r"$\frac{1}{2}$"),
    (r"The answer is $42$.", "$42$"),
    ("She sold 72 clips", "72"),  # plain text: no LaTeX anchor, not extracted (try_extract_without_anchor=False)
    ("Final answer: $72$", "72"),
    (r"\boxed{\{2, 1\}}", r"$\{1, 2\}$"),  # sets compare unordered
    (r"\boxed{[0,1)}", r"$[0, 1)$"),
    (r"\boxed{[0, 1]}", r"$[0, 1)$"),  # another interval
    (r"\boxed{2^{1/2}}", r"$\sqrt{2}$"),
    (r"\boxed{3}", "no number here"),  # the gold does not parse: declined (None)
]
COMPLETIONS, SOLUTIONS = [c for c, _ in CASES], [s for _, s in CASES]
WANT = [1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0, None]


def test_equals_trls_accuracy_reward():
    trl_rewards = pytest.importorskip("trl.rewards")
    ours = math_reward(completions=COMPLETIONS, solution=SOLUTIONS)
    theirs = trl_rewards.accuracy_reward([[{"role": "assistant", "content": c}] for c in COMPLETIONS], SOLUTIONS)
    assert ours == theirs
    assert ours == WANT  # every outcome occurs: the equality is not vacuous


def test_reads_answer_when_there_is_no_solution_and_scores_through_rl_reward():
    assert math_reward(completions=COMPLETIONS, answer=SOLUTIONS) == math_reward(completions=COMPLETIONS,
                                                                                solution=SOLUTIONS)
    assert math_reward(completions=["\\boxed{1}"]) == [None]  # no gold at all
    got = score([("math", load_reward("math"))], ["p"] * 3, COMPLETIONS[:2] + COMPLETIONS[-1:], [[1]] * 3,
                {"solution": SOLUTIONS[:2] + SOLUTIONS[-1:]})
    assert got[:2, 0].tolist() == [1.0, 0.0] and math.isnan(got[2, 0])


def test_without_math_verify_the_error_names_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # import math_verify now raises ImportError
    with pytest.raises(ValueError, match=r"rl.reward=\[math\] needs Hugging Face's math-verify.*pip install "
                                         r"math-verify"):
        load_reward("math")
