"""The import structure of megaft: no cycles, and every import between folders points down.

Every folder of megaft/ (a package, or a module at the top of megaft/) is one unit, and
FOLDERS lists them lowest first: a module may import its own folder and the folders listed
before it, never one after (counted at the top level: megaft.parallel.data is part of
megaft.parallel). So no two folders import each other, and a folder's place in the list is
its layer (docs/architecture.md draws the same list). megaft.config, the schema, sits at the
bottom: it imports nothing of megaft beside itself (and no torch, tested below), and the
checks that need the models, the data or the performance model sit above in
megaft.validation.
"""
from __future__ import annotations

import ast
import os
import re

import pytest

import megaft

FOLDERS: list[str] = [
    # base: stdlib-only helpers and the config schema
    "megaft.fileio", "megaft.signals", "megaft.cli_args", "megaft.device", "megaft.run_dir", "megaft.forks",
    "megaft.config",
    # the grid and the parallel concepts (tensor, context, expert, data: the dp gradient reduction)
    "megaft.parallel",
    "megaft.kernels",
    "megaft.layers",  # column/row-parallel linears, vocab-parallel embedding, RMSNorm
    "megaft.models",
    "megaft.peft",
    "megaft.inference",  # generation and the KV cache: samples, megaft-chat, megaft-eval
    "megaft.optim",  # AdamW over flat buffers and ZeRO (the distributed optimizer), above parallel/
    "megaft.pipeline",
    "megaft.checkpoint",
    "megaft.perf",  # the one performance model
    "megaft.data",
    "megaft.pref",
    "megaft.reward",  # reward models: the last-token reward, the loss and margins (TRL's RewardTrainer)
    "megaft.rl",  # GRPO: advantages and the policy loss (TRL's definitions)
    "megaft.distill",  # logit distillation: the vocab-parallel generalized JSD (TRL's), the teacher checks
    "megaft.training",
    "megaft.eval",  # megaft-eval; validation reads its task checks
    "megaft.validation",  # validate(): the sections' checks with the files, the models and the memory estimate
    "megaft.launch",
    # the tools (console scripts), each above what it reads: megaft-report reads megaft-scale's study
    "megaft.plan", "megaft.scale", "megaft.report", "megaft.chat", "megaft.prepare", "megaft.verify",
    "megaft.commbench", "megaft.configdoc", "megaft.train", "megaft.score", "megaft.conf", "megaft.cli", "megaft",
]
ROOT = os.path.dirname(megaft.__file__)


def modules() -> dict[str, str]:
    """Dotted name -> path of every module of the package."""
    out = {}
    for folder, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, f), os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                out[rel.removesuffix(".__init__")] = os.path.join(folder, f)
    return out


def imports(name: str, path: str, known: dict[str, str]) -> set[str]:
    """The megaft modules `name` imports, at module level or inside functions."""
    pkg = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            # `from pkg import mod` imports the module pkg.mod when there is one
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names)
    return {m for m in found if m == "megaft" or m.startswith("megaft.")} - {name}


def folder_of(name: str) -> str:
    """The top-level unit of megaft that `name` is in (megaft.parallel.data.flat -> megaft.parallel)."""
    parts = name.split(".")
    return ".".join(parts[:2])


def upward_between_folders(edges: dict[str, set[str]]) -> list[str]:
    """Every import from a folder to one listed after it in FOLDERS."""
    return sorted(f"{a} ({folder_of(a)}) imports {b} ({folder_of(b)})" for a, deps in edges.items() for b in deps
                  if FOLDERS.index(folder_of(b)) > FOLDERS.index(folder_of(a)))


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (iterative DFS, three colours)."""
    state: dict[str, int] = {}
    for start in sorted(edges):
        if state.get(start):
            continue
        stack, path = [(start, iter(sorted(edges[start])))], [start]
        state[start] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                state[node] = 2
                stack.pop()
                path.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt) and nxt in edges:
                state[nxt] = 1
                stack.append((nxt, iter(sorted(edges[nxt]))))
                path.append(nxt)
    return None


def test_every_module_has_a_folder():
    assert sorted({folder_of(m) for m in modules()} - set(FOLDERS)) == []
    assert len(FOLDERS) == len(set(FOLDERS))


def test_no_import_cycles():
    assert find_cycle(graph()) is None, " -> ".join(find_cycle(graph()))


def test_imports_point_down_the_folders():
    # One home per concept: between folders an import points only to a folder listed earlier.
    upward = upward_between_folders(graph())
    assert upward == [], "\n".join(upward)


def test_the_folder_checker_finds_upward_imports():
    # The guard must be able to fail: the back-imports the house issues removed are caught.
    planted = {"megaft.scale.app": {"megaft.report", "megaft.plan.multirun"},  # megaft-scale calling report.main
               "megaft.plan.app": {"megaft.train"},  # the tools took conf_dir from the Hydra app
               "megaft.launch.elastic": {"megaft.plan.replan"},  # the elastic re-plan below the planner
               "megaft.parallel.data.zero": {"megaft.optim.adamw"},  # ZeRO in parallel/, over optim's AdamW
               "megaft.config.root": {"megaft.training.config"},  # the config knot (issue 37)
               "megaft.perf.memory": {"megaft.training.optimizer"},  # the perf model reading the trainer
               "megaft.parallel.context.batch": {"megaft.models.attention.documents"}}  # cp sharding building Docs
    assert upward_between_folders(planted) == [
        "megaft.config.root (megaft.config) imports megaft.training.config (megaft.training)",
        "megaft.launch.elastic (megaft.launch) imports megaft.plan.replan (megaft.plan)",
        "megaft.parallel.context.batch (megaft.parallel) imports megaft.models.attention.documents (megaft.models)",
        "megaft.parallel.data.zero (megaft.parallel) imports megaft.optim.adamw (megaft.optim)",
        "megaft.perf.memory (megaft.perf) imports megaft.training.optimizer (megaft.training)",
        "megaft.plan.app (megaft.plan) imports megaft.train (megaft.train)",
        "megaft.scale.app (megaft.scale) imports megaft.report (megaft.report)"]
    assert upward_between_folders({"megaft.report": {"megaft.scale.report"}, "megaft.train": {"megaft.plan.replan"},
                                   "megaft.optim.zero": {"megaft.parallel.data.flat"}}) == []
    assert folder_of("megaft.parallel.context.ring") == folder_of("megaft.parallel.grid") == "megaft.parallel"
    assert folder_of("megaft.configdoc") == "megaft.configdoc" and folder_of("megaft") == "megaft"


def test_the_checker_finds_cycles():
    # The guard must be able to fail: a planted cycle is caught.
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_config_imports_nothing_of_megaft():
    # The schema is a leaf (issue 37): nothing of megaft beside megaft.config (the package __init__
    # aside), so composing, printing and checking a config needs no model, data or trainer code.
    edges = graph()
    outside = sorted(f"{a} imports {b}" for a, deps in edges.items() if folder_of(a) == "megaft.config"
                     for b in deps if folder_of(b) != "megaft.config" and b != "megaft")
    assert outside == []


def _fresh_modules(code: str) -> list[str]:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", f"{code}; import sys; print(sorted(sys.modules))"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return eval(out.stdout.strip().splitlines()[-1])


def test_importing_the_config_imports_no_torch():
    # `import megaft.config` (and composing a Config) without torch: megaft-plan, config checks and
    # `megaft-train --cfg job` pay no torch import for the schema.
    loaded = _fresh_modules("import megaft.config; megaft.config.Config()")
    assert [m for m in loaded if m == "torch" or m.startswith("torch.")] == []
    assert [m for m in loaded if m.startswith("megaft.") and not m.startswith("megaft.config")] == []


@pytest.mark.parametrize("name", ["megaft.parallel.grid", "megaft.kernels.rmsnorm", "megaft.models.decoder",
                                  "megaft.parallel.context", "megaft.parallel.data"])
def test_low_folders_import_without_the_high_ones(name):
    # Importing a low-folder module in a fresh interpreter must not pull in the trainer, the
    # launcher or validation.
    loaded = _fresh_modules(f"import {name}")
    assert [m for m in loaded if m.startswith(("megaft.training", "megaft.launch", "megaft.validation"))] == []


# --- one performance model ---------------------------------------------------------------
# megaft.perf counts a model's parameters, FLOPs and bytes and holds the device table; no
# other module may (issue 23). What "counting" looks like in source, as patterns:
COUNTING = (
    # (ClusterConfig.peak_tflops(self, precision) reads its own fields, which the table filled)
    (re.compile(r"^\s*def \w*(flops|tflops)\w*\s*\((?!self)", re.M), "defines a FLOPs/peak function"),
    (re.compile(r"^\s*(PEAK_TFLOPS|GPU_MEMORY_GIB|DEVICES)\s*[:=]", re.M), "holds a device table"),
    (re.compile(r"^\s*def (matmul_params|layer_params|rank_params|total_params|adapter_layer_params|"
                r"activation_bytes_per_token|ring_bytes|estimate_memory|estimate_ranks)\s*\(", re.M),
     "defines a counting function of megaft.perf"),
    # a FLOP factor times a model dimension: 2/4/6/12 * dim, heads, ffn, vocab or layers
    (re.compile(r"\b(2|4|6|12)\.0\s*\*\s*[\w.]*\b(dim|n_heads|hd|ffn_dim|vocab_size|n_layers)\b"), "counts FLOPs"),
)


def counting_sites(source: str) -> list[str]:
    return [f"line {source[:m.start()].count(chr(10)) + 1}: {why}"
            for pattern, why in COUNTING for m in pattern.finditer(source)]


def test_only_megaft_perf_counts_flops_and_bytes():
    found = {name: sites for name, path in modules().items()
             if not (name == "megaft.perf" or name.startswith("megaft.perf."))
             and (sites := counting_sites(open(path).read()))}
    assert found == {}, found
    # the guard can fail: the code it replaced is caught
    planted = ("PEAK_TFLOPS = ()\ndef flops_per_token(m, seq):\n"
               "    return 6.0 * m.n_layers + 12.0 * m.n_heads * seq\ndef layer_params(m, tp): pass\n")
    assert len(counting_sites(planted)) == 5, counting_sites(planted)


def test_docs_architecture_draws_the_folders_in_order():
    # docs/architecture.md's table is drawn from FOLDERS: one row per folder (or group of tools), lowest first
    path = os.path.join(os.path.dirname(ROOT), "docs", "architecture.md")
    drawn = []
    for line in open(path):
        if line.startswith("| `"):
            first = line.split("|")[1]
            drawn += [f"megaft.{name.rstrip('/')}" for name in re.findall(r"`([\w/]+)`", first)]
    assert drawn == [f for f in FOLDERS if f != "megaft"]
