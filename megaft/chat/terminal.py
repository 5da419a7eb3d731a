"""The terminal side of megaft-chat: one answer streamed to stdout (`answer`), and the
interactive loop that reads lines and slash commands (`chat_loop`)."""
from __future__ import annotations

import sys
from typing import Callable, Optional, TextIO

from megaft.chat.session import HELP, Session, TextStream

PROMPT = ">>> "


def answer(engine, session: Session, tokenizer, user: str, *, max_new_tokens: int,
           out: Optional[TextIO] = None) -> Optional[str]:
    """Stream the model's answer to `user` into `out` as its ids come, record the exchange and
    return the answer; None (and a note) when the conversation no longer fits or Ctrl-C stopped it."""
    out = out or sys.stdout
    text = session.prompt_text(user)
    # rendered conversations hold their special tokens (bos included), as training encodes them
    # (megaft.data.chat); a plain line is encoded as a prompt/completion example's prompt is
    ids = tokenizer.encode(text, add_special_tokens=session.template is None).ids
    room = engine.max_len - len(ids)
    if room < 1:
        out.write(f"[the conversation is {len(ids)} tokens, the model reads at most {engine.max_len}; /reset]\n")
        out.flush()
        return None
    stream = TextStream(tokenizer)

    def show(token: int) -> None:
        out.write(stream.push(token))
        out.flush()

    try:
        engine.answer(ids, session.sampling, session.turns, min(max_new_tokens, room), show)
    except KeyboardInterrupt:
        out.write(stream.finish() + " [interrupted]\n")
        out.flush()
        return None
    out.write(stream.finish() + "\n")
    out.flush()
    session.answered(user, stream.text)
    return stream.text


def chat_loop(engine, session: Session, tokenizer, *, max_new_tokens: int, banner: str,
              read: Callable[[str], str] = input, out: Optional[TextIO] = None) -> None:
    """Read lines until /quit, Ctrl-D or Ctrl-C at the prompt; answer each, apply commands."""
    out = out or sys.stdout
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    out.write(f"{banner}\n{HELP}\n")
    while True:
        try:
            line = read(PROMPT).strip()
        except (EOFError, KeyboardInterrupt):
            out.write("\n")
            break
        if not line:
            continue
        reply = session.command(line)
        if reply == "":
            break
        if reply is not None:
            out.write(reply + "\n")
            continue
        answer(engine, session, tokenizer, line, max_new_tokens=max_new_tokens, out=out)
    out.flush()
