"""The README's main job end to end (`depthtools demo --preset tiny`), its re-run, and the example notebook.

One real run: the default corpus is prepared from installed packages, the tiny preset's twelve cells
are trained on CPU, the whole probe suite runs, and the grid report is written. The notebook then
executes top to bottom (nbclient, a real kernel) on one of the trained checkpoints.
"""

import os
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app
from depthtools.presets import get_preset
from depthtools.train.loop import is_finished

NOTEBOOK = Path(__file__).resolve().parent.parent / "examples" / "explore_depth.ipynb"


def _demo(root: Path):
    return CliRunner().invoke(app, [
        "demo", "--preset", "tiny", "--root", str(root / "checkpoints"), "--data-root", str(root / "data"),
        "--reports", str(root / "reports"), "--threads", "1",
    ])


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    # DEPTHTOOLS_TEST_DEMO_DIR keeps the run between sessions (the demo resumes), for quick iteration.
    keep = os.environ.get("DEPTHTOOLS_TEST_DEMO_DIR")
    root = Path(keep) if keep else tmp_path_factory.mktemp("demo")
    result = _demo(root)
    assert result.exit_code == 0, result.output + repr(result.exception)
    return root, result.output


def test_demo_trains_every_cell_and_writes_the_report(demo):
    root, output = demo
    grid = root / "checkpoints" / "tiny"
    cells = [c["name"] for c in get_preset("tiny").grid_spec()["cells"]]
    assert len(cells) == 12
    for cell in cells:
        assert is_finished(grid / cell), cell
        assert (grid / cell / "analysis" / "lens_logit.parquet").is_file(), cell
        assert (grid / cell / "analysis" / "ablate_skip.parquet").is_file(), cell
    assert (grid / "analysis" / "effective_depth_grid.parquet").is_file()
    report = root / "reports" / "tiny" / "index.html"
    html = report.read_text()
    assert str(report) in output.replace("\n", "")
    for arch in ("preln", "lns", "hc", "attnres"):
        assert f"{arch}_L8" in html
    assert "data:image/png;base64," in html or "data:image/svg+xml" in html
    # CliRunner's output is not a terminal: plain lines, stamped with the elapsed time (issue 35, item 10)
    stamped = [line for line in output.splitlines() if re.match(r"^\[\d+:\d\d\] ", line)]
    for cell in cells:
        assert any(line.split("] ", 1)[1].startswith("train: ") and cell in line for line in stamped), cell
    for stage in ("data", "train", "analyze", "summary", "tasks", "report"):
        assert any(f"] {stage}: done in " in line for line in stamped), stage


def test_demo_rerun_reuses_what_is_done(demo):
    root, _ = demo
    grid = root / "checkpoints" / "tiny"
    watched = sorted(grid.glob("*/model.safetensors")) + sorted(grid.glob("*/analysis/*.parquet"))
    before = {p: p.stat().st_mtime_ns for p in watched}
    again = _demo(root)
    assert again.exit_code == 0, again.output
    assert {p: p.stat().st_mtime_ns for p in watched} == before  # nothing retrained or recomputed
    assert (root / "reports" / "tiny" / "index.html").is_file()


def test_notebook_runs_top_to_bottom(demo, monkeypatch):
    import nbclient  # in the [dev] extra: a missing kernel stack must fail, not skip
    import nbformat

    root, _ = demo
    monkeypatch.setenv("DEPTHTOOLS_CKPT", str(root / "checkpoints" / "tiny" / "hc_L4"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(root)}}).execute()  # raises on any cell error
    outputs = [o for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 3  # lens curves, skip bars, CKA heatmap
    assert any("hc: L=4" in o.get("text", "") for o in outputs)
