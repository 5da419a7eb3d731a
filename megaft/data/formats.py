"""Example records: the four forms a line (JSONL) or row (Parquet) may take.

    {"text": "..."}                                   plain text, every token is a target
    {"prompt": "...", "completion": "..."}            only the completion is a target
    {"messages": [{"role": ..., "content": ...}]}     a chat (system/user/assistant turns)
    {"conversations": [{"from": ..., "value": ...}]}  ShareGPT; from human/gpt/system

Both chat forms are normalized to `{"messages": [{"role", "content"}, ...]}` so the
rest of megaft.data sees one shape. Other keys are ignored. Every deviation is a
DataError "problem; fix: ..." without a location: the readers add FILE:LINE.
"""

from __future__ import annotations

from typing import Any

from megaft.data.errors import DataError

ROLES = ("system", "user", "assistant")
# ShareGPT's speaker names; "user"/"assistant" also occur in files converted by other tools.
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system",
                  "user": "user", "assistant": "assistant"}
FORMS = ('{"text": str}', '{"prompt": str, "completion": str}',
         '{"messages": [{"role": str, "content": str}, ...]}',
         '{"conversations": [{"from": str, "value": str}, ...]}')
_FIX_FORM = "fix: write each example as " + ", ".join(FORMS[:-1]) + " or " + FORMS[-1]
_FORM_KEYS = ("text", "prompt", "completion", "messages", "conversations")


def parse_record(obj: Any) -> dict:
    """Validate one decoded record and return it normalized: `{"text"}`,
    `{"prompt", "completion"}` or `{"messages": [{"role", "content"}, ...]}`."""
    if not isinstance(obj, dict):
        raise DataError(f"expected a JSON object, got {type(obj).__name__}; {_FIX_FORM}")
    present = [k for k in _FORM_KEYS if k in obj]
    forms = {"text" if k == "text" else "pc" if k in ("prompt", "completion") else k for k in present}
    if len(forms) > 1:
        if forms == {"text", "pc"}:
            raise DataError("has both 'text' and 'prompt'/'completion'; fix: keep one form per line")
        raise DataError(f"mixes the forms of keys {present}; fix: keep one form per line")
    if not forms:
        keys = ", ".join(map(repr, obj)) or "none"
        raise DataError(f"has neither 'text' nor 'prompt'+'completion' nor 'messages' nor "
                        f"'conversations' (keys: {keys}); {_FIX_FORM}")
    form = forms.pop()
    if form == "messages":
        return {"messages": _messages(obj["messages"], "messages", "role", "content", None)}
    if form == "conversations":
        return {"messages": _messages(obj["conversations"], "conversations", "from", "value",
                                      SHAREGPT_ROLES)}
    keys = ("text",) if form == "text" else ("prompt", "completion")
    for key in keys:
        if key not in obj:
            other = "prompt" if key == "completion" else "completion"
            raise DataError(f"has '{other}' but no '{key}'; fix: add a \"{key}\" string")
        if not isinstance(obj[key], str):
            raise DataError(f"'{key}' must be a string, got {type(obj[key]).__name__}; "
                            f"fix: quote the value as a JSON string")
    return {k: obj[k] for k in keys}


def _messages(turns: Any, key: str, role_key: str, text_key: str,
              role_map: dict[str, str] | None) -> list[dict]:
    """The turns of a chat as [{"role", "content"}], checked one by one."""
    example = f'[{{"{role_key}": "user", "{text_key}": "..."}}, ...]'
    if not isinstance(turns, list):
        raise DataError(f"'{key}' must be a list of turns, got {type(turns).__name__}; "
                        f"fix: write \"{key}\": {example}")
    if not turns:
        raise DataError(f"'{key}' is an empty conversation; fix: give it at least one turn, "
                        "or drop the line")
    allowed = sorted(role_map) if role_map else list(ROLES)
    out = []
    for i, turn in enumerate(turns):
        where = f"'{key}'[{i}]"
        if not isinstance(turn, dict):
            raise DataError(f"{where} must be an object, got {type(turn).__name__}; "
                            f"fix: write each turn as {{\"{role_key}\": ..., \"{text_key}\": ...}}")
        for k in (role_key, text_key):
            if k not in turn:
                raise DataError(f"{where} has no '{k}'; fix: add a \"{k}\" string to every turn")
            if not isinstance(turn[k], str):
                raise DataError(f"{where}: '{k}' must be a string, got {type(turn[k]).__name__}; "
                                "fix: quote the value as a JSON string")
        role = turn[role_key]
        if role_map is not None:
            role = role_map.get(role, "")
        if role not in ROLES:
            raise DataError(f"{where} has unknown role {turn[role_key]!r}; fix: use one of {allowed}")
        out.append({"role": role, "content": turn[text_key]})
    return out


def is_chat(ex: dict) -> bool:
    """Whether a normalized example is a conversation (needs a chat template)."""
    return "messages" in ex


def example_texts(ex: dict) -> list[str]:
    """Every string of a normalized example that will be tokenized."""
    if is_chat(ex):
        return [m["content"] for m in ex["messages"]]
    return [v for v in ex.values() if isinstance(v, str)]
