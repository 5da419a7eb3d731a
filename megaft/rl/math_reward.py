"""The built-in `math` reward: TRL's `accuracy_reward` (trl/rewards/accuracy_rewards.py), the
verifiable reward of math GRPO runs, on megaft's text completions.

The sample's gold answer (its `solution` field, TRL's name, else `answer`) is parsed by
Hugging Face's math-verify; a gold that does not parse scores None (the sample is skipped, as
TRL does). The completion is parsed as LaTeX only (a \\boxed{} answer first, units normalized, no
match without an anchor, the first match), and the reward is 1.0 when math-verify finds the two
equal (1/2 = 0.5 = \\frac{1}{2}, sets, intervals, ...), else 0.0. Same parse settings and timeouts
as TRL's, so the two give the same rewards (tests/rl/test_math_reward.py).
"""
from __future__ import annotations

import threading
from typing import Optional

INSTALL = "pip install math-verify==0.9.0 (it is in requirements.txt)"


def _math_verify():
    try:
        from latex2sympy2_extended import NormalizationConfig
        from math_verify import LatexExtractionConfig, parse, verify
    except ImportError as exc:
        raise ValueError(f"rl.reward=[math] needs Hugging Face's math-verify ({exc}); fix: {INSTALL}") from None
    return NormalizationConfig, LatexExtractionConfig, parse, verify


def check_available() -> None:
    """ValueError with the fix where math-verify is not installed (validation, before any rank starts)."""
    _math_verify()


def math_reward(completions: list[str], solution: Optional[list] = None, answer: Optional[list] = None,
                **kwargs) -> list[Optional[float]]:
    """1.0 where the completion's LaTeX answer equals the gold by math-verify, 0.0 where not, None where
    the sample has no gold or its gold does not parse."""
    NormalizationConfig, LatexExtractionConfig, parse, verify = _math_verify()
    golds = solution if solution is not None else answer
    if golds is None:
        golds = [None] * len(completions)
    # math-verify times out through signal.alarm, which works in the main thread only (as TRL)
    main = threading.current_thread() is threading.main_thread()
    parsing_timeout, verify_timeout = (10, 5) if main else (None, None)
    out: list[Optional[float]] = []
    for text, gold in zip(completions, golds):
        gold_parsed = [] if gold is None else parse(str(gold), parsing_timeout=parsing_timeout)
        if not gold_parsed:
            out.append(None)
            continue
        extraction = [LatexExtractionConfig(normalization_config=NormalizationConfig(units=True),
                                            boxed_match_priority=0, try_extract_without_anchor=False)]
        parsed = parse(text, extraction_config=extraction, extraction_mode="first_match",
                       parsing_timeout=parsing_timeout)
        out.append(float(verify(gold_parsed, parsed, timeout_seconds=verify_timeout)))
    return out
