"""Architecture knowledge lives in depthtools/arch/ (issue 46, item 1): no module outside it names an architecture.

How it is checked, as tests/test_import_graph.py checks circles: every module of depthtools/ outside depthtools/arch/
and of cli/ is parsed with `ast` (nothing is imported from it), and three things fail:

  (a) scheme class tests: `isinstance(x, C)` or `issubclass(x, C)` where C (a name or the attribute of a dotted
      name, alone or in a tuple) is a subclass of `ResidualScheme` defined in depthtools.arch (the base class
      itself is no architecture and is allowed). A per-architecture behaviour is a scheme hook instead;
  (b) imports of architecture code: any import, wherever it sits (module level, functions, `try`, `TYPE_CHECKING`),
      of an architecture module (one that registers architectures: `registry.ARCH_MODULES`), of a name from one,
      or of a scheme class by name from anywhere (`from depthtools.arch import HyperScheme`), and
      `importlib.import_module` of an architecture module;
  (c) architecture names as data: a string constant equal to a registered architecture name or alias used as
      an operand of a comparison (`arch == "mhc"`, `arch in ("hc", "mhc")`, also inside a tuple, list or set
      operand), as a key of a dict literal (a per-architecture table), as a `match` case value, or as the value
      of a module-level constant (`EXPORTABLE = ("preln",)`: the same comparison one name away).

Not failures: a name in a docstring, comment, help text, error message, or a default or argument value inside a
function or class (`ModelConfig.arch = "preln"`, `typer.Option("preln")`: which model to build, not how one
behaves), and strings that only look like names elsewhere (an f-string, a log line).
The registered names and aliases and the scheme classes are read from the registry, so a new architecture is
covered without editing this test.

ALLOWED lists the modules exempt from a rule, each with its reason; the test fails when an entry no longer finds
anything, so the list cannot go stale.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARCH = ROOT / "depthtools" / "arch"

# {(module, rule): why}. Keep it short: each entry is architecture knowledge that has a reason to sit outside arch/.
ALLOWED: dict[tuple[str, str], str] = {
    ("depthtools.presets", "names"): "a preset names the architectures it trains: that is what a preset is",
    ("depthtools.interop.olmo_core", "names"): (
        "the OLMo-core importer translates the fork's block types and connector kinds (its vocabulary, whose "
        "'hc'/'mhc'/'moda' happen to equal ours) into our architectures: a format's table, like a preset's list"),
    ("depthtools.interop.llama", "names"): (
        "the Hugging Face exporter names the one architecture it writes (EXPORTABLE: Pre-LN, the transformers "
        "families' block): the format's table"),
    ("depthtools.report.findings", "names"): (
        "the torch-free report names the baseline it contrasts with (REFERENCE_ARCH) and cannot ask the registry, "
        "which imports torch; test_the_report_baseline_is_the_registry_baseline keeps the two equal"),
}


def _modules() -> dict[str, Path]:
    """{dotted name: file} of every module outside depthtools/arch/: depthtools/ and cli/."""
    out = {}
    for top in ("depthtools", "cli"):
        for path in (ROOT / top).rglob("*.py"):
            if ARCH in path.parents:
                continue
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _knowledge() -> tuple[set[str], set[str], set[str]]:
    """(registered architecture names and aliases, scheme class names, architecture module names), from the
    registry itself."""
    from depthtools.arch import registry
    from depthtools.arch.scheme import ResidualScheme

    names = {alias for spec in registry.list_archs() for alias in (spec.name, *spec.aliases)}
    classes, todo = set(), list(ResidualScheme.__subclasses__())
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.__module__.startswith("depthtools.arch."):
            classes.add(cls.__name__)
    modules = {module.__name__ for module in registry.ARCH_MODULES}
    return names, classes, modules


def _tail(node: ast.expr) -> str | None:
    """The last identifier of a name or dotted attribute (`HyperScheme`, `hyper.HyperScheme` -> HyperScheme)."""
    if isinstance(node, ast.Name):
        return node.id
    return node.attr if isinstance(node, ast.Attribute) else None


def _constants(node: ast.expr) -> list[str]:
    """The string constants of an operand: itself, or the elements of a tuple, list or set display."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return []


def _scheme_tests(node: ast.AST, classes: set[str]) -> list[str]:
    """Rule (a) at one node: isinstance/issubclass on a scheme class."""
    if not (isinstance(node, ast.Call) and _tail(node.func) in ("isinstance", "issubclass") and len(node.args) == 2):
        return []
    target = node.args[1]
    named = [_tail(e) for e in target.elts] if isinstance(target, ast.Tuple) else [_tail(target)]
    return [f"line {node.lineno}: {_tail(node.func)}(..., {c})" for c in named if c in classes]


def _arch_imports(node: ast.AST, classes: set[str], arch_modules: set[str]) -> list[str]:
    """Rule (b) at one node: an import of an architecture module, of a name from one, or of a scheme class."""
    found = []
    if isinstance(node, ast.Import):
        found = [a.name for a in node.names if any(a.name == m or a.name.startswith(m + ".") for m in arch_modules)]
    elif isinstance(node, ast.ImportFrom) and node.module:
        for alias in node.names:
            full = f"{node.module}.{alias.name}"
            if node.module in arch_modules or full in arch_modules or alias.name in classes:
                found.append(full)
    elif isinstance(node, ast.Call) and _tail(node.func) == "import_module" and node.args:
        found = [c for c in _constants(node.args[0]) if c in arch_modules]
    return [f"line {node.lineno}: imports {name}" for name in found]


def _names_as_data(node: ast.AST, names: set[str]) -> list[str]:
    """Rule (c) at one node: an architecture name compared with, used as a dict key or as a match value."""
    if isinstance(node, ast.Compare):
        operands = [node.left, *node.comparators]
    elif isinstance(node, ast.Dict):
        operands = [k for k in node.keys if k is not None]
    elif isinstance(node, ast.MatchValue):
        operands = [node.value]
    else:
        return []
    hits = sorted({c for operand in operands for c in _constants(operand) if c in names})
    return [f"line {node.lineno}: {kind} {hit!r}" for hit in hits
            for kind in [{ast.Compare: "compares with", ast.Dict: "keys a table by"}.get(type(node), "matches")]]


def _named_constants(tree: ast.Module, names: set[str]) -> list[str]:
    """Rule (c) at module level: a constant whose value is an architecture name (or a display holding one)."""
    out = []
    for stmt in tree.body:
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
            out += [f"line {stmt.lineno}: a constant holds {c!r}" for c in _constants(stmt.value) if c in names]
    return out


def findings(source: str, names: set[str], classes: set[str], arch_modules: set[str]) -> dict[str, list[str]]:
    """{rule: [where, what]} of one module's source: rules "isinstance" (a), "imports" (b), "names" (c)."""
    tree = ast.parse(source)
    out: dict[str, list[str]] = {"isinstance": [], "imports": [], "names": _named_constants(tree, names)}
    for node in ast.walk(tree):
        out["isinstance"] += _scheme_tests(node, classes)
        out["imports"] += _arch_imports(node, classes, arch_modules)
        out["names"] += _names_as_data(node, names)
    return out


@pytest.fixture(scope="module")
def knowledge():
    return _knowledge()


def test_no_module_outside_arch_holds_architecture_knowledge(knowledge):
    found, used = [], set()
    for module, path in sorted(_modules().items()):
        for rule, hits in findings(path.read_text(), *knowledge).items():
            if hits and (module, rule) in ALLOWED:
                used.add((module, rule))
            elif hits:
                found += [f"{module} ({rule}) {hit}" for hit in hits]
    assert not found, "architecture knowledge outside depthtools/arch/ (move it behind a scheme/registry hook):\n" \
        + "\n".join(found)
    stale = sorted(set(ALLOWED) - used)
    assert not stale, f"ALLOWED entries that no longer find anything (remove them): {stale}"


def test_the_knowledge_is_read_from_the_registry(knowledge):
    """The rules see today's architectures: names, aliases, every scheme class and the architecture modules."""
    names, classes, arch_modules = knowledge
    assert {"preln", "sandwich", "hc", "mhc", "attnres", "blockattnres", "moda", "denseformer"} <= names
    assert {"NormFamilyScheme", "HyperScheme", "HCScheme", "MHCScheme", "AttnResScheme", "BlockAttnResScheme",
            "MoDAScheme", "DenseFormerScheme"} <= classes
    assert "ResidualScheme" not in classes
    assert {"depthtools.arch.hyper", "depthtools.arch.moda", "depthtools.arch.attnres"} <= arch_modules


def test_each_rule_fails_on_what_it_forbids_and_passes_the_rest(knowledge):
    """The walker itself, on small sources: what each rule catches, and what it lets through."""
    names, classes, arch_modules = knowledge
    bad = {
        "isinstance": ["isinstance(s, HyperScheme)\n", "isinstance(s, (int, hyper.MoDAScheme))\n",
                       "def f(s):\n    return issubclass(type(s), AttnResScheme)\n"],
        "imports": ["from depthtools.arch.hyper import legacy_options\n", "from depthtools.arch import hyper\n",
                    "import depthtools.arch.moda as m\n", "def f():\n    from depthtools.arch import MoDAScheme\n",
                    "import importlib\nimportlib.import_module('depthtools.arch.attnres')\n",
                    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from depthtools.arch.moda import MoDAState\n"],
        "names": ["if arch == 'mhc':\n    pass\n", "x = cfg.arch in ('preln', 'lns')\n", "ok = 'hc' != a\n",
                  "T = {'moda': 1}\n", "T = {'sandwich': {}}\n",
                  "match arch:\n    case 'attnres':\n        pass\n", "EXPORTABLE = ('preln',)\n",
                  "BASE: str = 'preln'\n"],
    }
    for rule, sources in bad.items():
        for source in sources:
            got = findings(source, names, classes, arch_modules)
            assert got[rule], f"rule {rule} missed: {source!r}"
            assert not any(hits for other, hits in got.items() if other != rule), (source, got)
    good = ["isinstance(s, ResidualScheme)\n", "from depthtools.arch import DepthModel, get_arch\n",
            "from depthtools.arch.model import Plan\n", "def f(arch='preln'):\n    return arch\n",
            "raise ValueError(f'{arch} is not mhc')\n", "def f():\n    x = ['preln', 'hc']\n",
            "if mode == 'normed_sum':\n    pass\n", "'''mhc and hc are documented here'''\n",
            "class C:\n    arch: str = 'preln'\n", "opt = Option('preln', help='attnres or hc')\n"]
    for source in good:
        got = findings(source, names, classes, arch_modules)
        assert not any(got.values()), (source, got)


def test_the_report_baseline_is_the_registry_baseline():
    """report/findings.py's REFERENCE_ARCH (allowed above: the report is torch-free) is the registered baseline."""
    from depthtools.arch import list_archs
    from depthtools.report.findings import REFERENCE_ARCH

    assert [spec.name for spec in list_archs() if spec.reference] == [REFERENCE_ARCH]
