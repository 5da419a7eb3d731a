"""docs/configuration.md, generated from the config dataclasses.

    python -m megaft.configdoc            # print the page
    python -m megaft.configdoc --write    # write docs/configuration.md

It walks the root `Config` (megaft.config) field by field, into every nested dataclass
(and the element dataclass of a list, such as data.sources). Each key gets its type (an
enum's choices), the dataclass default, the value megaft-train composes from conf/ where
a preset changes it, and the comment its field carries in the source: the trailing
`# comment`, continuation lines below it (`#   ...`) and the comment lines above it. A
section starts with its class docstring (else its module's) and the presets of its group
in conf/. tests/test_docs.py fails when the committed page differs from this output.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import functools
import inspect
import io
import os
import re
import sys
import tokenize
import typing
from typing import Any, Iterator

from megaft.config import Config, compose_config, conf_dir

COMMAND = "python -m megaft.configdoc --write"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC_PATH = os.path.join(ROOT, "docs", "configuration.md")
_CONTINUATION = re.compile(r"#\s{2,}")  # "#   more": the previous field's comment goes on


@dataclasses.dataclass
class Row:
    key: str
    type: str
    default: str
    composed: str
    text: str


@functools.cache
def _class_source(cls: type) -> tuple[ast.ClassDef | None, list[str], dict[int, str]]:
    """The class's AST node (None for an enum made by a call), its module's lines and the
    module's comments by line number."""
    with open(inspect.getsourcefile(cls)) as f:
        source = f.read()
    node = next((n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == cls.__name__),
                None)
    comments = {tok.start[0]: tok.string for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                if tok.type == tokenize.COMMENT}
    return node, source.splitlines(), comments


def _text(comment: str) -> str:
    return comment.lstrip("#").strip()


@functools.cache
def field_comments(cls: type) -> dict[str, str]:
    """Each field's comment: trailing and continuation lines first, then the lines above it."""
    node, lines, comments = _class_source(cls)
    alone = {n for n in comments if lines[n - 1].lstrip().startswith("#")}  # comment-only lines
    out, claimed = {}, set()
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        above, n = [], stmt.lineno - 1
        while n in alone and n not in claimed:
            above.insert(0, _text(comments[n]))
            n -= 1
        own = [_text(comments[n]) for n in range(stmt.lineno, stmt.end_lineno + 1) if n in comments]
        n = stmt.end_lineno + 1
        while n in alone and _CONTINUATION.match(lines[n - 1].lstrip()):
            own.append(_text(comments[n]))
            claimed.add(n)
            n += 1
        out[stmt.target.id] = "; ".join(part for part in (" ".join(own), " ".join(above)) if part)
    return out


def docstring(cls: type) -> str:
    """The class docstring, else the first paragraph of its module's ("" when neither)."""
    node, _, _ = _class_source(cls)
    doc = ast.get_docstring(node) if node is not None else None
    if not doc:  # the module's, less a leading "FooConfig (`foo.*`): " the section heading already says
        module_doc = (inspect.getdoc(sys.modules[cls.__module__]) or "").split("\n\n")[0]
        doc = re.sub(r"^[A-Z]\w*Config\b[^:]*:\s+", "", module_doc)
    return " ".join(doc.split())


def enum_doc(cls: type) -> str:
    """An enum class's own docstring ("" when it has none)."""
    node, _, _ = _class_source(cls)
    return " ".join((ast.get_docstring(node) or "").split()) if node is not None else ""


def _enum_of(tp: Any) -> type | None:
    return tp if isinstance(tp, type) and issubclass(tp, enum.Enum) else None


def _unwrap(tp: Any) -> tuple[Any, bool]:
    """(the type inside Optional[...], whether None is allowed)."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) is typing.Union and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0], True
    return tp, False


def type_name(tp: Any) -> str:
    """A field type as the page shows it: enum choices, `list of int`, `float or null`."""
    inner, optional = _unwrap(tp)
    origin, args = typing.get_origin(inner), typing.get_args(inner)
    if _enum_of(inner):
        name = " \\| ".join(f"`{m.value}`" for m in inner)
    elif origin in (list, typing.List):
        name = f"list of {type_name(args[0]) if args else 'any'}"
    elif origin in (dict, typing.Dict):
        name = "dict"
    elif dataclasses.is_dataclass(inner):
        name = inner.__name__
    else:
        name = getattr(inner, "__name__", str(inner))
    return f"{name} or null" if optional else name


def yaml_value(value: Any) -> str:
    """A value as `--cfg job` prints it (YAML flow style)."""
    if value is None:
        return "null"
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value if value else "''"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {yaml_value(v)}" for k, v in value.items()) + "}"
    if dataclasses.is_dataclass(value):
        return yaml_value(dataclasses.asdict(value))
    return repr(value)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def walk(cls: type, prefix: str, default: Any, composed: Any) -> Iterator[tuple[str, type, list[Row]]]:
    """(key prefix, dataclass, its rows) for `cls` and every dataclass below it, depth first."""
    hints, comments, rows, below = typing.get_type_hints(cls), field_comments(cls), [], []
    for f in dataclasses.fields(cls):
        key, tp = f"{prefix}{f.name}", hints[f.name]
        value = getattr(default, f.name) if default is not None else _default(f)
        got = getattr(composed, f.name) if composed is not None else value
        inner, _ = _unwrap(tp)
        if dataclasses.is_dataclass(inner):
            below.append((inner, f"{key}.", value, got))
            continue
        args = typing.get_args(inner)
        if typing.get_origin(inner) in (list, typing.List) and args and dataclasses.is_dataclass(args[0]):
            below.append((args[0], f"{key}[].", None, None))
        text = comments.get(f.name, "")
        if _enum_of(inner) and enum_doc(inner):
            text = "; ".join(t for t in (text, enum_doc(inner)) if t)
        shown, want = yaml_value(value), yaml_value(got)
        rows.append(Row(key, type_name(tp), shown, "" if want == shown else want, text))
    yield prefix, cls, rows
    for args in below:
        yield from walk(*args)


def _table(rows: list[Row]) -> list[str]:
    out = ["| key | type | default | megaft-train | meaning |", "|---|---|---|---|---|"]
    for r in rows:
        composed = f"`{_cell(r.composed)}`" if r.composed else ""
        out.append(f"| `{r.key}` | {r.type} | `{_cell(r.default)}` | {composed} | {_cell(r.text)} |")
    return out


def presets(group: str) -> list[tuple[str, str]]:
    """(name, the YAML's leading comment) of every preset in conf/<group>/."""
    folder = os.path.join(conf_dir(), group)
    if not os.path.isdir(folder):
        return []
    found = []
    for name in sorted(n for n in os.listdir(folder) if n.endswith(".yaml")):
        with open(os.path.join(folder, name)) as f:
            lines = f.readlines()
        comment = []
        for line in lines:
            if not line.startswith("#"):
                break
            if not line.startswith("# @package"):  # Hydra's directive, not prose
                comment.append(_text(line))
        found.append((name[:-len(".yaml")], " ".join(comment)))
    return found


def default_presets() -> dict[str, str]:
    """The preset conf/train.yaml picks per group ("none" for a null one)."""
    from omegaconf import OmegaConf

    defaults = OmegaConf.to_container(OmegaConf.load(os.path.join(conf_dir(), "train.yaml")))["defaults"]
    return {k: "none" if v is None else str(v) for d in defaults if isinstance(d, dict) for k, v in d.items()}


def recipes() -> list[str]:
    """The recipe group (conf/recipe/, `# @package _global_`): each recipe's first comment line and
    every value it sets, as overrides (the sources are cited in the files)."""
    from omegaconf import OmegaConf

    out = ["## Recipes", "", "`recipe=<name>` (files in `conf/recipe/`; megaft-train's default: "
           f"`{default_presets().get('recipe', 'none')}`) sets the hyperparameters of a job at once, each "
           "value cited in the file with its source; the command line still wins over it "
           "([getting-started.md](getting-started.md)).", ""]
    for name, _ in presets("recipe"):
        path = os.path.join(conf_dir(), "recipe", f"{name}.yaml")
        with open(path) as f:
            first = next(_text(line) for line in f if line.startswith("#") and not line.startswith("# @package"))
        sets = ", ".join(f"`{o}`" for o in overrides(OmegaConf.to_container(OmegaConf.load(path))))
        out.append(f"- `{name}`: {first} Sets {sets}.")
    return out + [""]


def overrides(node: dict, prefix: str = "") -> Iterator[str]:
    """A YAML mapping as the command-line overrides that set the same values."""
    for key, value in node.items():
        if isinstance(value, dict):
            yield from overrides(value, f"{prefix}{key}.")
        else:
            shown = "null" if value is None else f"[{','.join(map(str, value))}]" if isinstance(value, list) else value
            yield _cell(f"{prefix}{key}={shown}")


def _section(name: str, cls: type, rows: list[Row], note: str, picked: dict[str, str]) -> list[str]:
    out = [f"## {name}", ""]
    where = inspect.getsourcefile(cls)
    intro = f"`{cls.__name__}` (`{os.path.relpath(where, ROOT)}`)" + (f": {docstring(cls)}" if docstring(cls) else ".")
    out += [intro + (f" In the root config: {note}." if note else ""), ""]
    choices = presets(name)
    if choices:
        out.append(f"Presets (`{name}=<name>`, files in `conf/{name}/`; megaft-train's default: "
                   f"`{picked.get(name, 'none')}`):")
        out += [f"- `{n}`" + (f": {c}" if c else "") for n, c in choices]
        out.append("")
    return out + _table(rows) + [""]


def render() -> str:
    """The whole page."""
    composed, picked = compose_config([]), default_presets()
    root_comments = field_comments(Config)
    out = [
        "# Configuration reference", "",
        f"<!-- Generated by `{COMMAND}` from the config dataclasses; do not edit by hand. -->", "",
        f"This page is generated by `{COMMAND}` from the dataclasses the root `Config`",
        "(`megaft/config.py`) is made of: every key `megaft-train --cfg job` prints, with its type, its",
        "default and the comment its field carries in the source. Set a key on the command line",
        "(`parallel.tp=4`; a comma list sweeps it under `-m`), pick a group's preset with",
        "`<group>=<name>`. **default** is the dataclass's; **megaft-train** is the value megaft-train",
        "composes from `conf/train.yaml` and its presets, shown where it differs. Enum choices are",
        "checked by Hydra while composing; `validate()` checks the rest before any rank starts.",
        "megaft-verify, megaft-plan, megaft-commbench, megaft-prepare and megaft-scale take the same",
        "tree (megaft-plan defaults to `cluster=h100`). When a dataclass changes, run the command",
        "above; `tests/test_docs.py` fails until this page matches.", "",
    ]
    top = [(f, typing.get_type_hints(Config)[f.name]) for f in dataclasses.fields(Config)]
    nested = [f for f, tp in top if dataclasses.is_dataclass(tp)]
    scalars = [f.name for f, tp in top if not dataclasses.is_dataclass(tp)]
    out += ["Sections: " + ", ".join(f"[{f.name}](#{f.name})" for f in nested)
            + ", [" + " and ".join(scalars) + "](#top-level-keys); [recipes](#recipes)", ""]
    out += recipes()
    for f in nested:
        for prefix, cls, rows in walk(typing.get_type_hints(Config)[f.name], f"{f.name}.", None,
                                      getattr(composed, f.name)):
            if prefix == f"{f.name}.":
                out += _section(f.name, cls, rows, root_comments.get(f.name, ""), picked)
            else:
                doc = docstring(cls)
                out += [f"### `{prefix.rstrip('.')}`", "", f"`{cls.__name__}`" + (f": {doc}" if doc else ""), ""]
                out += _table(rows) + [""]
    rows = [r for r in next(walk(Config, "", None, composed))[2] if r.key in scalars]
    out += ["## top-level keys", ""] + _table(rows)
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megaft.configdoc", description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"write {os.path.relpath(DOC_PATH, ROOT)}")
    args = parser.parse_args(argv)
    page = render()
    if args.write:
        with open(DOC_PATH, "w") as f:
            f.write(page)
        print(f"wrote {DOC_PATH}")
    else:
        sys.stdout.write(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
