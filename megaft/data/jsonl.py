"""JSONL example files: one JSON object per line, in one of the forms of
megaft.data.formats ({"text"}, {"prompt","completion"}, {"messages"}, ShareGPT's
{"conversations"}; chats with tool use included).

Other keys are ignored; blank lines are skipped. Every other deviation is an
error naming the file and the 1-based line number, with its fix.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Iterator, Optional, TypeVar

from megaft.data.errors import DataError
from megaft.data.formats import FORMS, parse_record

T = TypeVar("T")

__all__ = ["FORMS", "parse_example", "scan_json_lines", "scan_jsonl", "read_jsonl", "jsonl_problems",
           "listed_problems", "where"]


def parse_example(line: str) -> dict:
    """Parse one non-blank line into a normalized example (see megaft.data.formats):
    `{"text"}`, `{"prompt", "completion"}` or `{"messages": [{"role", "content", ...}, ...]}`
    (+ `"tools"` for a chat with function specs).

    Raises DataError with "problem; fix: ..." (no file or line: callers add them).
    """
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"invalid JSON ({e}); "
                        "fix: write one complete JSON object per line") from None
    return parse_record(obj)


def scan_json_lines(path: str, parse: Callable[[object], T], what: str = "examples",
                    ) -> Iterator[tuple[int, Optional[T], Optional[str]]]:
    """Yield `(line_number, parse(obj), None)` or `(line_number, None, problem)` for every
    non-blank line of a JSONL file, `parse` raising DataError for a bad object. A missing file
    or a file without lines is one problem with line number 0 (`what` names what it lacks)."""
    if not os.path.isfile(path):
        yield 0, None, "file not found; fix: check the path (relative paths are resolved " \
                       "from the directory the run starts in)"
        return
    found = False
    with open(path, "rb") as f:  # bytes, so a bad byte is reported with its line
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield lineno, None, f"not valid UTF-8 ({e}); fix: re-encode the file as UTF-8"
                continue
            if not line.strip():
                continue
            found = True
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                yield lineno, None, (f"invalid JSON ({e}); "
                                     "fix: write one complete JSON object per line")
                continue
            try:
                yield lineno, parse(obj), None
            except DataError as e:
                yield lineno, None, str(e)
    if not found:
        yield 0, None, f"no {what} (the file is empty or blank); fix: add at least one line"


def scan_jsonl(path: str) -> Iterator[tuple[int, Optional[dict], Optional[str]]]:
    """Yield `(line_number, example, None)` or `(line_number, None, problem)` for
    every non-blank line. A missing file or a file without examples is one
    problem with line number 0."""
    return scan_json_lines(path, parse_record)


def where(path: str, lineno: int) -> str:
    return f"{path}:{lineno}" if lineno else path


def read_jsonl(path: str, max_lines: Optional[int] = None) -> list[dict]:
    """Read the examples of a JSONL file in file order, at most `max_lines` of them.

    Returns dicts holding only "text" or only "prompt" and "completion".
    Raises DataError("FILE:LINE: problem; fix: ...") at the first malformed line.
    """
    examples = []
    for lineno, ex, problem in scan_jsonl(path):
        if problem is not None:
            raise DataError(f"{where(path, lineno)}: {problem}")
        examples.append(ex)
        if max_lines is not None and len(examples) >= max_lines:
            break
    return examples


def jsonl_problems(path: str, limit: int = 20) -> list[str]:
    """Every malformed line of a JSONL file as "FILE:LINE: problem; fix: ...".

    Reports the first `limit` and then one line counting the rest, so a file
    with a systematic error does not drown the other problems.
    """
    return listed_problems(path, scan_jsonl(path), limit)


def listed_problems(path: str, scanned, limit: int = 20) -> list[str]:
    """The problems of a scan (scan_json_lines' triples) as "FILE:LINE: problem; fix: ...",
    the first `limit` and then one line counting the rest."""
    problems = [f"{where(path, n)}: {p}" for n, _, p in scanned if p is not None]
    if len(problems) > limit:
        rest = len(problems) - limit
        problems = problems[:limit] + [f"{path}: {rest} more malformed lines not shown"]
    return problems
