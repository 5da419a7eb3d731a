"""Example records: the four forms a line (JSONL) or row (Parquet) may take.

    {"text": "..."}                                   plain text, every token is a target
    {"prompt": "...", "completion": "..."}            only the completion is a target
    {"messages": [{"role": ..., "content": ...}]}     a chat (system/user/assistant/tool turns)
    {"conversations": [{"from": ..., "value": ...}]}  ShareGPT; from human/gpt/system,
                                                      function_call/observation (LLaMA-Factory)

Tool use (megaft.data.tools): assistant turns may carry `tool_calls`, `tool` turns hold a
call's result, and a chat may list its `tools` (function specs); in ShareGPT a
`function_call` turn is the assistant's call (its value the call's JSON) and an
`observation` turn the result, with `tools` a JSON string and an optional `system` string.

Both chat forms are normalized to `{"messages": [...]}` (plus `"tools": [...]` when the
chat has tools) so the rest of megaft.data sees one shape, the one transformers'
apply_chat_template takes. Other keys are ignored, and so is a null (Parquet writes null
for a column a row does not use). Every deviation is a DataError "problem; fix: ..."
without a location: the readers add FILE:LINE.
"""

from __future__ import annotations

from typing import Any

from megaft.data.errors import DataError
from megaft.data.tools import function_call_turn, parse_tool_calls, parse_tools, present, tool_texts

ROLES = ("system", "user", "assistant", "tool")
# ShareGPT's speaker names, LLaMA-Factory's tool tags included; "user"/"assistant"/"tool"
# also occur in files converted by other tools.
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system",
                  "user": "user", "assistant": "assistant",
                  "function_call": "assistant", "observation": "tool", "tool": "tool"}
FORMS = ('{"text": str}', '{"prompt": str, "completion": str}',
         '{"messages": [{"role": str, "content": str}, ...]}',
         '{"conversations": [{"from": str, "value": str}, ...]}')
# The version of what parse_record makes of a record: prepared stores are keyed by their
# source bytes, so a change of the normalization (2: tool use; a `tools` list, ignored
# before, now reaches the template) must change the key too.
RECORD_FORMAT = 2
_FIX_FORM = "fix: write each example as " + ", ".join(FORMS[:-1]) + " or " + FORMS[-1]
_FORM_KEYS = ("text", "prompt", "completion", "messages", "conversations")


def parse_record(obj: Any) -> dict:
    """Validate one decoded record and return it normalized: `{"text"}`,
    `{"prompt", "completion"}` or `{"messages": [...]}` (+ `"tools"`)."""
    if not isinstance(obj, dict):
        raise DataError(f"expected a JSON object, got {type(obj).__name__}; {_FIX_FORM}")
    present_keys = [k for k in _FORM_KEYS if k in obj]
    forms = {"text" if k == "text" else "pc" if k in ("prompt", "completion") else k for k in present_keys}
    if len(forms) > 1:
        if forms == {"text", "pc"}:
            raise DataError("has both 'text' and 'prompt'/'completion'; fix: keep one form per line")
        raise DataError(f"mixes the forms of keys {present_keys}; fix: keep one form per line")
    if not forms:
        keys = ", ".join(map(repr, obj)) or "none"
        raise DataError(f"has neither 'text' nor 'prompt'+'completion' nor 'messages' nor "
                        f"'conversations' (keys: {keys}); {_FIX_FORM}")
    form = forms.pop()
    if form == "messages":
        turns = checked_turns(obj["messages"], "messages", "role", "content")
        return _chat([checked_message(t, f"'messages'[{i}]") for i, t in enumerate(turns)], obj.get("tools"))
    if form == "conversations":
        turns = checked_turns(obj["conversations"], "conversations", "from", "value")
        messages = [_sharegpt_turn(t, f"'conversations'[{i}]") for i, t in enumerate(turns)]
        return _chat(_with_system(messages, obj.get("system")), obj.get("tools"))
    keys = ("text",) if form == "text" else ("prompt", "completion")
    for key in keys:
        if key not in obj:
            other = "prompt" if key == "completion" else "completion"
            raise DataError(f"has '{other}' but no '{key}'; fix: add a \"{key}\" string")
        if not isinstance(obj[key], str):
            raise DataError(f"'{key}' must be a string, got {type(obj[key]).__name__}; "
                            f"fix: quote the value as a JSON string")
    return {k: obj[k] for k in keys}


def _chat(messages: list[dict], tools: Any) -> dict:
    tools = parse_tools(tools)
    return {"messages": messages, "tools": tools} if tools else {"messages": messages}


def checked_turns(turns: Any, key: str, role_key: str, text_key: str) -> list[dict]:
    """The turns of a chat, checked to be a non-empty list of objects, nulls dropped."""
    example = f'[{{"{role_key}": "user", "{text_key}": "..."}}, ...]'
    if not isinstance(turns, list):
        raise DataError(f"'{key}' must be a list of turns, got {type(turns).__name__}; "
                        f"fix: write \"{key}\": {example}")
    if not turns:
        raise DataError(f"'{key}' is an empty conversation; fix: give it at least one turn, "
                        "or drop the line")
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise DataError(f"'{key}'[{i}] must be an object, got {type(turn).__name__}; "
                            f"fix: write each turn as {{\"{role_key}\": ..., \"{text_key}\": ...}}")
    return [present(t) for t in turns]


def _string(turn: dict, key: str, where: str, what: str = "every turn") -> str:
    if key not in turn:
        raise DataError(f"{where} has no '{key}'; fix: add a \"{key}\" string to {what}")
    if not isinstance(turn[key], str):
        raise DataError(f"{where}: '{key}' must be a string, got {type(turn[key]).__name__}; "
                        "fix: quote the value as a JSON string")
    return turn[key]


def checked_message(turn: dict, where: str) -> dict:
    """One turn of the messages form: role and content, an assistant's tool_calls, a tool
    result's tool_call_id and name; other keys dropped."""
    role = _string(turn, "role", where)
    if role not in ROLES:
        raise DataError(f"{where} has unknown role {role!r}; fix: use one of {list(ROLES)}")
    calls = parse_tool_calls(turn.get("tool_calls"), where)
    if calls and role != "assistant":
        raise DataError(f"{where} is a {role} turn with 'tool_calls'; fix: only assistant turns call tools "
                        "(put the call in an assistant turn, the result in a tool turn)")
    out = {"role": role}
    if isinstance(turn.get("content"), list):  # transformers' parts form, images included
        raise DataError(f"{where}: 'content' is a list of parts: megaft-train reads text conversations (content a "
                        "string); conversations with images are read by megaft.data.image_chat for Gemma 3 and "
                        "not fed to megaft-train yet (docs/vision.md); fix: write the content as a string")
    if not calls or "content" in turn:  # an assistant's call may come without text
        what = "a tool turn (the call's result as a string)" if role == "tool" else "every turn"
        out["content"] = _string(turn, "content", where, what)
    if calls:
        out["tool_calls"] = calls
    if role == "tool":
        for key in ("tool_call_id", "name"):  # Mistral's templates read tool_call_id
            if key in turn:
                out[key] = _string(turn, key, where)
    return out


def _sharegpt_turn(turn: dict, where: str) -> dict:
    """One ShareGPT turn: from/value, function_call -> an assistant's tool_calls,
    observation -> a tool result."""
    speaker = _string(turn, "from", where)
    value = _string(turn, "value", where)
    if speaker not in SHAREGPT_ROLES:
        raise DataError(f"{where} has unknown role {speaker!r}; fix: use one of {sorted(SHAREGPT_ROLES)}")
    if speaker == "function_call":
        return function_call_turn(value, where)
    return {"role": SHAREGPT_ROLES[speaker], "content": value}


def _with_system(messages: list[dict], system: Any) -> list[dict]:
    """ShareGPT's optional `system` string (LLaMA-Factory) as the leading system turn."""
    if system is None or system == "":
        return messages
    if not isinstance(system, str):
        raise DataError(f"'system' must be a string, got {type(system).__name__}; fix: quote the system "
                        "prompt as a JSON string")
    if messages[0]["role"] == "system":
        raise DataError("has both a 'system' string and a system turn; fix: keep one of them")
    return [{"role": "system", "content": system}] + messages


def is_chat(ex: dict) -> bool:
    """Whether a normalized example is a conversation (needs a chat template)."""
    return "messages" in ex


def trains_nothing(ex: dict, train_on: str) -> bool:
    """Whether a normalized example is a conversation with nothing to learn: no assistant
    turn (a reply or a tool call) while data.train_on is assistant or last; it is still
    encoded, as input only (megaft.data.untrained counts them)."""
    return is_chat(ex) and train_on != "all" and not any(m["role"] == "assistant" for m in ex["messages"])


def example_texts(ex: dict) -> list[str]:
    """Every string of a normalized example that will be tokenized (tool calls and specs as JSON)."""
    if is_chat(ex):
        return [m["content"] for m in ex["messages"] if "content" in m] + tool_texts(ex["messages"],
                                                                                   ex.get("tools"))
    return [v for v in ex.values() if isinstance(v, str)]
