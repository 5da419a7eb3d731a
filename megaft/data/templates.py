"""Chat templates: jinja2 rendering that gives transformers' `apply_chat_template` text.

The environment mirrors transformers' (`utils/chat_template_utils.py`): a sandboxed
environment with trim_blocks and lstrip_blocks, the loopcontrols extension, the
`{% generation %}` extension that records the character spans of assistant output,
`raise_exception`, `strftime_now`, a `tojson` that does not escape HTML, and the
restricted `dict`/`namespace` globals. The template sees `messages`, `tools` (the
conversation's function specs, else None; megaft.data.tools), `documents=None`,
`add_generation_prompt` and the named special tokens of the checkpoint's
tokenizer_config.json (bos_token, eos_token, ...), as transformers passes them.
Where the template comes from (data.chat_template):

    auto         the checkpoint's chat_template.jinja, else tokenizer_config.json's
                 `chat_template` (a string, or a list of named templates: "default")
    llama3       the built-in Llama 3 template (below)
    chatml       the built-in ChatML template (Qwen, many fine-tunes)
    <file.jinja> a template file
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime
from functools import lru_cache
from typing import NamedTuple, Optional

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from megaft.data.errors import DataError

# Both mark the assistant's own output (content + end-of-turn token) with {% generation %},
# so role masks are exact; outside the markers they render Meta's and the ChatML text.
LLAMA3 = (
    "{{ bos_token | default('<|begin_of_text|>') }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ message['content'] + '<|im_end|>' + '\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
BUILTIN = {"llama3": LLAMA3, "chatml": CHATML}
# Tokens a built-in template writes: they must be single tokens of the vocabulary.
BUILTIN_TOKENS = {"llama3": ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
                  "chatml": ("<|im_start|>", "<|im_end|>")}
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")
_GENERATION_RE = re.compile(r"\{\%-?\s*generation\s*-?\%\}")
_FIX = ("fix: set data.chat_template to llama3, chatml or a .jinja file, or use a checkpoint "
        "whose tokenizer_config.json has a chat_template")


class _GenerationTracker(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: records (start, end) character spans of
    the block in the rendered text while a tracker is active (transformers' AssistantTracker)."""

    tags = {"generation"}

    def __init__(self, environment):
        super().__init__(environment)
        environment.extend(activate_tracker=self.activate_tracker)
        self._tracking = ContextVar("megaft_generation_tracker", default=None)

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_generation_support"), [], [], body).set_lineno(lineno)

    @jinja2.pass_eval_context
    def _generation_support(self, context, caller):
        rv = caller()
        tracking = self._tracking.get()
        if tracking is not None:
            # The offset is what was yielded so far, exactly as transformers computes it.
            blocks, spans = tracking
            start = len("".join(blocks))
            spans.append((start, start + len(rv)))
        return rv

    @contextmanager
    def activate_tracker(self, blocks: list, spans: list):
        token = self._tracking.set((blocks, spans))
        try:
            yield
        finally:
            self._tracking.reset(token)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' override: jinja's own tojson escapes HTML characters.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


class _TemplateDict:
    # A callable stand-in for `dict` that exposes no attributes to break out of the sandbox.
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    # Namespaces reject underscore attributes, which could reach CPython internals.
    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"cannot store underscore attribute {name!r} on a namespace")


@lru_cache(maxsize=16)
def compile_template(text: str) -> jinja2.Template:
    """Compile a chat template in transformers' environment (cached per text)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTracker, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(text)


class ChatTemplate(NamedTuple):
    """A chat template and the special tokens it is rendered with."""

    text: str
    name: str  # "llama3", "chatml", a file path, or "<dir>/tokenizer_config.json"
    special_tokens: dict  # bos_token, eos_token, ... as transformers' special_tokens_map

    @property
    def has_generation_markers(self) -> bool:
        """Whether assistant output is marked with {% generation %} (exact role masks)."""
        return bool(_GENERATION_RE.search(self.text))

    def reads(self, variable: str) -> bool:
        """Whether the template's text names `variable` (`tools`, `tool_calls`): one that
        never does cannot render it, and would drop it silently."""
        return re.search(rf"\b{re.escape(variable)}\b", self.text) is not None

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()

    def render(self, messages: list[dict], add_generation_prompt: bool = False,
               tools: Optional[list[dict]] = None) -> str:
        """The conversation as text, as transformers' apply_chat_template(messages,
        tools=tools, tokenize=False)."""
        return compile_template(self.text).render(**self._variables(messages, add_generation_prompt, tools))

    def render_with_spans(self, messages: list[dict], add_generation_prompt: bool = False,
                          tools: Optional[list[dict]] = None) -> tuple[str, list[tuple[int, int]]]:
        """(text, character spans of the {% generation %} blocks), as transformers
        renders with return_assistant_tokens_mask=True: block by block with generate()."""
        template = compile_template(self.text)
        blocks, spans = [], []
        with template.environment.activate_tracker(blocks, spans):
            for block in template.generate(**self._variables(messages, add_generation_prompt, tools)):
                blocks.append(block)
        return "".join(blocks), spans

    def _variables(self, messages, add_generation_prompt, tools) -> dict:
        return {"messages": messages, "tools": tools or None, "documents": None,
                "add_generation_prompt": add_generation_prompt, **self.special_tokens}


def special_tokens(tokenizer_dir: Optional[str]) -> dict:
    """The named special tokens of `tokenizer_dir`/tokenizer_config.json as strings
    (an AddedToken saved as {"content": ...} included); {} when there is no such file."""
    config = _tokenizer_config(tokenizer_dir)
    out = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out


def _tokenizer_config(tokenizer_dir: Optional[str]) -> dict:
    if tokenizer_dir is None:
        return {}
    path = os.path.join(tokenizer_dir, "tokenizer_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: cannot read ({e}); fix: repair the file or set data.chat_template") from e
    return config if isinstance(config, dict) else {}


def _checkpoint_template(tokenizer_dir: Optional[str]) -> Optional[tuple[str, str]]:
    """(text, where) of a checkpoint's own template: chat_template.jinja wins over
    tokenizer_config.json, as in transformers' from_pretrained."""
    if tokenizer_dir is None:
        return None
    jinja_file = os.path.join(tokenizer_dir, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read(), jinja_file
    where = os.path.join(tokenizer_dir, "tokenizer_config.json")
    template = _tokenizer_config(tokenizer_dir).get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}]: transformers uses "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise DataError(f"{where}: chat_template lists templates {sorted(map(str, named))} but no "
                            f"'default'; fix: set data.chat_template to a .jinja file holding the one to use")
        template = named["default"]
    if template is None:
        return None
    if not isinstance(template, str):
        raise DataError(f"{where}: chat_template must be a string or a list of named templates; {_FIX}")
    return template, where


def load_chat_template(choice: str, tokenizer_dir: Optional[str]) -> Optional[ChatTemplate]:
    """The ChatTemplate data.chat_template names, or None for `auto` when the checkpoint
    has no template (only conversations need one; their reader raises then).
    Raises DataError for an unreadable or uncompilable template, with the fix."""
    tokens = special_tokens(tokenizer_dir)
    if choice in BUILTIN:
        text, name = BUILTIN[choice], choice
    elif choice == "auto":
        found = _checkpoint_template(tokenizer_dir)
        if found is None:
            return None
        text, name = found
    else:
        if not os.path.isfile(choice):
            raise DataError(f"data.chat_template={choice!r} is neither auto, llama3, chatml nor an "
                            f"existing file; {_FIX}")
        with open(choice, encoding="utf-8") as f:
            text, name = f.read(), choice
    try:
        compile_template(text)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise DataError(f"{name}: the chat template does not compile (line {e.lineno}: {e.message}); "
                        f"{_FIX}") from None
    return ChatTemplate(text, name, tokens)


def tokenizer_dir_of(tokenizer: Optional[str], init_from: Optional[str]) -> Optional[str]:
    """The directory whose tokenizer_config.json / chat_template.jinja belong to the
    run's tokenizer: data.tokenizer's (its directory when it names a file), else init_from."""
    if tokenizer is not None:
        return tokenizer if os.path.isdir(tokenizer) else os.path.dirname(os.path.abspath(tokenizer))
    return init_from  # a checkpoint directory (a missing one is reported by the model checks)
