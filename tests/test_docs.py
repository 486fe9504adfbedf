"""The docs hold together: the README stays short, every relative link resolves, and the architecture
table in the docs is the registry's (generated, never hand-copied)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from depthtools.arch.doc_table import DOC_PAGE, registry_markdown_table, table_in_page

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "benchmarks" / "RESULTS.md"]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _relative_links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold commands, not links
    return [t for t in LINK.findall(text) if not re.match(r"^[a-z]+:", t) and not t.startswith("#")]


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    missing = [t for t in _relative_links(page) if not (page.parent / t.split("#", 1)[0]).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to missing files: {missing}"


def test_link_checker_sees_a_broken_link(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("[ok](p.md) [gone](nothere.md) [web](https://example.org) ```[code](x.md)```")
    assert [t for t in _relative_links(page) if not (page.parent / t).exists()] == ["nothere.md"]


def test_architecture_table_is_generated_from_the_registry():
    table = table_in_page(DOC_PAGE.read_text())
    assert table == registry_markdown_table(), "regenerate it: python -m depthtools.arch.doc_table --write"
    from depthtools.arch import list_archs

    assert len(table.splitlines()) == 2 + len(list_archs())


def test_archs_markdown_prints_the_same_table():
    out = subprocess.run([sys.executable, "-m", "cli", "archs", "--markdown"], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout
    assert out.strip() == registry_markdown_table()
