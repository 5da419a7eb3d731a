"""Conversations -> token ids plus a loss mask, through the model's chat template.

Tokens: the rendered conversation encoded with `add_special_tokens=False` (the
template writes every special token itself), exactly as transformers'
`apply_chat_template(tokenize=True)` does.

Which characters are the assistant's (data.train_on=assistant):
- a template with `{% generation %}` markers: the marked spans, as transformers'
  `return_assistant_tokens_mask=True` records them.
- a template without markers, the incremental rule: for the assistant message i,
  P = render(messages[:i], add_generation_prompt=True) and
  T = render(messages[:i+1]); its span is T[len(P):] with trailing whitespace
  removed. That is the content and the end-of-turn token the template appends
  (`<|im_end|>`, `<|eot_id|>`), without the generation prompt (the header the
  model is given) and without the newline some templates put between turns. The
  rule needs every P and T to be a prefix of the full rendering; a template that
  rewrites earlier turns (e.g. drops old reasoning) breaks it and is reported.
A token is an assistant token when its characters overlap a span (transformers'
rule, so a token that straddles a span edge counts). train_on=last keeps only
the last span; train_on=all makes every token after the first a target.

Tool use (megaft.data.tools): a conversation's `tools` reach the template as transformers'
`tools=` argument. An assistant turn that calls a tool is an assistant turn like any
other: the call as the template writes it (e.g. Qwen2.5's `<tool_call>...</tool_call>`,
Llama 3.1's `{"name": ..., "parameters": ...}`) and its end-of-turn token are trained; a
`tool` turn (the result) is input, never a target. A conversation with tool calls or tools
and a template that never reads `tool_calls` / `tools` (the built-in llama3 and chatml) is
refused: the template would drop them and train empty answers.
"""

from __future__ import annotations

from typing import Optional

import jinja2
import numpy as np
from tokenizers import Tokenizer

from megaft.config.data import TrainOn
from megaft.data.encode import Encoded
from megaft.data.errors import DataError
from megaft.data.formats import trains_nothing
from megaft.data.templates import ChatTemplate

TRAIN_ON = tuple(t.value for t in TrainOn)


class ChatEncoder:
    """Encodes normalized conversations ([{"role", "content", ...}, ...] and their tools) for
    training. `untrained` counts the conversations encoded with no assistant turn under
    train_on=assistant|last (all input, no target)."""

    def __init__(self, tok: Tokenizer, template: ChatTemplate, train_on: str = "assistant"):
        if train_on not in TRAIN_ON:
            raise DataError(f"data.train_on={train_on!r} is unknown; fix: use one of {list(TRAIN_ON)}")
        self.tok, self.template, self.train_on = tok, template, train_on
        self.untrained = 0

    def render(self, messages: list[dict], tools: Optional[list[dict]] = None
               ) -> tuple[str, list[tuple[int, int]]]:
        """(text, assistant character spans) of a conversation (no spans for train_on=all,
        which needs none); raises DataError when the template fails (raise_exception, an
        undefined variable, ...) or cannot write the conversation's tool use."""
        self._check_tool_use(messages, tools)
        try:
            if self.train_on == "all":
                return self.template.render(messages, tools=tools), []
            if self.template.has_generation_markers:
                return self.template.render_with_spans(messages, tools=tools)
            return _incremental_spans(self.template, messages, tools)
        except jinja2.exceptions.TemplateError as e:
            raise DataError(f"the chat template {self.template.name} failed to render this conversation "
                            f"({type(e).__name__}: {e}); fix: correct the conversation (roles, order) or "
                            "set data.chat_template to a template that accepts it") from None

    def _check_tool_use(self, messages: list[dict], tools: Optional[list[dict]]) -> None:
        calls = any("tool_calls" in m for m in messages)
        for used, variable, what in ((calls, "tool_calls", "tool calls"), (bool(tools), "tools", "tools")):
            if used and not self.template.reads(variable):
                raise DataError(f"the conversation has {what}, which the chat template {self.template.name} never "
                                f"reads (no '{variable}' in it), so it would drop them; fix: use the checkpoint's "
                                "own template (data.chat_template=auto; the built-in llama3 and chatml do not "
                                "render tools) or a .jinja file that renders them")

    def encode(self, messages: list[dict], tools: Optional[list[dict]] = None) -> Encoded:
        """Token ids and targets of one conversation (with its tools, if any). `prompt_len`
        is the index of the first target (what PackedStream must keep in view for the
        targets to count)."""
        text, spans = self.render(messages, tools)
        return self.encode_rendered(messages, text, spans)

    def encode_rendered(self, messages: list[dict], text: str, spans: list[tuple[int, int]]) -> Encoded:
        """`encode` of a conversation already rendered to `text` with its assistant `spans`
        (megaft.data.images renders, then writes each image's tokens into the text)."""
        self.untrained += trains_nothing({"messages": messages}, self.train_on)
        enc = self.tok.encode(text, add_special_tokens=False)
        ids = enc.ids
        if self.train_on == "all":
            target = [i > 0 for i in range(len(ids))]
        else:
            target = assistant_mask(enc.offsets, spans[-1:] if self.train_on == "last" else spans)
        if target:
            target[0] = False  # nothing precedes the first token (see Encoded)
        first = next((i for i, t in enumerate(target) if t), len(ids))
        return Encoded(ids, target, 0 if self.train_on == "all" else first)


def assistant_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[bool]:
    """Tokens whose character offsets overlap one of the sorted spans: transformers'
    single pass of apply_chat_template(return_assistant_tokens_mask=True), vectorized.
    A token is marked when the first span ending after its start begins before its end."""
    if not spans or not offsets:
        return [False] * len(offsets)
    tokens = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    bounds = np.asarray(spans, dtype=np.int64).reshape(-1, 2)
    first = np.searchsorted(bounds[:, 1], tokens[:, 0], side="right")  # first span with end > start
    inside = first < len(bounds)
    mask = np.zeros(len(tokens), dtype=bool)
    mask[inside] = tokens[inside, 1] > bounds[first[inside], 0]
    return mask.tolist()


def _incremental_spans(template: ChatTemplate, messages: list[dict], tools: Optional[list[dict]] = None
                       ) -> tuple[str, list[tuple[int, int]]]:
    """The rule for templates without {% generation %} markers (module docstring)."""
    full = template.render(messages, tools=tools)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = template.render(messages[:i], add_generation_prompt=True, tools=tools)
        through = template.render(messages[:i + 1], tools=tools)
        if not (through.startswith(prompt) and full.startswith(through)):
            raise DataError(f"the chat template {template.name} does not render this conversation "
                            f"incrementally (turn {i} changes the text before it), so its assistant "
                            "tokens cannot be found; fix: add {% generation %} markers around the "
                            "assistant output in the template, or set data.train_on=all")
        end = len(through.rstrip())
        if end > len(prompt):
            spans.append((len(prompt), end))
    return full, spans


def check_template_tokens(tok: Tokenizer, template: ChatTemplate, required: tuple[str, ...]) -> Optional[str]:
    """A problem when the template writes special tokens the vocabulary lacks (they would be
    split into pieces of text, and the model would never see its turn markers)."""
    missing = [t for t in required if tok.token_to_id(t) is None]
    if not missing:
        return None
    return (f"the chat template {template.name} writes {missing}, which the tokenizer does not "
            "have as tokens; fix: pick the template of the model family (data.chat_template="
            "llama3 or chatml) or a checkpoint with its own chat_template")
