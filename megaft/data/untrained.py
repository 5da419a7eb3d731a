"""Conversations that train nothing: counted, reported once, refused when a whole source is made of them.

Under data.train_on=assistant (or last) only assistant turns are targets, so a conversation
without one (a prompt with no reply, a chat cut before the answer) is encoded as input only
and teaches nothing. The readers feed every record to an `UntrainedConversations` tally as
they go (`add(file, line, example)`), then:

- `warning()` is the one line to log once (where the data is prepared, not on every rank):
  how many conversations train nothing, where the first are, and the fix;
- `problems(path, files)` is an error for a source whose every record is such a
  conversation (it would contribute nothing: almost always the wrong file or train_on);
- `counts()` is what a manifest or a run summary carries.
"""

from __future__ import annotations

from collections import Counter
from typing import Optional

from megaft.data.formats import is_chat, trains_nothing

SHOWN = 3  # locations quoted in a message


class UntrainedConversations:
    """Per-file tallies of the records read and of the conversations with nothing to learn."""

    def __init__(self, train_on: str):
        self.train_on = str(train_on)
        self.records: Counter = Counter()  # file -> records read
        self.conversations: Counter = Counter()  # file -> conversations among them
        self.untrained: Counter = Counter()  # file -> conversations that train nothing
        self.first: list[tuple[str, int]] = []  # (file, line) of the first SHOWN of them

    def add(self, file: str, line: int, ex: dict) -> None:
        """Count one normalized record of `file` (line: 1-based line or row)."""
        self.records[file] += 1
        if is_chat(ex):
            self.conversations[file] += 1
            if trains_nothing(ex, self.train_on):
                self.untrained[file] += 1
                if len(self.first) < SHOWN:
                    self.first.append((file, line))

    def merge(self, other: "UntrainedConversations", file: Optional[str] = None) -> None:
        """Add another tally's counts (e.g. a worker's, of one chunk), keeping the first
        locations; with `file`, the other tally's records all belong to that file (a worker
        that counts a chunk need not know which file it came from)."""
        for mine, theirs in ((self.records, other.records), (self.conversations, other.conversations),
                             (self.untrained, other.untrained)):
            for key, n in theirs.items():
                mine[key if file is None else file] += n
        self.first = (self.first + [(f if file is None else file, line) for f, line in other.first])[:SHOWN]

    @property
    def total(self) -> int:
        """Conversations that train nothing, over every file."""
        return sum(self.untrained.values())

    def counts(self) -> dict:
        """{"conversations": n, "conversations_without_assistant": k} for a manifest or summary."""
        return {"conversations": sum(self.conversations.values()), "conversations_without_assistant": self.total}

    def warning(self) -> Optional[str]:
        """The line to log once, or None when every conversation trains something."""
        if not self.total:
            return None
        n = sum(self.conversations.values())
        return (f"{self.total} of {n} conversations have no assistant turn, so data.train_on={self.train_on} "
                f"trains nothing on them (they are kept, as input only): "
                f"{', '.join(f'{f}:{line}' for f, line in self.first)}"
                f"{', ...' if self.total > len(self.first) else ''}; fix: add the assistant's reply (role "
                "assistant, or ShareGPT from gpt/function_call) or drop them, or set data.train_on=all")

    def problems(self, path: str, files: list[str]) -> list[str]:
        """The error of a source (`path`, its `files`) every record of which is a conversation
        that trains nothing; [] otherwise."""
        records = sum(self.records[f] for f in files)
        untrained = sum(self.untrained[f] for f in files)
        if records == 0 or untrained < records:
            return []
        named = [f for f in files if self.untrained[f]]
        more = ", ..." if len(named) > SHOWN else ""
        where = path if named == [path] else f"{path} ({', '.join(named[:SHOWN])}{more})"
        return [f"{where}: none of its {untrained} conversations has an assistant turn, so data.train_on="
                f"{self.train_on} trains nothing on it; fix: add the assistant's replies (role assistant, or "
                "ShareGPT from gpt/function_call), set data.train_on=all to train on every token, or remove "
                "the source"]
