"""A real tiny trained and analysed grid for the report tests, built once per test session.

`tiny_grid` (session scope) prepares the fixture corpus, plans and trains 2 architectures × 2 depths
with the library (`plan_grid`, `grid_spec`, `train_grid`), runs `depthtools analyze` and
`depthtools summarize` through the CLI, and writes the grid report with `depthtools report`. Both
test_report.py and test_report_browser.py import the fixture; the build is memoised per session so it
runs once however many modules use it. `parse_report` reads a report back into plain structures
with the standard-library HTML parser.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from tiny_models import TINY_CORPUS, prepare_tiny

ARCHS = ("preln", "hc")
DEPTHS = (2, 4)
CELLS = tuple(f"{a}_L{n}" for a in ARCHS for n in DEPTHS)
TRAIN = dict(batch_size=8, seq_len=32, lr=1e-2, eval_tokens=512, log_every=5, eval_every=10, depth_stats_every=0,
             checkpoint_every=0, threads=1, tokens=20 * 8 * 32)
GRID_SECTIONS = ["overview", "findings", "loss-vs-shape", "domain-losses", "training-curves", "effective-depth",
                 "probes", "depth-tasks", "missing"]
GRID_FIGURES = ["fig-loss-vs-shape", "fig-domain-losses", "fig-training-curves", "fig-slopes", "fig-lens-kl",
                "fig-skip-dce", "fig-causal-profile", "fig-permutation-profile", "fig-cka-profile"]


@dataclass
class TinyGrid:
    root: Path  # DEPTHTOOLS_CHECKPOINTS-style root holding the grid
    grid: Path  # root/mini: one directory per cell
    report: Path  # the grid report written by `depthtools report --grid`
    cli_output: str


_BUILT: dict[Path, TinyGrid] = {}


def invoke(args: list[str]):
    """Run the depthtools CLI in-process; a failure shows the command output."""
    from cli.main import app

    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, f"depthtools {' '.join(args)} failed:\n{result.output}\n{result.exception!r}"
    return result


def build_tiny_grid(base: Path) -> TinyGrid:
    """Train, analyse and summarise the tiny grid under `base`, then write its report (about 20 s)."""
    from depthtools.grid import grid_spec, plan_grid, save_grid
    from depthtools.train.sweep import train_grid

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        data_dir = prepare_tiny(base / "data")
        cells = plan_grid(list(ARCHS), budget=30_000, layers=list(DEPTHS), n_heads=2, ffn_multiple=8,
                          tolerance=0.25, max_seq_len=32)
        spec = grid_spec(cells, name="mini", train=TRAIN, data={"corpus": "text-dir", "text_dir": str(TINY_CORPUS),
                                                                 "val_fraction": 0.3})
        root = base / "checkpoints"
        train_grid(spec, root=root, data_root=base / "data")
        grid = root / "mini"
        save_grid(spec, grid / "grid.json")  # the spec beside the cells lets a report name planned-but-absent cells
        invoke(["analyze", "--grid", str(grid), "--n-tokens", "256", "--seq-len", "32", "--data", str(data_dir)])
        invoke(["summarize", "--grid", str(grid), "--n-boot", "50"])
        report = base / "reports" / "mini.html"
        out = invoke(["report", "--grid", str(grid), "-o", str(report)])
    finally:
        torch.set_num_threads(threads)
    return TinyGrid(root=root, grid=grid, report=report, cli_output=out.output)


@pytest.fixture(scope="session")
def tiny_grid(tmp_path_factory) -> TinyGrid:
    key = tmp_path_factory.getbasetemp()
    if key not in _BUILT:
        _BUILT[key] = build_tiny_grid(tmp_path_factory.mktemp("report_grid"))
    return _BUILT[key]


# -- reading a report back -------------------------------------------------------------------------

@dataclass
class Table:
    columns: list[str] = field(default_factory=list)
    rows: list[list[str]] = field(default_factory=list)  # the data-v (full precision) values
    texts: list[list[str]] = field(default_factory=list)  # the displayed texts
    declared_rows: int = -1


@dataclass
class Report:
    title: str = ""
    sections: list[str] = field(default_factory=list)
    toc_links: list[str] = field(default_factory=list)
    figures: dict[str, dict] = field(default_factory=dict)  # id -> {"src", "caption"}
    tables: dict[str, Table] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    findings: list[str] = field(default_factory=list)
    images: list[str] = field(default_factory=list)  # every <img src>
    urls: list[str] = field(default_factory=list)  # every src/href
    scripts: int = 0


class _Parser(HTMLParser):
    """Collects what the tests check; text is captured from an opening tag to its closing tag."""

    CAPTURE_END = {"title": "title", "figcaption": "figcaption", "finding": "li", "note": "p", "td": "td"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.r = Report()
        self._figure: str | None = None
        self._table: Table | None = None
        self._in_toc = self._in_findings = self._in_tbody = False
        self._capture: str | None = None  # what the text belongs to
        self._text = ""

    def _start_capture(self, kind: str) -> None:
        self._capture, self._text = kind, ""

    def handle_starttag(self, tag, attrs):  # noqa: C901 (one branch per HTML element the report test checks)
        a = {k: (v or "") for k, v in attrs}
        for key in ("src", "href"):
            if a.get(key):
                self.r.urls.append(a[key])
        classes = a.get("class", "").split()
        if tag == "script":
            self.r.scripts += 1
        elif tag == "title":
            self._start_capture("title")
        elif tag == "section":
            self.r.sections.append(a.get("id", ""))
        elif tag == "nav" and a.get("id") == "toc":
            self._in_toc = True
        elif tag == "a" and self._in_toc and a.get("href", "").startswith("#"):
            self.r.toc_links.append(a["href"][1:])
        elif tag == "figure":
            self._figure = a.get("id", "")
            self.r.figures[self._figure] = {"src": None, "caption": ""}
        elif tag == "img":
            self.r.images.append(a.get("src", ""))
            if self._figure is not None:
                self.r.figures[self._figure]["src"] = a.get("src")
        elif tag == "figcaption":
            self._start_capture("figcaption")
        elif tag == "table":
            self._table = Table(declared_rows=int(a.get("data-rows", -1)))
            self.r.tables[a.get("id", "").removesuffix("-data")] = self._table
        elif tag == "th" and self._table is not None:
            self._table.columns.append(a.get("data-col", ""))
        elif tag == "tbody":
            self._in_tbody = True
        elif tag == "tr" and self._table is not None and self._in_tbody:
            self._table.rows.append([])
            self._table.texts.append([])
        elif tag == "td" and self._table is not None:
            self._table.rows[-1].append(a.get("data-v", ""))
            self._start_capture("td")
        elif tag == "ul" and "findings" in classes:
            self._in_findings = True
        elif tag == "li" and self._in_findings:
            self._start_capture("finding")
        elif tag == "p" and "note" in classes:
            self._start_capture("note")

    def handle_endtag(self, tag):
        if self._capture is not None and self.CAPTURE_END[self._capture] == tag:
            text, kind = self._text.strip(), self._capture
            self._capture = None
            if kind == "title":
                self.r.title = text
            elif kind == "figcaption" and self._figure is not None:
                self.r.figures[self._figure]["caption"] = text
            elif kind == "finding":
                self.r.findings.append(text)
            elif kind == "note":
                self.r.notes.append(text)
            elif kind == "td" and self._table is not None:
                self._table.texts[-1].append(text)
        if tag == "nav":
            self._in_toc = False
        elif tag == "figure":
            self._figure = None
        elif tag == "table":
            self._table = None
        elif tag == "tbody":
            self._in_tbody = False
        elif tag == "ul":
            self._in_findings = False

    def handle_data(self, data):
        if self._capture is not None:
            self._text += data


def parse_report(path_or_html: str | Path) -> Report:
    """The report's sections, TOC, figures, tables (data-v values), notes and findings."""
    html = Path(path_or_html).read_text(encoding="utf-8") if isinstance(path_or_html, Path) else path_or_html
    parser = _Parser()
    parser.feed(html)
    parser.close()
    return parser.r


def eval_losses(grid: Path) -> dict[str, float]:
    return {c: json.loads((grid / c / "eval.json").read_text())["val_loss"] for c in CELLS}
