"""The docs stay true: docs/configuration.md is the generator's output and lists every key of
the composed config, every relative link in README.md and docs/ reaches a file (and a heading,
when it names one), and README.md stays a front door: short, with the two commands."""
import difflib
import glob
import os
import re

import pytest

from megaft.configdoc import COMMAND, DOC_PATH, render

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
PAGES = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


@pytest.fixture(scope="module")
def generated() -> str:
    return render()


def test_configuration_page_is_current(generated):
    with open(DOC_PATH) as f:
        committed = f.read()
    if committed != generated:
        diff = "".join(list(difflib.unified_diff(committed.splitlines(True), generated.splitlines(True),
                                                 "docs/configuration.md", "generated"))[:40])
        pytest.fail(f"docs/configuration.md is stale: regenerate it with `.venv/bin/{COMMAND}`\n{diff}")


def _leaves(node, prefix=""):
    """Dotted keys of a config's leaves (a list, an empty dict or a scalar is a leaf)."""
    if isinstance(node, dict) and node:
        for key, value in node.items():
            yield from _leaves(value, f"{prefix}{key}.")
    else:
        yield prefix.rstrip(".")


def test_every_composed_key_is_documented(generated):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from megaft.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=os.path.join(ROOT, "conf"), version_base="1.3"):
        composed = OmegaConf.to_container(compose("train"))  # the tree `megaft-train --cfg job` prints
    keys = list(_leaves(composed))
    assert "parallel.tp" in keys and "data.sources" in keys and "precision" in keys  # the walk found leaves
    missing = [k for k in keys if f"| `{k}` |" not in generated]
    assert not missing, f"keys missing from docs/configuration.md: {missing}; regenerate: `.venv/bin/{COMMAND}`"


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower()).replace(" ", "-")


def _prose(path: str) -> str:
    """The file without fenced code blocks and inline code (links there are not links)."""
    with open(path) as f:
        return re.sub(r"`[^`\n]*`", "", FENCE.sub("", f.read()))


def _anchors(path: str) -> set[str]:
    with open(path) as f:
        text = FENCE.sub("", f.read())
    return {_slug(m) for m in re.findall(r"^#{1,6} (.+)$", text, re.M)}


@pytest.mark.parametrize("path", [README] + PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_relative_links_resolve(path):
    broken = []
    for target in LINK.findall(_prose(path)):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked here
            continue
        file, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
        if not os.path.exists(dest):
            broken.append(f"{target}: no file {os.path.relpath(dest, ROOT)}")
        elif anchor and dest.endswith(".md") and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {os.path.relpath(dest, ROOT)}")
    assert not broken, f"{os.path.relpath(path, ROOT)}: broken links:\n" + "\n".join(broken)


def test_readme_is_the_front_door():
    with open(README) as f:
        text = f.read()
    assert len(text.splitlines()) < 250, "README.md is the front door: move detail into a docs/ page"
    assert "make train" in text and "make test" in text
    linked = {os.path.normpath(os.path.join(ROOT, t.partition("#")[0])) for t in LINK.findall(_prose(README))}
    assert PAGES and not [os.path.relpath(p, ROOT) for p in PAGES if p not in linked], \
        "every docs/ page is linked from README.md's index"
