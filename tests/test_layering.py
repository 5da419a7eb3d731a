"""The import structure of megaft: no cycles, and every import points down the layers.

The layers, lowest first (docs/architecture.md); a module may import from its own
layer and the layers below. A module's layer is that of its longest matching prefix,
so a component's config dataclass can sit in the config layer while its code sits
higher (megaft.training.config, megaft.launch.config).

Every prefix is also a folder (a package, or a module at the top of megaft/), and the
prefixes are listed lowest first inside each layer too: between folders, an import may
only point to a folder listed earlier, so no two folders import each other, even in
one layer (megaft-report reads megaft-scale's study, so megaft.scale sits below it).
"""
from __future__ import annotations

import ast
import os
import re

import pytest

import megaft

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("megaft.fileio", "megaft.signals", "megaft.checks", "megaft.cli_args", "megaft.device")),
    # the grid and plain collectives, then one folder per parallel concept that the layers use
    ("parallel", ("megaft.parallel", "megaft.parallel.tensor", "megaft.parallel.context", "megaft.parallel.expert")),
    ("kernels", ("megaft.kernels",)),
    ("layers", ("megaft.layers",)),
    ("models", ("megaft.models",)),
    ("peft", ("megaft.peft",)),
    ("optim", ("megaft.optim",)),
    # data parallelism and ZeRO shard the optimizer of megaft.optim: above it
    ("data parallel", ("megaft.parallel.data",)),
    ("pipeline", ("megaft.pipeline",)),
    ("checkpoint", ("megaft.checkpoint",)),
    ("data", ("megaft.data",)),
    ("pref", ("megaft.pref",)),  # preference tuning: pairs (megaft.data's formats), log-probs, losses
    ("config", ("megaft.training.config", "megaft.launch.config", "megaft.verify.config", "megaft.commbench.config",
                "megaft.perf", "megaft.plan.config", "megaft.eval.config", "megaft.training.wandb_config",
                "megaft.config")),
    ("training", ("megaft.training",)),
    ("launch", ("megaft.launch",)),
    ("entry", ("megaft.plan", "megaft.scale", "megaft.report", "megaft.eval", "megaft.chat", "megaft.prepare",
               "megaft.verify", "megaft.commbench",
               "megaft.configdoc", "megaft.train", "megaft.score", "megaft.conf", "megaft.cli", "megaft")),
]
RANK = {name: i for i, (name, _) in enumerate(LAYERS)}
FOLDERS = [p for _, prefixes in LAYERS for p in prefixes]  # lowest first
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
    """The longest prefix of LAYERS that `name` falls under: its folder (or leaf, for a config)."""
    return max((p for p in FOLDERS if name == p or name.startswith(p + ".")), key=len)


def layer_of(name: str) -> str:
    return next(layer for layer, prefixes in LAYERS if folder_of(name) in prefixes)


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


def test_every_module_has_a_layer():
    assert [m for m in modules() if not any(m == p or m.startswith(p + ".") for _, ps in LAYERS for p in ps)] == []


def test_no_import_cycles():
    assert find_cycle(graph()) is None, " -> ".join(find_cycle(graph()))


def test_imports_point_down_the_layers():
    upward = sorted(f"{a} ({layer_of(a)}) imports {b} ({layer_of(b)})" for a, deps in graph().items()
                    for b in deps if RANK[layer_of(b)] > RANK[layer_of(a)])
    assert upward == [], "\n".join(upward)


def test_imports_point_down_the_folders():
    # One home per concept: between folders (plan, scale, report, launch, training, the parallel
    # concepts...) an import points only to a folder listed earlier, within a layer too.
    upward = upward_between_folders(graph())
    assert upward == [], "\n".join(upward)


def test_the_folder_checker_finds_upward_imports():
    # The guard must be able to fail: the upward imports this check removed (issue 23) are caught.
    planted = {"megaft.scale.app": {"megaft.report", "megaft.plan.multirun"},  # megaft-scale calling report.main
               "megaft.plan.app": {"megaft.train"},  # the tools took conf_dir from the Hydra app
               "megaft.launch.elastic": {"megaft.plan.replan"},  # the elastic re-plan below the planner
               "megaft.optim.adamw": {"megaft.parallel.data.flat"},  # the optimizer math on the ZeRO folder
               "megaft.parallel.context.batch": {"megaft.models.docs"}}  # cp sharding building Docs
    assert upward_between_folders(planted) == [
        "megaft.launch.elastic (megaft.launch) imports megaft.plan.replan (megaft.plan)",
        "megaft.optim.adamw (megaft.optim) imports megaft.parallel.data.flat (megaft.parallel.data)",
        "megaft.parallel.context.batch (megaft.parallel.context) imports megaft.models.docs (megaft.models)",
        "megaft.plan.app (megaft.plan) imports megaft.train (megaft.train)",
        "megaft.scale.app (megaft.scale) imports megaft.report (megaft.report)"]
    assert upward_between_folders({"megaft.report": {"megaft.scale.report"}, "megaft.train": {"megaft.plan.replan"},
                                   "megaft.parallel.data.zero": {"megaft.optim.adamw"}}) == []
    assert folder_of("megaft.parallel.context.ring") == "megaft.parallel.context"
    assert folder_of("megaft.parallel.grid") == "megaft.parallel"
    assert folder_of("megaft.configdoc") == "megaft.configdoc"
    assert folder_of("megaft.training.config") == "megaft.training.config"


def test_the_checker_finds_cycles_and_upward_imports():
    # The guard must be able to fail: a planted cycle and a planted upward edge are caught.
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    assert RANK[layer_of("megaft.kernels.rmsnorm")] < RANK[layer_of("megaft.layers.norm")]
    assert layer_of("megaft.training.config") == "config" and layer_of("megaft.training.loop") == "training"


@pytest.mark.parametrize("name", ["megaft.parallel.grid", "megaft.kernels.rmsnorm", "megaft.models.decoder",
                                  "megaft.parallel.context", "megaft.parallel.data"])
def test_low_layers_import_without_the_high_ones(name):
    # Importing a low-layer module in a fresh interpreter must not pull in the trainer or launcher.
    import subprocess
    import sys

    code = (f"import sys, {name}; bad = [m for m in sys.modules if m.startswith(('megaft.training.loop', "
            "'megaft.launch', 'megaft.config'))]; print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


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
