"""Preference pairs: TRL's preference records -> the token ids TRL's DPOTrainer makes of them.

One JSON object per line, in the forms of TRL's preference datasets:

    {"prompt": str, "chosen": str, "rejected": str}                          standard
    {"chosen": str, "rejected": str}                                         standard, implicit prompt
    {"prompt": [turns], "chosen": [assistant turns], "rejected": [...]}      conversational
    {"chosen": [turns], "rejected": [turns]}                                 conversational, implicit prompt

Turns are megaft.data.formats' messages ({"role", "content"}, an assistant's `tool_calls`,
tool results); a conversational record may list its `tools`, which reach the template as
TRL passes them. Other keys are ignored, and a null counts as absent.

Implicit prompt (TRL's `extract_prompt`): the prompt is the longest common prefix of chosen
and rejected, in turns for conversations and in characters for text; for text, a space
just before the first difference goes to the completions. When neither differs within the
shorter one, TRL's loop leaves the last shared element to the completions; so does this.

Token ids (trl 1.16, `DPOTrainer._prepare_dataset`; no `tokenize_row` any more):
- standard: `eos_token` is appended to chosen and rejected unless they end with it; then
  P = tok(prompt), C = tok(prompt + chosen), R = tok(prompt + rejected), each with the
  tokenizer's own special tokens (its post-processor's BOS, as `tokenizer(text)` adds it).
- conversational: P = the template's rendering of the prompt with the generation prompt,
  C = of prompt + chosen, R = of prompt + rejected, each encoded without added special
  tokens (the template writes them; transformers' `apply_chat_template(tokenize=True)`).
- both: the prompt is the first n = min(common prefix of P and C, of P and R) tokens of P,
  `chosen_ids = C[n:]`, `rejected_ids = R[n:]`. n < len(P) when the template writes the
  prompt alone differently, or tokens merge across the boundary; TRL then warns once,
  and `read_pairs` logs how many pairs of the file it concerns.
`render_pair` gives the texts of TRL's `maybe_apply_chat_template` (what a reader of the
data sees: the prompt cut at the common prefix of the renderings); the ids do not come
from those texts, exactly as in TRL.

Length (`truncate`): TRL 1.16 has one `max_length` (DPOConfig, default 1024) with
truncation_mode=keep_start: a pair whose prompt alone has max_length tokens or more is
dropped from the dataset, and the collator keeps the first max_length tokens of prompt +
completion. There is no max_prompt_length / max_completion_length any more.

Where megaft is stricter than TRL, which would train on these silently (each is a
DataError "FILE:LINE: problem; fix: ..."): an implicit prompt that is empty; chosen equal
to rejected; an empty completion; a conversational completion holding anything but
assistant turns; a conversational prompt not ending with a user or tool turn; a string
prompt beside conversational completions (TRL's DPOTrainer and maybe_extract_prompt
disagree on it). TRL decides the form from a dataset's first row; megaft decides per record,
so a file mixing forms gets what each record would get in a dataset of its own form.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Union

import jinja2
from tokenizers import Tokenizer

from megaft.data.errors import DataError

# The turn checks of the SFT chat forms, reused so both kinds of data read turns alike.
from megaft.data.formats import checked_message, checked_turns
from megaft.data.jsonl import listed_problems, scan_json_lines, where
from megaft.data.sources import source_problems
from megaft.data.templates import ChatTemplate
from megaft.data.tools import parse_tools, present

__all__ = ["PREFERENCE_FORMS", "Pair", "parse_pair", "extract_prompt", "render_pair", "encode_pair",
           "encode_record", "read_pairs", "pair_problems", "pair_source_problems", "truncate"]

log = logging.getLogger(__name__)

PREFERENCE_FORMS = ('{"prompt": str, "chosen": str, "rejected": str}',
                    '{"prompt": [turns], "chosen": [assistant turns], "rejected": [assistant turns]}',
                    '{"chosen": [turns], "rejected": [turns]} (the prompt: the turns both start with)')
_FIX_FORM = "fix: write each pair as " + ", ".join(PREFERENCE_FORMS[:-1]) + " or " + PREFERENCE_FORMS[-1]
_PROMPT_ENDS = ("user", "tool")  # the turns a model answers: TRL renders the prompt with the generation prompt

Conversation = list[dict]
Side = Union[str, Conversation]


@dataclass(frozen=True)
class Pair:
    """One tokenized preference pair: the model reads prompt_ids + chosen_ids and
    prompt_ids + rejected_ids, and only the completion tokens are scored."""

    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]


# --- records ---------------------------------------------------------------------------------


def parse_pair(obj: Any) -> dict:
    """Validate one decoded record and return it normalized: `{"prompt", "chosen", "rejected"}`,
    all strings or all lists of turns (+ `"tools"`), the implicit prompt extracted.

    Raises DataError "problem; fix: ..." without a location (the readers add FILE:LINE)."""
    if not isinstance(obj, dict):
        raise DataError(f"expected a JSON object, got {type(obj).__name__}; {_FIX_FORM}")
    obj = present(obj)
    for key in ("chosen", "rejected"):
        if key not in obj:
            keys = ", ".join(map(repr, obj)) or "none"
            raise DataError(f"has no '{key}' (keys: {keys}); {_FIX_FORM}")
    kinds = {key: _kind(obj[key], key) for key in ("prompt", "chosen", "rejected") if key in obj}
    if kinds["chosen"] != kinds["rejected"]:
        raise DataError(f"'chosen' is a {kinds['chosen']} but 'rejected' a {kinds['rejected']}; fix: write both "
                        "as strings or both as lists of turns")
    if kinds["chosen"] == "string":
        return _standard(obj)
    if kinds.get("prompt") == "string":
        raise DataError("'prompt' is a string but 'chosen' and 'rejected' are conversations; fix: write the prompt "
                        "as a list of turns, or drop it when chosen and rejected hold the whole conversation "
                        "(the prompt is then the turns they start with)")
    return _conversational(obj)


def _kind(value: Any, key: str) -> str:
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "conversation"
    raise DataError(f"'{key}' must be a string or a list of turns, got {type(value).__name__}; {_FIX_FORM}")


def _standard(obj: dict) -> dict:
    if "prompt" in obj:
        rec = {k: obj[k] for k in ("prompt", "chosen", "rejected")}
    else:
        rec = _implicit(obj["chosen"], obj["rejected"], "characters")
    for key in ("chosen", "rejected"):
        if not rec[key]:
            raise DataError(f"'{key}' is empty; fix: give each pair a non-empty chosen and rejected answer, "
                            "or drop the line")
    _check_differ(rec)
    return rec


def _conversational(obj: dict) -> dict:
    sides = {key: [checked_message(t, f"'{key}'[{i}]")
                   for i, t in enumerate(checked_turns(obj[key], key, "role", "content"))]
             for key in ("prompt", "chosen", "rejected") if key in obj}
    offset = 0
    if "prompt" in sides:
        rec = sides
    else:
        rec = _implicit(sides["chosen"], sides["rejected"], "turns")
        offset = len(rec["prompt"])
    last = rec["prompt"][-1]["role"]
    if last not in _PROMPT_ENDS:
        raise DataError(f"the prompt's last turn is {last!r}, not 'user' or 'tool', so the pair answers nothing "
                        "(TRL renders the prompt with the assistant's header after it); fix: end the prompt with "
                        "a user (or tool) turn, or drop the line")
    for key in ("chosen", "rejected"):
        _check_completion(rec[key], key, offset)
    _check_differ(rec)
    tools = parse_tools(obj.get("tools"))
    return {**rec, "tools": tools} if tools else rec


def _implicit(chosen: Side, rejected: Side, unit: str) -> dict:
    """TRL's extract_prompt, refusing what leaves no prompt."""
    _check_differ({"chosen": chosen, "rejected": rejected})
    prompt, chosen_rest, rejected_rest = extract_prompt(chosen, rejected)
    if not prompt:
        raise DataError(f"has no 'prompt', and 'chosen' and 'rejected' share no leading {unit}, so the prompt "
                        "cannot be found; fix: add a \"prompt\", or start chosen and rejected with the same "
                        "prompt" + (" turns" if unit == "turns" else " text"))
    return {"prompt": prompt, "chosen": chosen_rest, "rejected": rejected_rest}


def extract_prompt(chosen: Side, rejected: Side) -> tuple[Side, Side, Side]:
    """(prompt, chosen, rejected) split as TRL's `extract_prompt`: the longest common prefix,
    a space before the first difference moved to the completions; when one is a prefix of the
    other, TRL's loop ends on the last shared element and leaves it to the completions."""
    n = min(len(chosen), len(rejected))
    idx = next((i for i in range(n) if chosen[i] != rejected[i]), None)
    if idx is None:
        idx = n - 1
    elif idx > 0 and chosen[idx - 1] == " ":
        idx -= 1
    idx = max(idx, 0)  # TRL would fail on an empty side; an empty prompt is refused by the caller
    return chosen[:idx], chosen[idx:], rejected[idx:]


def _check_completion(turns: Conversation, key: str, offset: int) -> None:
    # Never empty: checked_turns refuses an empty list, and an implicit prompt leaves each side a turn.
    for i, turn in enumerate(turns):
        if turn["role"] != "assistant":
            where = f"'{key}'[{offset + i}]"
            raise DataError(f"{where} is a {turn['role']} turn, but the completion '{key}' must hold only assistant "
                            "turns; fix: put the conversation before the answer in 'prompt' (or, without a "
                            "prompt, make chosen and rejected start with the same turns and differ only in the "
                            "assistant's answer)")
    if not any(t.get("content") or t.get("tool_calls") for t in turns):
        raise DataError(f"'{key}' is empty (its assistant turns have no content and no tool calls); fix: give each "
                        "pair a non-empty chosen and rejected answer, or drop the line")


def _check_differ(rec: dict) -> None:
    if rec["chosen"] == rec["rejected"]:
        raise DataError("'chosen' and 'rejected' are the same, so the pair prefers nothing; fix: drop the line "
                        "or give it a different rejected answer")


# --- rendering and tokens --------------------------------------------------------------------


def render_pair(rec: dict, template: Optional[ChatTemplate]) -> tuple[str, str, str]:
    """(prompt, chosen, rejected) texts of a normalized record, as TRL's maybe_apply_chat_template
    gives them: the prompt rendered with the generation prompt and cut to its common prefix
    with both full renderings; the completions are the rest of each. Text records as they are."""
    if isinstance(rec["chosen"], str):
        return rec["prompt"], rec["chosen"], rec["rejected"]
    prompt, full_chosen, full_rejected = _render(rec, template)
    for full in (full_chosen, full_rejected):
        prompt = prompt[:_common_prefix(prompt, full)]
    return prompt, full_chosen[len(prompt):], full_rejected[len(prompt):]


def encode_pair(rec: dict, tok: Tokenizer, template: Optional[ChatTemplate] = None,
                eos_token: Optional[str] = None) -> Pair:
    """The token ids of a normalized record (parse_pair), as TRL's DPOTrainer makes them
    (module docstring). `eos_token` (the string, as tokenizer_config.json names it) is
    needed by standard records; conversational ones need `template`."""
    return encode_record(rec, tok, template, eos_token)[0]


def encode_record(rec: dict, tok: Tokenizer, template: Optional[ChatTemplate], eos_token: Optional[str]
                  ) -> tuple[Pair, bool]:
    """(pair, whether the prompt lost tokens to the common-prefix rule: TRL's warning)."""
    if isinstance(rec["chosen"], str):
        if eos_token is None:
            raise DataError("a text pair needs the tokenizer's eos_token, appended to chosen and rejected as TRL "
                            "does, and none is known; fix: give the checkpoint's tokenizer_config.json an "
                            "\"eos_token\", or write the pair as a conversation for the chat template")
        chosen, rejected = (t if t.endswith(eos_token) else t + eos_token for t in (rec["chosen"], rec["rejected"]))
        texts, special = (rec["prompt"], rec["prompt"] + chosen, rec["prompt"] + rejected), True
    else:
        texts, special = _render(rec, template), False  # the template writes every special token
    prompt, full_chosen, full_rejected = (tok.encode(t, add_special_tokens=special).ids for t in texts)
    n = min(_common_prefix(prompt, full_chosen), _common_prefix(prompt, full_rejected))
    return Pair(prompt[:n], full_chosen[n:], full_rejected[n:]), n < len(prompt)


def _render(rec: dict, template: Optional[ChatTemplate]) -> tuple[str, str, str]:
    """The prompt with the generation prompt, prompt + chosen and prompt + rejected."""
    if template is None:
        raise DataError("a conversational pair needs a chat template, and there is none; fix: set "
                        "data.chat_template to llama3, chatml or a .jinja file, or use a checkpoint whose "
                        "tokenizer_config.json has a chat_template")
    tools = rec.get("tools")
    calls = any("tool_calls" in m for side in ("prompt", "chosen", "rejected") for m in rec[side])
    for used, variable, what in ((calls, "tool_calls", "tool calls"), (bool(tools), "tools", "tools")):
        if used and not template.reads(variable):
            raise DataError(f"the pair has {what}, which the chat template {template.name} never reads (no "
                            f"'{variable}' in it), so it would drop them; fix: use the checkpoint's own template "
                            "(data.chat_template=auto) or a .jinja file that renders them")
    try:
        return (template.render(rec["prompt"], add_generation_prompt=True, tools=tools),
                template.render(rec["prompt"] + rec["chosen"], tools=tools),
                template.render(rec["prompt"] + rec["rejected"], tools=tools))
    except jinja2.exceptions.TemplateError as e:
        raise DataError(f"the chat template {template.name} failed to render this pair ({type(e).__name__}: {e}); "
                        "fix: correct the conversation (roles, order) or set data.chat_template to a template "
                        "that accepts it") from None


def _common_prefix(a, b) -> int:
    """Length of the longest common prefix of two sequences (TRL's common_prefix_length)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def truncate(pair: Pair, max_length: Optional[int]) -> Optional[Pair]:
    """The pair as TRL 1.16 trains it under max_length with keep_start: None (dropped) when
    the prompt alone has max_length tokens or more, else each completion cut so that prompt +
    completion keeps its first max_length tokens. max_length=None keeps everything."""
    if max_length is None:
        return pair
    room = max_length - len(pair.prompt_ids)
    if room <= 0:
        return None
    return Pair(pair.prompt_ids, pair.chosen_ids[:room], pair.rejected_ids[:room])


# --- files -----------------------------------------------------------------------------------


def scan_pairs(path: str) -> Iterator[tuple[int, Optional[dict], Optional[str]]]:
    """Yield `(line_number, record, None)` or `(line_number, None, problem)` for every
    non-blank line (megaft.data.jsonl's rules: UTF-8, one JSON object a line). A missing
    file or one without pairs is one problem with line number 0."""
    return scan_json_lines(path, parse_pair, "pairs")


def read_pairs(path: str, tok: Tokenizer, template: Optional[ChatTemplate] = None,
               eos_token: Optional[str] = None) -> list[Pair]:
    """Every pair of a JSONL file, tokenized as TRL's DPOTrainer tokenizes it, in file order.

    `template`: the checkpoint's chat template (megaft.data.templates.load_chat_template),
    needed by conversational pairs. `eos_token`: appended to text completions; defaults to the
    template's eos_token (from tokenizer_config.json). Raises DataError("FILE:LINE: problem;
    fix: ...") at the first bad record."""
    if eos_token is None and template is not None:
        eos_token = template.special_tokens.get("eos_token")
    pairs, cut = [], []
    for lineno, rec, problem in scan_pairs(path):
        if problem is None:
            try:
                pair, prompt_cut = encode_record(rec, tok, template, eos_token)
            except DataError as e:
                problem = str(e)
        if problem is not None:
            raise DataError(f"{where(path, lineno)}: {problem}")
        if prompt_cut:
            cut.append(lineno)
        pairs.append(pair)
    if cut:
        log.warning("%s: in %d of %d pairs (first: line %d) the tokenized prompt is not a prefix of prompt + "
                    "completion (the template writes the prompt alone differently, or tokens merge across the "
                    "boundary); as in TRL, the completion starts where they diverge", path, len(cut), len(pairs),
                    cut[0])
    return pairs


def pair_problems(path: str, limit: int = 20) -> list[str]:
    """Every malformed record of a preference file as "FILE:LINE: problem; fix: ..." (the
    record checks only: rendering and tokens need the tokenizer); the first `limit`, then a
    line counting the rest."""
    return listed_problems(path, scan_pairs(path), limit)


def pair_source_problems(path: str, limit: int = 20) -> tuple[list[str], bool]:
    """pair_problems of every file of a source path (a file, a directory of .jsonl/.parquet
    files, a saved `datasets` folder), and whether any pair is conversational (its template
    must exist): megaft.data.sources.source_problems for pairs, for megaft.data.checks.check_data."""
    return source_problems(path, limit, parse=parse_pair, what="pairs",
                           is_chat=lambda rec: not isinstance(rec["chosen"], str))
