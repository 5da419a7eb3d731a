"""The prompts file of `sample.prompts` (train.sample_every, megaft-chat's samples): one JSON
object a line, {"prompt": str} or {"messages": [...]}, read, rendered and checked here."""
from __future__ import annotations

import json
import os
from typing import Any, Callable

from megaft.config.checks import at_least
from megaft.config.train import SampleConfig
from megaft.data.errors import DataError


def read_prompts(path: str) -> list[dict]:
    """The prompt lines of `path`; DataError "FILE:LINE: what; fix: ..." for the first bad line."""
    prompts = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not JSON ({e.msg}); fix: one object per line, "
                                '{"prompt": "..."} or {"messages": [{"role": "user", "content": "..."}]}') from None
            prompts.append(_checked(item, where))
    if not prompts:
        raise DataError(f"{path} holds no prompt; fix: one JSON object per line, " '{"prompt": "..."}')
    return prompts


def _checked(item: Any, where: str) -> dict:
    if isinstance(item, dict) and isinstance(item.get("prompt"), str) and "messages" not in item:
        return item
    if isinstance(item, dict) and isinstance(item.get("messages"), list) and item["messages"] and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in item["messages"]) and "prompt" not in item:
        return item
    raise DataError(f"{where}: a line must be {{\"prompt\": str}} or {{\"messages\": [{{\"role\": str, \"content\": "
                    "str}, ...]}} (one of them, messages not empty); fix: write the line in one of those forms")


def render_prompt(item: dict, template) -> str:
    """The text the model continues: the prompt, or the conversation with the generation prompt."""
    if "prompt" in item:
        return item["prompt"]
    if template is None:
        raise DataError("a sample prompt is a conversation and the run has no chat template; fix: set "
                        "data.chat_template (llama3, chatml or a .jinja file) or write {\"prompt\": str} lines")
    return template.render(item["messages"], add_generation_prompt=True)


def check_samples(cfg: SampleConfig, sample_every: int, template: Callable[[], Any]) -> list[str]:
    """Problems of `sample.*` with train.sample_every; `template()` loads the run's chat template
    (None: none), only when a conversation needs it."""
    problems = at_least(cfg, "sample.max_new_tokens", 1, "", "e.g. sample.max_new_tokens=64")
    if cfg.temperature < 0:
        problems.append(f"sample.temperature={cfg.temperature} must be >= 0 (0 = greedy); fix: e.g. 0.7")
    if not 0 < cfg.top_p <= 1:
        problems.append(f"sample.top_p={cfg.top_p} must be in (0, 1]; fix: e.g. sample.top_p=0.9 (1 = off)")
    if sample_every > 0 and not cfg.prompts:
        return problems + [f"train.sample_every={sample_every} needs prompts to sample; fix: "
                           "sample.prompts=FILE (JSONL, {\"prompt\": str} or {\"messages\": [...]} per line), "
                           "or train.sample_every=0"]
    if not cfg.prompts:
        return problems
    if not os.path.isfile(cfg.prompts):
        return problems + [f"sample.prompts={cfg.prompts!r} is not a file; fix: point it at a JSONL file of "
                           "prompts"]
    try:
        items = read_prompts(cfg.prompts)
        if any("messages" in item for item in items):
            chat = template()
            for item in items:
                render_prompt(item, chat)
    except (DataError, OSError, ValueError) as e:
        problems.append(str(e))
    except Exception as e:  # a template error (jinja's raise_exception, an undefined variable)
        problems.append(f"{cfg.prompts}: the chat template failed on a conversation ({type(e).__name__}: {e}); "
                        "fix: correct the conversation or data.chat_template")
    return problems
