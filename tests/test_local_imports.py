"""Function-local imports say why they are local (issue 36, item 3).

An import inside a function is allowed only for a reason, written as a comment on its line (any line of a
parenthesized import) or on the line just above, starting with one of the tags:

    # lazy: ...       keeps a light import light: `import depthtools`, depthtools.analysis and depthtools.data,
                      the CLI's modules before a command runs (no torch, TransformerLens, pandas, ...)
    # optional ...    an optional dependency (transformers, gguf, submitit, ray, zstandard, ...) or a
                      platform-only module (fcntl) that may be absent
    # heavy ...       a heavy library that one rare path alone needs (scipy for an interval, seaborn for a figure)

Anything else (a sibling depthtools module, the standard library) belongs at the top of the module:
tests/test_import_graph.py checks that the package has no import circle for a local import to hide.
Parsed with `ast` and `tokenize`: nothing is imported.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TAG = re.compile(r"#\s*(lazy|optional|heavy)\b")

# Files allowed an unexplained local import: none (the list must stay empty; a listed file with no offender fails).
ALLOWED: dict[str, str] = {}


def _comments(source: str) -> dict[int, str]:
    """{line: the comment on it}."""
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string
    return out


def local_imports(source: str) -> list[tuple[int, bool]]:
    """(line, has a reason tag) of every import inside a function (methods and nested functions included)."""
    tree = ast.parse(source)
    comments = _comments(source)
    lines = source.splitlines()
    out = []

    def justified(node: ast.stmt) -> bool:
        if any(TAG.search(comments.get(n, "")) for n in range(node.lineno, node.end_lineno + 1)):
            return True
        above = node.lineno - 1  # a comment line of its own just above
        return above >= 1 and lines[above - 1].lstrip().startswith("#") and bool(TAG.search(comments.get(above, "")))

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)) and in_function:
                out.append((child.lineno, justified(child)))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return out


def offenders() -> dict[str, list[int]]:
    """{file relative to the repository: lines of its local imports without a reason}."""
    out = {}
    for top in ("depthtools", "cli"):
        for path in sorted((ROOT / top).rglob("*.py")):
            bad = [line for line, ok in local_imports(path.read_text()) if not ok]
            if bad:
                out[path.relative_to(ROOT).as_posix()] = bad
    return out


def test_every_function_local_import_says_why():
    found = offenders()
    new = {f: lines for f, lines in found.items() if f not in ALLOWED}
    assert not new, ("function-local imports without a reason comment (# lazy: / # optional / # heavy, see this "
                     "test's docstring); hoist them to the top of the module or say why: "
                     + "; ".join(f"{f}: lines {lines}" for f, lines in sorted(new.items())))
    stale = sorted(set(ALLOWED) - set(found))
    assert not stale, f"no unexplained local import left in {stale}: remove them from ALLOWED"


def test_the_checker_sees_tags_on_the_line_or_above_and_nothing_else():
    source = (
        "import json\n"
        "def f():\n"
        "    import torch  # lazy: keeps the CLI torch-free\n"
        "    # optional dependency\n"
        "    import gguf\n"
        "    from depthtools.data.tokenizer import (BPETokenizer,\n"
        "                                           ByteTokenizer)  # heavy, one path\n"
        "    import re  # a comment that gives no reason\n"
        "    x = 1  # lazy\n"
        "    import os\n"
        "class C:\n"
        "    import math\n"
        "    def m(self):\n"
        "        def inner():\n"
        "            from depthtools import grid\n"
        "        return inner\n"
        "g = lambda: __import__('json')\n"
    )
    assert local_imports(source) == [(3, True), (5, True), (6, True), (8, False), (10, False), (15, False)]
