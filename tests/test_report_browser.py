"""The grid report in a real browser (Debian's chromium through Playwright): no console or page errors,
every figure decoded and laid out, sortable tables, CSV downloads, hostile names inert, a screenshot.

Uses the system chromium only (never `playwright install`); skipped when /usr/bin/chromium is absent.
The screenshot lands in $DEPTHTOOLS_ARTIFACTS (default: the test's tmp_path).
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
from pathlib import Path

import pytest

from report_fixtures import TinyGrid, eval_losses, parse_report, tiny_grid  # noqa: F401 (fixture)
from tiny_models import one_thread  # noqa: F401 (fixture)

CHROMIUM = Path("/usr/bin/chromium")
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]

pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="no system chromium at /usr/bin/chromium")


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        yield chromium
        chromium.close()


class Watched:
    """A page plus everything it reported: console messages, page errors, dialogs, network requests."""

    def __init__(self, browser, viewport=(1280, 900)):
        self.context = browser.new_context(accept_downloads=True,
                                           viewport={"width": viewport[0], "height": viewport[1]})
        self.page = self.context.new_page()
        self.console, self.errors, self.dialogs, self.requests = [], [], [], []
        self.page.on("console", lambda m: self.console.append((m.type, m.text)))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("dialog", lambda d: (self.dialogs.append(d.message), d.dismiss()))
        self.page.on("request", lambda r: self.requests.append(r.url))

    def open(self, path: Path):
        self.page.goto(path.resolve().as_uri(), wait_until="load")
        return self.page

    def problems(self) -> list:
        return [m for m in self.console if m[0] in ("error", "assert")] + self.errors + self.dialogs

    def external_requests(self) -> list[str]:
        return [u for u in self.requests if not u.startswith(("file:", "data:", "blob:"))]


def column(page, table_id: str, name: str) -> list[str]:
    """The data-v values of one column of a table, in the current DOM order."""
    return page.eval_on_selector(
        f"#{table_id}-data",
        """(t, name) => {
             const i = [...t.tHead.rows[0].cells].findIndex(th => th.dataset.col === name);
             return [...t.tBodies[0].rows].map(r => r.cells[i].getAttribute('data-v'));
           }""", name)


def test_grid_report_works_in_chromium(tiny_grid: TinyGrid, browser, tmp_path):
    watched = Watched(browser)
    page = watched.open(tiny_grid.report)
    try:
        # every figure decoded and laid out
        images = page.eval_on_selector_all("figure img", """els => els.map(e => {
            const b = e.getBoundingClientRect();
            return {w: e.naturalWidth, h: e.naturalHeight, bw: b.width, bh: b.height, done: e.complete};
        })""")
        assert len(images) == len(parse_report(tiny_grid.report).figures) >= 9
        assert all(i["done"] and i["w"] > 0 and i["h"] > 0 and i["bw"] > 0 and i["bh"] > 0 for i in images), images

        # sorting: the cells table starts by name (hc_L2, hc_L4, preln_L2, preln_L4)
        before = column(page, "table-cells", "n_layer")
        page.click("#table-cells-data th[data-col='n_layer']")
        after = column(page, "table-cells", "n_layer")
        assert after == sorted(before, key=int) and after != before
        assert page.get_attribute("#table-cells-data th[data-col='n_layer']", "aria-sort") == "ascending"
        page.click("#table-cells-data th[data-col='val_loss']")
        page.click("#table-cells-data th[data-col='val_loss']")
        losses = [float(v) for v in column(page, "table-cells", "val_loss")]
        assert losses == sorted(losses, reverse=True)  # numeric, descending on the second click

        # CSV download of the table as sorted now, values at full precision
        with page.expect_download() as info:
            page.click("#table-cells button.csv-button")
        download = info.value
        assert download.suggested_filename == "table-cells.csv"
        rows = list(csv.DictReader(io.StringIO(Path(download.path()).read_text(encoding="utf-8"))))
        assert [r["model"] for r in rows] == column(page, "table-cells", "model")
        truth = eval_losses(tiny_grid.grid)
        assert {r["model"]: float(r["val_loss"]) for r in rows} == truth
        assert [float(r["val_loss"]) for r in rows] == sorted(truth.values(), reverse=True)

        # the table of contents jumps to its section
        page.click("#toc a[href='#probes']")
        assert page.evaluate("location.hash") == "#probes"
        assert page.eval_on_selector("#probes", "e => e.getBoundingClientRect().top") < 100

        artifacts = Path(os.environ.get("DEPTHTOOLS_ARTIFACTS") or tmp_path)
        artifacts.mkdir(parents=True, exist_ok=True)
        shot = artifacts / "grid_report.png"
        page.goto(tiny_grid.report.resolve().as_uri(), wait_until="load")
        page.screenshot(path=str(shot), full_page=True)
        data = shot.read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 20_000

        assert watched.problems() == []
        assert watched.external_requests() == []
    finally:
        watched.context.close()


def test_hostile_names_stay_text_in_the_browser(tiny_grid: TinyGrid, browser, tmp_path):
    """A checkpoint whose directory name and architecture carry markup: no dialog, no extra element."""
    from depthtools.report import model_report

    name = "preln_L2<img src=x onerror=alert(1)>"
    cell = tmp_path / "grid" / name
    shutil.copytree(tiny_grid.grid / "preln_L2", cell)
    config = json.loads((cell / "config.json").read_text())
    config["model"]["arch"] = "<script>alert(1)</script>"
    (cell / "config.json").write_text(json.dumps(config))
    out = model_report([cell], tmp_path / "hostile.html")

    watched = Watched(browser)
    page = watched.open(out)
    try:
        assert page.title() == f"Model report — {name}"
        assert page.eval_on_selector_all("script", "s => s.length") == 1
        assert page.eval_on_selector_all("img:not(figure img)", "s => s.length") == 0
        assert "<script>alert(1)</script>" in page.inner_text("#table-models-data")
        assert watched.problems() == [] and watched.dialogs == []
    finally:
        watched.context.close()


def test_report_of_an_imported_30_layer_model_in_chromium(browser, tmp_path, monkeypatch):
    """Issue 48: an imported 30-layer Gemma-3's report shows its family and provenance, no section that does not
    apply to a model trained elsewhere, and every figure laid out; the screenshot is saved for a look."""
    pytest.importorskip("transformers")
    from test_imported_first_class import TEXT, gemma3_folder
    from typer.testing import CliRunner

    from cli.main import app
    from depthtools.report import model_report

    monkeypatch.setenv("DEPTHTOOLS_CHECKPOINTS", str(tmp_path / "ckpts"))
    runner = CliRunner()
    folder = gemma3_folder(tmp_path, n_layer=30)
    assert runner.invoke(app, ["import-hf", str(folder), "--name", "gemma30"]).exit_code == 0
    (tmp_path / "text.txt").write_text(TEXT * 3, encoding="utf-8")
    for args in (["lens"], ["ablate", "--mode", "skip"], ["contrib", "--no-jacobian"]):
        result = runner.invoke(app, [*args, "--ckpt", "gemma30", "--text", str(tmp_path / "text.txt"),
                                     "--n-tokens", "64", "--seq-len", "32"])
        assert result.exit_code == 0, result.output
    report = model_report(["gemma30"], tmp_path / "gemma30.html")
    watched = Watched(browser)
    page = watched.open(report)
    try:
        sections = page.eval_on_selector_all("main section[id]", "els => els.map(e => e.id)")
        assert {"overview", "lens", "ablation", "contributions", "missing"} <= set(sections), sections
        assert not {"training", "depth-tasks", "routing"} & set(sections), sections
        assert "gemma3_text model imported from huggingface-gemma3_text" in page.inner_text("header")
        assert column(page, "table-models", "family") == ["gemma3_text"]
        assert page.is_visible("#table-provenance")
        images = page.eval_on_selector_all("figure img", "els => els.map(e => e.complete && e.naturalWidth > 0)")
        assert images and all(images)
        missing = page.inner_text("#missing")
        assert "--ckpt" in missing and "--text" in missing and "--grid" not in missing
        artifacts = Path(os.environ.get("DEPTHTOOLS_ARTIFACTS") or tmp_path)
        artifacts.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(artifacts / "imported_report.png"), full_page=True)
        assert watched.problems() == [] and watched.external_requests() == []
    finally:
        watched.context.close()
