"""Tool use in conversations: calls, results and the tools list, in the form chat templates read.

What a template is handed is the OpenAI form that transformers' `apply_chat_template(messages,
tools=tools)` documents, so the checkpoint's own template renders it as transformers would:

    {"role": "assistant", "content": str (optional),
     "tool_calls": [{"type": "function", "function": {"name": str, "arguments": {...}}, "id": str (optional)}]}
    {"role": "tool", "content": str, "tool_call_id": str (optional), "name": str (optional)}
    tools = [{"type": "function", "function": {"name": str, "description": ..., "parameters": {...}}}]

Also accepted, and normalized to that form:
- `arguments` as a JSON string (OpenAI's API writes it so): parsed to the object, because
  templates write `arguments | tojson` (a string would come out quoted a second time);
- a call or a tool spec without the {"type": "function", "function": ...} wrapper: wrapped;
- `tools` as a JSON string of the list (LLaMA-Factory, many `datasets` tables): parsed;
- ShareGPT's `function_call` turn, whose value is the JSON of one call or a list of calls
  ({"name", "arguments"}), as LLaMA-Factory writes it: an assistant turn with those tool_calls.
A null value, an empty `tool_calls` list and an empty `tools` list (or a `tools` string that
is empty or "null") count as absent (Parquet fills a column a row does not use with null).
Every deviation is a DataError "problem; fix: ..." without a location: the readers add
FILE:LINE.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from megaft.data.errors import DataError

_CALL = '{"type": "function", "function": {"name": "...", "arguments": {...}}}'
_TOOL = '{"type": "function", "function": {"name": "...", "description": "...", "parameters": {...}}}'


def present(d: dict) -> dict:
    """`d` without its null values: a null key is an absent key."""
    return {k: v for k, v in d.items() if v is not None}


def parse_tool_calls(value: Any, where: str) -> list[dict]:
    """An assistant turn's `tool_calls` as [{"type": "function", "function": {"name",
    "arguments": dict}, ("id")}]; [] when null or empty."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise DataError(f"{where}: 'tool_calls' must be a list of calls, got {type(value).__name__}; "
                        f"fix: write \"tool_calls\": [{_CALL}]")
    return [_call(c, f"{where}.tool_calls[{i}]") for i, c in enumerate(value)]


def _call(call: Any, where: str) -> dict:
    if not isinstance(call, dict):
        raise DataError(f"{where} must be an object, got {type(call).__name__}; fix: write each call as {_CALL}")
    call = present(call)
    if call.get("type", "function") != "function":
        raise DataError(f"{where} has type {call['type']!r}; fix: only function calls are rendered by chat "
                        f"templates: write {_CALL}")
    fn = call.get("function", call)  # a call without the wrapper is its function
    if not isinstance(fn, dict):
        raise DataError(f"{where}: 'function' must be an object, got {type(fn).__name__}; fix: write {_CALL}")
    fn = present(fn)
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise DataError(f"{where} has no function name; fix: write {_CALL}")
    if "arguments" not in fn:
        raise DataError(f"{where} (function {name!r}) has no 'arguments'; fix: add \"arguments\": {{...}} "
                        "(an empty object for a call without arguments)")
    out = {"type": "function", "function": {"name": name, "arguments": _arguments(fn["arguments"], where, name)}}
    if "id" in call:
        if not isinstance(call["id"], str):
            raise DataError(f"{where}: 'id' must be a string, got {type(call['id']).__name__}; "
                            "fix: quote the call id as a JSON string")
        out["id"] = call["id"]
    return out


def _arguments(args: Any, where: str, name: str) -> dict:
    """A call's arguments as an object; a JSON string (OpenAI's form) is decoded."""
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            raise DataError(f"{where} (function {name!r}): 'arguments' is a string but not JSON ({e}); fix: "
                            "write the arguments as a JSON object, or as a string holding one") from None
    if not isinstance(args, dict):
        raise DataError(f"{where} (function {name!r}): 'arguments' must be a JSON object (argument name -> "
                        f"value), got {type(args).__name__}; fix: write \"arguments\": {{\"name\": value, ...}}")
    return args


def parse_tools(value: Any, where: str = "'tools'") -> Optional[list[dict]]:
    """A conversation's `tools` as [{"type": "function", "function": {...}}], or None
    when absent or empty. A JSON string holding the list is decoded."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else None
        except json.JSONDecodeError as e:
            raise DataError(f"{where} is a string but not JSON ({e}); fix: write the list of function specs "
                            f"[{_TOOL}, ...] (as JSON, or as a string holding that JSON)") from None
        if value is None:  # "" or "null"
            return None
    if not isinstance(value, list):
        raise DataError(f"{where} must be a list of function specs, got {type(value).__name__}; "
                        f"fix: write \"tools\": [{_TOOL}, ...]")
    return [_tool(t, f"{where}[{i}]") for i, t in enumerate(value)] or None


def _tool(tool: Any, where: str) -> dict:
    if not isinstance(tool, dict):
        raise DataError(f"{where} must be an object, got {type(tool).__name__}; fix: write each tool as {_TOOL}")
    tool = present(tool)
    if "function" not in tool and "name" in tool and tool.get("type", "function") == "function":
        # a bare function spec (LLaMA-Factory), or the flat {"type": "function", "name", ...} form
        tool = {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}
    if tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise DataError(f"{where} is not a function spec (keys: {', '.join(map(repr, tool)) or 'none'}); "
                        f"fix: write {_TOOL}")
    fn = present(tool["function"])
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise DataError(f"{where} has no function name; fix: write {_TOOL}")
    if "parameters" in fn and not isinstance(fn["parameters"], dict):
        raise DataError(f"{where} (function {fn['name']!r}): 'parameters' must be a JSON schema object, got "
                        f"{type(fn['parameters']).__name__}; fix: write \"parameters\": {{\"type\": \"object\", "
                        "\"properties\": {...}}")
    return {**tool, "function": fn}


def function_call_turn(value: str, where: str) -> dict:
    """ShareGPT's (LLaMA-Factory's) `function_call` turn: its value is the JSON of one call
    {"name", "arguments"} or of a list of them; an assistant turn with those tool_calls."""
    try:
        calls = json.loads(value)
    except json.JSONDecodeError as e:
        raise DataError(f"{where} is a function_call whose value is not JSON ({e}); fix: write the call as "
                        "the JSON string of {\"name\": \"...\", \"arguments\": {...}} (or of a list of them)") from None
    if isinstance(calls, dict):
        calls = [calls]
    if not isinstance(calls, list) or not calls:
        raise DataError(f"{where} is a function_call whose value holds no call; fix: write the JSON string of "
                        "{\"name\": \"...\", \"arguments\": {...}} (or of a non-empty list of them)")
    where = f"{where} (function_call)"
    return {"role": "assistant", "tool_calls": [_call(c, where if len(calls) == 1 else f"{where}[{i}]")
                                                for i, c in enumerate(calls)]}


def tool_texts(messages: list[dict], tools: Optional[list[dict]]) -> list[str]:
    """The tool-use strings of a conversation that a template writes: every call and tool
    spec as JSON (for the checks that look at every character of the data)."""
    out = [json.dumps(c["function"], ensure_ascii=False) for m in messages for c in m.get("tool_calls", ())]
    return out + [json.dumps(t, ensure_ascii=False) for t in tools or ()]
