"""The argument errors that the command-line tools (megaft-chat, megaft-eval) report alike (stdlib only)."""
from __future__ import annotations

import sys
from typing import Callable, Iterable, Optional, TypeVar

T = TypeVar("T")


def checked_arguments(prog: str, parse: Callable[[], T], check: Callable[[T], Iterable[str]]) -> Optional[T]:
    """parse()'s value once check(value) finds no problem; else None (the caller exits with status 2)
    after stderr says why: "PROG: <the ValueError parse raised>", or "PROG: invalid arguments:"
    and each of check's problems on a line of its own."""
    try:
        value = parse()
    except ValueError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return None
    problems = list(check(value))
    if problems:
        print(f"{prog}: invalid arguments:\n" + "\n".join(f"  - {p}" for p in problems), file=sys.stderr)
        return None
    return value
