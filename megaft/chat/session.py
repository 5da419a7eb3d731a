"""A conversation's state and the slash commands that change it, and the incremental
decoder that turns streamed ids into printable text. No terminal and no model here: the
terminal loop (megaft.chat.terminal) reads lines and prints, an engine generates."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

from megaft.inference.generate import Sampling

HELP = ("commands: /reset (forget the conversation), /system TEXT (set the system message and reset), "
        "/temp X (sampling temperature, 0 = greedy), /quit (or Ctrl-D)")


@dataclass
class Session:
    """The messages so far, the system message and the sampling settings of one chat."""

    template: Optional[object]  # ChatTemplate; None: each line is continued as plain text, without history
    sampling: Sampling = Sampling()
    system: Optional[str] = None
    messages: list[dict] = field(default_factory=list)
    turns: int = 0  # answers given: with sampling.seed, seeds each answer's draws

    def command(self, line: str) -> Optional[str]:
        """Apply a slash command; the reply to print, "" to quit, None when `line` is no command."""
        if not line.startswith("/"):
            return None
        name, _, arg = line[1:].partition(" ")
        arg = arg.strip()
        if name in ("quit", "exit"):
            return ""
        if name == "reset":
            self.messages.clear()
            return "[conversation reset]"
        if name == "system":
            self.system = arg or None
            self.messages.clear()
            return f"[system message {'set' if arg else 'cleared'}; conversation reset]"
        if name == "temp":
            try:
                temp = float(arg)
                if temp < 0:
                    raise ValueError
            except ValueError:
                return f"[/temp needs a number >= 0, e.g. /temp 0.7 (0 = greedy); got {arg!r}]"
            self.sampling = replace(self.sampling, temperature=temp)
            return f"[temperature {temp:g}{' (greedy)' if temp == 0 else ''}]"
        return f"[unknown command /{name}; {HELP}]"

    def prompt_text(self, user: str) -> str:
        """The text the model continues for the user's next line (the history included)."""
        if self.template is None:
            return user
        head = [{"role": "system", "content": self.system}] if self.system else []
        return self.template.render(head + self.messages + [{"role": "user", "content": user}],
                                    add_generation_prompt=True)

    def answered(self, user: str, answer: str) -> None:
        """Record a finished exchange (kept only with a template: the history is rendered by it)."""
        self.turns += 1
        if self.template is not None:
            self.messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]


class TextStream:
    """Streamed ids -> the new printable text: decodes the answer so far and returns what was
    not printed yet, holding back a trailing U+FFFD (the first bytes of a character whose
    other bytes come with the next ids), so merged and multi-byte tokens print right."""

    def __init__(self, tokenizer):
        self.tok, self.ids, self.shown = tokenizer, [], ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        return self._advance(self.tok.decode(self.ids).rstrip("\ufffd"))

    def finish(self) -> str:
        """The rest of the text (the held-back characters included) at the end of the answer."""
        return self._advance(self.text)

    @property
    def text(self) -> str:
        return self.tok.decode(self.ids)

    def _advance(self, text: str) -> str:
        # what follows the printed characters (a decoder that rewrote printed text is not undone)
        new = text[len(self.shown):]
        if new:
            self.shown = text
        return new
