"""The import graph of depthtools/ has no circle (issue 36): KNOWN_CIRCLES is empty and must stay so.

How it is checked: every module under depthtools/ is parsed with `ast` (nothing is imported), and every import in
it -- at module level AND inside functions, classes, `try` blocks and `if TYPE_CHECKING:` blocks -- is an edge, as
is `importlib.import_module("<constant>")`. Imports under TYPE_CHECKING never run, but they are edges all the same
(issue 46): a module that types against another depends on it, and a circle through annotations is still a circle
for a reader and a type checker. Edges follow import-linter's convention: `from a.b import c` points at module
a.b.c when that is a module, else at a.b; the parent packages' `__init__` that Python runs on the way are not
edges (else every package would be a circle with its own `__init__`).

The layering it checks (issue 46): depthtools.config is below depthtools.arch. arch/ types against ModelConfig and
its registry installs the architecture checks into config; config imports nothing from arch/, not even lazily.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "depthtools"

# Circles outside arch/ not yet broken (issue 36, item 3), each as its sorted module set. Shrink this list as they
# are broken; the test fails when a listed circle no longer exists, so the list cannot go stale.
KNOWN_CIRCLES: list[set[str]] = []  # the last three (analysis suite/summary, data prepare/shards, interop
# llama/tokenizer) were broken in issue 36

# Dynamic imports whose target is not a constant (so not an edge): where they are and why they are acceptable.
DYNAMIC_IMPORTS = {
    "depthtools": "lazy public names (_LAZY): import depthtools stays torch-free; each target is listed in _LAZY",
    "depthtools.analysis": "lazy public names (_WHERE): importing the package imports no probe module",
    "depthtools.interop": "lazy public names (_WHERE): importing depthtools.interop.tokenizer loads no torch",
}


def _modules() -> dict[str, Path]:
    """{dotted name: file} of every module of the package."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(tree: ast.AST, module: str, is_package: bool):
    """(imports, lines of non-constant dynamic imports) of a parsed module; an import is a dotted name, or
    (module, name) for `from module import name`."""
    names, dynamic = [], []

    def visit(node: ast.AST) -> None:  # `if TYPE_CHECKING:` is an ordinary `if`: both branches are read
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module
            names.extend((prefix, alias.name) for alias in node.names)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module":
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                names.append(arg.value)
            else:
                dynamic.append(node.lineno)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return names, dynamic


def _resolve(imported: list, modules) -> set[str]:
    """The package's modules these imports point at: `from a.b import c` -> a.b.c if it is a module, else a.b;
    `import a.b.c` -> the longest of a.b.c, a.b, a that is a module."""
    out = set()
    for item in imported:
        if isinstance(item, tuple):
            prefix, name = item
            target = f"{prefix}.{name}" if f"{prefix}.{name}" in modules else prefix
        else:
            parts = item.split(".")
            target = next((".".join(parts[:k]) for k in range(len(parts), 0, -1) if ".".join(parts[:k]) in modules), None)
        if target in modules:
            out.add(target)
    return out


def import_graph() -> tuple[dict[str, set[str]], dict[str, list[int]]]:
    """({module: modules of the package it imports}, {module: lines of non-constant dynamic imports})."""
    modules = _modules()
    graph, dynamic = {}, {}
    for name, path in modules.items():
        imported, dyn = _imports(ast.parse(path.read_text(), str(path)), name, path.name == "__init__.py")
        if dyn:
            dynamic[name] = dyn
        graph[name] = _resolve(imported, modules) - {name}
    return graph, dynamic


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(component)

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_the_package_import_graph_has_no_circle_but_the_known_ones():
    graph, _ = import_graph()
    found = circles(graph)
    new = [sorted(c) for c in found if c not in KNOWN_CIRCLES]
    assert not new, f"import circle(s) in depthtools/: {new}"
    gone = [sorted(c) for c in KNOWN_CIRCLES if c not in found]
    assert not gone, f"circle(s) broken: remove them from KNOWN_CIRCLES: {gone}"
    assert not any(name.startswith("depthtools.arch") for c in found for name in c)


def test_arch_imports_nothing_above_it_but_the_config_it_validates():
    """depthtools.arch depends on itself, depthtools.errors and depthtools.config (the ModelConfig it builds from, in
    annotations and at the registry, which installs its checks there), run time and TYPE_CHECKING alike."""
    graph, _ = import_graph()
    allowed = {"depthtools.errors", "depthtools.config"}
    outside = {(m, t) for m, targets in graph.items() if m.startswith("depthtools.arch")
               for t in targets if not t.startswith("depthtools.arch") and t not in allowed}
    assert not outside, sorted(outside)


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module `start` imports, directly or through others (TYPE_CHECKING imports included)."""
    seen, todo = set(), [start]
    while todo:
        for target in graph.get(todo.pop(), ()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def test_config_imports_nothing_from_arch():
    """depthtools/config.py reaches no module of depthtools.arch, directly, lazily inside a function, under
    TYPE_CHECKING or through another module (issue 46: arch/ owns model-config validation)."""
    graph, _ = import_graph()
    assert graph["depthtools.config"], "the reader found no import in depthtools/config.py"
    reached = _reachable(graph, "depthtools.config")
    assert not {m for m in reached if m.startswith("depthtools.arch")}, sorted(reached)


def test_importing_config_loads_no_arch_module():
    """The same, as Python runs it: a fresh `import depthtools.config` (package __init__s included) loads no
    depthtools.arch module and no torch, and a ModelConfig built there checks its shape without the registry."""
    import subprocess
    import sys

    code = ("import sys; from depthtools.config import ModelConfig; ModelConfig(arch='preln', d_model=64, n_heads=4); "
            "print(sorted(m for m in sys.modules if m.startswith('depthtools.arch') or m == 'torch'))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PACKAGE.parent, timeout=300)
    assert proc.returncode == 0, proc.stderr.strip().splitlines()[-1:]
    assert proc.stdout.strip() == "[]", proc.stdout


def test_dynamic_imports_are_only_the_known_ones():
    """A non-constant importlib.import_module would hide an edge from the graph above."""
    _, dynamic = import_graph()
    assert set(dynamic) == set(DYNAMIC_IMPORTS), dynamic


def test_the_walker_sees_function_level_type_checking_and_dynamic_imports():
    """The walker itself: a circle through a function-level import, one through importlib and one through an import
    under TYPE_CHECKING (annotations only, but an edge all the same) are found."""
    sources = {
        "pkg.a": "def f():\n    from pkg import b\n",
        "pkg.b": "import pkg.a\n",
        "pkg.c": "import importlib\nimportlib.import_module('pkg.d')\n",
        "pkg.d": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.e import X\nfrom pkg import c\n",
        "pkg.e": "from pkg.d import Y\n",
    }
    graph = {}
    for name, text in sources.items():
        imported, _ = _imports(ast.parse(text), name, False)
        graph[name] = _resolve(imported, sources) - {name}
    assert sorted(map(sorted, circles(graph))) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d", "pkg.e"]]
    assert graph["pkg.d"] == {"pkg.c", "pkg.e"}  # the TYPE_CHECKING import is an edge


CLI_PACKAGE = PACKAGE.parent / "cli"


def test_every_cli_module_imports_on_its_own():
    """Each cli/ module imports in a fresh interpreter by itself (issue 46): before cli/app.py held the root app,
    `import cli.probe_cmd` failed on a circle through cli.main's command loading and cli.suite_cmd."""
    import subprocess
    import sys

    names = sorted(f"cli.{p.stem}" for p in CLI_PACKAGE.glob("*.py") if p.stem not in ("__init__", "__main__"))
    assert "cli.probe_cmd" in names and "cli.app" in names
    code = "import importlib, sys\nfor n in sys.argv[1:]:\n    importlib.import_module(n)\n"
    for name in names:  # one process each: an earlier import must not hide a circle in a later one
        proc = subprocess.run([sys.executable, "-c", code, name], capture_output=True, text=True,
                              cwd=PACKAGE.parent, timeout=300)
        assert proc.returncode == 0, f"import {name} failed: {proc.stderr.strip().splitlines()[-1:]}"


# Modules that write JSON or HTML (and the checkpoint readers they use) without torch (issue 46): grid specs, reports
# and tokenizer files are read and written by commands that never build a model.
TORCH_FREE = ["depthtools.checkpoint", "depthtools.grid", "depthtools.report.build", "depthtools.interop.tokenizer"]


def test_the_json_and_html_writers_import_without_torch():
    """Each module in a fresh interpreter of its own (an earlier import would hide a later one's torch)."""
    import subprocess
    import sys

    code = ("import importlib, sys; importlib.import_module(sys.argv[1]); "
            "print(sorted(m for m in ('torch', 'transformer_lens', 'safetensors.torch') if m in sys.modules))")
    for name in TORCH_FREE:
        proc = subprocess.run([sys.executable, "-c", code, name], capture_output=True, text=True,
                              cwd=PACKAGE.parent, timeout=300)
        assert proc.returncode == 0, f"import {name} failed: {proc.stderr.strip().splitlines()[-1:]}"
        assert proc.stdout.strip() == "[]", (name, proc.stdout)
