"""HTML reports on a real tiny trained grid: sections, embedded figures, tables, findings, missing data,
escaping, model and compare reports, and the `depthtools report` command."""

from __future__ import annotations

import base64
import io
import json
import math
import re
import shutil
import sys
from pathlib import Path

import pandas as pd
import pytest
from PIL import Image

from depthtools.analysis.tables import save_table
from depthtools.errors import DepthToolsError
from depthtools.report import grid_report, model_report

from report_fixtures import (  # noqa: F401 (fixtures)
    CELLS,
    GRID_FIGURES,
    GRID_SECTIONS,
    TinyGrid,
    eval_losses,
    invoke,
    parse_report,
    tiny_grid,
)
from tiny_models import one_thread  # noqa: F401 (fixture)

EVIL_NAME = "hc_L4<img src=x onerror=alert(1)>"  # a directory name cannot hold '/', so no closing tag here
EVIL_ARCH = "<script>alert(1)</script>"
SUITE = ("lens_logit", "lens_logit_summary", "ablate_skip", "ablate_prune", "ablate_swap", "similarity", "causal",
         "contrib", "routing", "sequence_profile")
MODEL_SECTIONS = ["overview", "findings", "training", "lens", "ablation", "causal", "similarity", "contributions",
                  "routing", "depth-tasks", "summary-metrics", "missing"]
TASK_COLUMNS = ["model", "arch", "n_layer", "d_model", "task", "k", "metric", "value", "in_train_range"]
TASKS = ("chase", "s5")
DEPTH_COLUMNS = ["model", "arch", "n_layer", "d_model", "task", "threshold", "depth_reached", "k_max_evaluated"]
MODEL_FIGURES = ["fig-training", "fig-lens", "fig-prediction-depth", "fig-skip", "fig-prune", "fig-swap", "fig-causal",
                 "fig-cka", "fig-geometry", "fig-contrib"]
PNG = b"\x89PNG\r\n\x1a\n"


def decode_image(uri: str) -> Image.Image:
    """Decode a data URI and check it is a real PNG (or SVG) image; returns the PNG as a PIL image."""
    match = re.fullmatch(r"data:image/(png|svg\+xml);base64,([A-Za-z0-9+/=]+)", uri)
    assert match, f"not a base64 image data URI: {uri[:60]}"
    raw = base64.b64decode(match.group(2), validate=True)
    if match.group(1) == "svg+xml":
        import xml.etree.ElementTree as ET

        assert ET.fromstring(raw).tag.endswith("svg")
        return None
    assert raw.startswith(PNG)
    Image.open(io.BytesIO(raw)).verify()
    return Image.open(io.BytesIO(raw))


# -- the grid report ------------------------------------------------------------------------------

def test_grid_report_has_every_section_figure_and_toc_entry(tiny_grid: TinyGrid):
    assert "wrote" in tiny_grid.cli_output and tiny_grid.report.is_file()
    r = parse_report(tiny_grid.report)
    assert r.title == "Depth report — mini"
    assert r.sections == GRID_SECTIONS
    assert set(GRID_SECTIONS) <= set(r.toc_links)
    assert set(GRID_FIGURES) <= set(r.figures)
    assert set(r.toc_links) <= set(r.sections) | set(r.figures) | set(r.tables)  # every TOC link has a target
    for fid in GRID_FIGURES:
        assert len(r.figures[fid]["caption"]) > 60, f"{fid} has no reading guide"
    assert not [n for n in r.notes if "could not be drawn" in n]
    # depth tasks were not run: the section says so and names the command
    command = f"depthtools tasks eval --grid {tiny_grid.grid}"
    assert any("Depth tasks were not run" in n and command in n for n in r.notes)
    assert any("Nothing is missing" in n for n in r.notes)
    assert r.scripts == 1  # one inline script, ours


def test_every_figure_is_a_valid_embedded_image_and_the_page_is_self_contained(tiny_grid: TinyGrid):
    r = parse_report(tiny_grid.report)
    assert len(r.images) == len(r.figures) >= len(GRID_FIGURES)
    for uri in r.images:
        image = decode_image(uri)
        if image is not None:
            assert image.width > 100 and image.height > 100
            assert image.width <= 1400, "figures are kept small"
    external = [u for u in r.urls if not (u.startswith("data:") or u.startswith("#"))]
    assert external == []
    html = tiny_grid.report.read_text()
    assert "default-src 'none'" in html and "http://" not in html and "https://" not in html
    assert tiny_grid.report.stat().st_size < 3_000_000


def test_grid_tables_have_one_row_per_model_or_arch_with_exact_values(tiny_grid: TinyGrid):
    r = parse_report(tiny_grid.report)
    cells = r.tables["table-cells"]
    assert cells.declared_rows == len(cells.rows) == len(CELLS)
    col = {c: i for i, c in enumerate(cells.columns)}
    by_model = {row[col["model"]]: row for row in cells.rows}
    assert set(by_model) == set(CELLS)
    for name, loss in eval_losses(tiny_grid.grid).items():
        assert float(by_model[name][col["val_loss"]]) == loss  # full precision in data-v
        assert by_model[name][col["arch"]] == name.split("_")[0]
        assert int(by_model[name][col["n_layer"]]) == int(name.split("_L")[1])
    summary = r.tables["table-effective-depth"]
    saved = pd.read_parquet(tiny_grid.grid / "analysis" / "effective_depth_models.parquet")
    assert len(summary.rows) == len(saved) == len(CELLS)
    s_col = {c: i for i, c in enumerate(summary.columns)}
    for row in summary.rows:
        expected = saved.set_index("model").loc[row[s_col["model"]], "n_skip_over_L"]
        assert float(row[s_col["n_skip_over_L"]]) == pytest.approx(expected, rel=1e-12)
    slopes = r.tables["table-slopes"]
    assert sorted(row[0] for row in slopes.rows) == ["hc", "preln"]
    assert {"slope_n_skip", "slope_n_skip_lo", "slope_n_skip_hi", "slope_loss_log_L_lo"} <= set(slopes.columns)


def test_findings_quote_numbers_from_the_tables(tiny_grid: TinyGrid):
    r = parse_report(tiny_grid.report)
    losses = eval_losses(tiny_grid.grid)
    text = " ".join(r.findings)
    assert "One training seed per cell: no seed-noise estimate exists" in text  # the fixture grid has one seed
    for arch in ("hc", "preln"):
        delta = losses[f"{arch}_L4"] - losses[f"{arch}_L2"]
        assert f"{arch} changes by {delta:+.3f} nats from L2 to L4 (one seed: no noise estimate)" in text
    assert "improves" not in text and "worsens" not in text  # a single run ranks nothing
    best = min(losses, key=losses.get)
    arch, depth = best.split("_L")
    assert f"Lowest final val loss: {arch} L{depth}" in text and "not ranked without a noise estimate" in text
    slopes = pd.read_parquet(tiny_grid.grid / "analysis" / "effective_depth_grid.parquet")
    top = slopes.loc[slopes["slope_n_skip"].idxmax()]
    assert f"Largest marginal effective depth: {top['arch']}, dN_skip/dL = {top['slope_n_skip']:.3g}" in text


# -- a damaged grid: missing cells and analyses, hostile names, depth-task tables ------------------

def _accuracy(k: int, n_layer: int) -> float:
    return max(0.0, min(1.0, 1.1 - 0.12 * k + 0.05 * n_layer))


def _lens_depth(k: int, n_layer: int) -> float:
    return min(float(n_layer), 0.5 * k + 1)


def _tasks_tables(cell_dir: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """tasks_eval and tasks_depth_reached tables in the schema `depthtools tasks eval` saves, filled with a
    fixed pattern (these tiny models never saw a task, so real accuracies would all be 0)."""
    config = json.loads((cell_dir / "config.json").read_text())["model"]
    ids = {"model": cell_dir.name, "arch": config["arch"], "n_layer": config["n_layer"], "d_model": config["d_model"]}
    rows, reached = [], []
    for task in TASKS:
        for k in range(1, 7):
            acc = _accuracy(k, config["n_layer"])
            lens = _lens_depth(k, config["n_layer"])
            for metric, value in (("accuracy", acc), ("answer_loss", -math.log(max(acc, 1e-3))),
                                  ("lens_first_depth", lens), ("lens_first_rel_depth", lens / config["n_layer"])):
                rows.append({**ids, "task": task, "k": k, "metric": metric, "value": value, "in_train_range": k <= 4})
        solved = [k for k in range(1, 7) if all(_accuracy(j, config["n_layer"]) >= 0.9 for j in range(1, k + 1))]
        reached.append({**ids, "task": task, "threshold": 0.9, "depth_reached": max(solved, default=0),
                        "k_max_evaluated": 6})
    return pd.DataFrame(rows, columns=TASK_COLUMNS), pd.DataFrame(reached, columns=DEPTH_COLUMNS)


def test_task_table_schema_matches_the_evaluator():
    from depthtools.analysis import tasks
    from depthtools.data.tasks import TASKS as GENERATED

    assert list(tasks.COLUMNS) == TASK_COLUMNS
    assert set(TASKS) <= set(GENERATED)
    assert list(tasks.DEPTH_COLUMNS) == DEPTH_COLUMNS


@pytest.fixture(scope="module")
def damaged(tiny_grid: TinyGrid, tmp_path_factory):
    """A copy of the grid with one unfinished cell, one cell never trained, one without analyses, a cell
    with a hostile name and architecture, and depth-task tables on some cells; plus its report."""
    grid = tmp_path_factory.mktemp("damaged") / "mini"
    shutil.copytree(tiny_grid.grid, grid)
    (grid / "hc_L2" / "eval.json").unlink()
    shutil.rmtree(grid / "preln_L2")  # planned in grid.json, never trained
    shutil.rmtree(grid / "preln_L4" / "analysis")
    evil = grid / EVIL_NAME
    shutil.copytree(grid / "hc_L4", evil)
    config = json.loads((evil / "config.json").read_text())
    config["model"]["arch"] = EVIL_ARCH
    (evil / "config.json").write_text(json.dumps(config))
    for name in ("hc_L4", EVIL_NAME):
        evaluated, reached = _tasks_tables(grid / name)
        save_table(evaluated, grid / name, "tasks_eval", {"analysis": "tasks_eval"})
        save_table(reached, grid / name, "tasks_depth_reached", {"analysis": "tasks_eval", "threshold": 0.9})
    out = grid.parent / "report.html"
    grid_report(grid, out)
    return grid, out


def test_missing_cells_and_tables_are_named_not_fatal(damaged):
    grid, out = damaged
    r = parse_report(out)
    assert r.sections == GRID_SECTIONS
    missing = r.tables["table-missing"]
    assert missing.columns == ["where", "missing", "how to get it"]
    rows = {(w, m) for w, m, _ in missing.rows}
    assert ("hc_L2", "eval.json") in rows
    assert ("preln_L2", "cell directory") in rows
    assert {("preln_L4", f"analysis/{t}.parquet") for t in SUITE} <= rows
    assert ("preln_L4", "analysis/tasks_eval.parquet") in rows  # tasks ran for some cells only
    assert any(w == "grid" and EVIL_NAME in m for w, m in rows)  # the summary predates the new cell
    how = {(w, m): h for w, m, h in missing.rows}
    assert f"depthtools analyze --grid {grid}" in how[("preln_L4", "analysis/causal.parquet")]
    # what can be drawn still is; the left-out cells are named under the figures
    assert {"fig-loss-vs-shape", "fig-lens-kl", "fig-cka-profile"} <= set(r.figures)
    assert any(n.startswith("Not shown (no eval.json): hc_L2") for n in r.notes)
    assert any("preln_L4" in n and "lens_logit table" in n for n in r.notes)
    cells = r.tables["table-cells"]
    assert len(cells.rows) == 4 and "hc_L2" in [row[0] for row in cells.rows]


def test_depth_task_section_when_tables_exist(damaged):
    _, out = damaged
    r = parse_report(out)
    assert "fig-depth-tasks" in r.figures and "hollow" in r.figures["fig-depth-tasks"]["caption"].lower()
    tasks = r.tables["table-depth-tasks"]
    assert len(tasks.rows) == 2 * 2  # two models with tasks × two tasks
    col = {c: i for i, c in enumerate(tasks.columns)}
    for row in tasks.rows:
        n_layer = int(row[col["n_layer"]])
        outside = (_accuracy(5, n_layer) + _accuracy(6, n_layer)) / 2
        inside = sum(_accuracy(k, n_layer) for k in range(1, 5)) / 4
        assert float(row[col["accuracy_out_of_range"]]) == pytest.approx(outside)
        assert float(row[col["accuracy_in_range"]]) == pytest.approx(inside)
    assert "fig-task-lens-depth" in r.figures and "later in depth" in r.figures["fig-task-lens-depth"]["caption"]
    lens = r.tables["table-task-lens"]
    col = {c: i for i, c in enumerate(lens.columns)}
    assert len(lens.rows) == 2 * 2 * 6  # (two archs at L4) x two tasks x k = 1..6, one seed each
    for row in lens.rows:
        k = int(row[col["k"]])
        assert float(row[col["accuracy"]]) == pytest.approx(_accuracy(k, 4), abs=1e-3)
        assert float(row[col["lens_first_depth"]]) == pytest.approx(_lens_depth(k, 4), abs=1e-3)
        assert row[col["n_seeds"]] == "1"
    reached = r.tables["table-depth-reached"]
    k_solved = max(k for k in range(1, 7) if _accuracy(k, 4) >= 0.9)  # both cells with tasks have L = 4
    assert len(reached.rows) == 4
    assert {row[reached.columns.index("depth_reached")] for row in reached.rows} == {str(k_solved)}
    assert any(f.startswith("Depth task s5:") and f"k = {k_solved} at accuracy ≥ 0.9" in f for f in r.findings)


def test_hostile_names_and_config_strings_are_escaped(damaged):
    grid, out = damaged
    html = out.read_text()
    assert EVIL_ARCH not in html and "<img src=x" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "hc_L4&lt;img src=x onerror=alert(1)&gt;" in html
    assert html.count("<script") == 1
    r = parse_report(out)
    assert EVIL_NAME in [row[0] for row in r.tables["table-cells"].rows]  # shown as text, intact
    # a model report of the hostile checkpoint escapes the same way
    single = model_report([grid / EVIL_NAME], grid.parent / "evil.html")
    text = single.read_text()
    assert EVIL_ARCH not in text and "<img src=x" not in text and text.count("<script") == 1
    report = parse_report(single)
    assert report.title == f"Model report — {EVIL_NAME}" and report.sections == MODEL_SECTIONS
    assert "fig-tasks" in report.figures and len(report.tables["table-depth-tasks"].rows) == len(TASKS)


# -- model and compare reports ---------------------------------------------------------------------

def test_model_report_shows_every_probe_of_one_checkpoint(tiny_grid: TinyGrid, tmp_path):
    out = model_report([tiny_grid.grid / "hc_L4"], tmp_path / "hc.html")
    r = parse_report(out)
    assert r.title == "Model report — hc_L4"
    assert r.sections == MODEL_SECTIONS
    assert set(MODEL_FIGURES) | {"fig-routing"} <= set(r.figures)  # hc has native routing weights
    for uri in r.images:
        decode_image(uri)
    skip = pd.read_parquet(tiny_grid.grid / "hc_L4" / "analysis" / "ablate_skip.parquet")
    assert len(r.tables["table-skip"].rows) == len(skip)
    assert len(r.tables["table-models"].rows) == 1
    metrics = r.tables["table-summary-metrics"]
    assert metrics.columns == ["table", "metric", "hc_L4"]
    causal = pd.read_parquet(tiny_grid.grid / "hc_L4" / "analysis" / "causal.parquet").set_index("metric")
    row = next(row for row in metrics.rows if row[:2] == ["causal", "global_score"])
    assert float(row[2]) == causal.loc["global_score", "value"]
    assert any(f.startswith("hc_L4: skipping block") for f in r.findings)
    # `analyze` saved the per-token prediction depths, so the figure is their histogram (no fallback note)
    tokens = pd.read_parquet(tiny_grid.grid / "hc_L4" / "analysis" / "prediction_depth.parquet")
    summary = pd.read_parquet(tiny_grid.grid / "hc_L4" / "analysis" / "lens_logit_summary.parquet").iloc[0]
    assert len(tokens) == summary["n_tokens"] and tokens["prediction_depth"].between(0, 4).all()
    assert tokens["prediction_depth"].mean() == pytest.approx(summary["pd_mean"])
    assert not any("prediction-depth table" in note for note in r.notes)


def test_compare_report_puts_checkpoints_side_by_side(tiny_grid: TinyGrid, tmp_path, monkeypatch):
    monkeypatch.setenv("DEPTHTOOLS_CHECKPOINTS", str(tiny_grid.root))
    out = model_report(["hc_L4", "preln_L4"], tmp_path / "cmp.html")  # cell names, resolved under the root
    r = parse_report(out)
    assert r.title == "Compare — hc_L4 vs preln_L4"
    assert set(MODEL_FIGURES) <= set(r.figures)
    assert [row[0] for row in r.tables["table-models"].rows] == ["hc_L4", "preln_L4"]
    assert r.tables["table-summary-metrics"].columns == ["table", "metric", "hc_L4", "preln_L4"]
    assert any("No native routing weights" in n and "preln_L4" in n for n in r.notes)
    with pytest.raises(DepthToolsError, match="given twice"):
        model_report(["hc_L4", tiny_grid.grid / "hc_L4"], tmp_path / "x.html")
    with pytest.raises(DepthToolsError, match="unknown checkpoint 'nope_L4'"):
        model_report(["nope_L4"], tmp_path / "x.html")


# -- the command -----------------------------------------------------------------------------------

def test_report_command_default_output_and_one_line_errors(tiny_grid: TinyGrid, tmp_path, monkeypatch, capsys):
    from cli.main import main

    monkeypatch.chdir(tmp_path)
    result = invoke(["report", "--ckpt", str(tiny_grid.grid / "preln_L2")])
    assert (tmp_path / "reports" / "preln_L2.html").is_file() and "wrote reports/preln_L2.html" in result.output

    def run(*args) -> tuple[int, str]:
        monkeypatch.setattr(sys, "argv", ["depthtools", "report", *args])
        with pytest.raises(SystemExit) as exit_info:
            main()
        return exit_info.value.code, capsys.readouterr().err

    missing = tmp_path / "no_such_grid"
    code, err = run("--grid", str(missing))
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "does not exist" in err and str(missing) in err
    code, err = run("--grid", str(tiny_grid.grid), "--ckpt", "hc_L2")
    assert code == 2 and "either --grid DIR or one or more --ckpt" in err
    code, err = run("--grid", str(tiny_grid.grid), "-o", "report.pdf")
    assert code == 2 and "must be an .html file" in err
    empty = tmp_path / "empty_grid"
    empty.mkdir()
    code, err = run("--grid", str(empty))
    assert code == 2 and "no checkpoints" in err


def test_prediction_depth_histogram_keeps_its_model_legend():
    """The per-token histogram's legend (seaborn's, no labelled artists) survives being moved outside."""
    import numpy as np

    from depthtools.report import figures

    rng = np.random.default_rng(0)
    table = pd.concat([pd.DataFrame({"model": name, "n_layer": 8, "prediction_depth": rng.integers(0, 9, 200)})
                       for name in ("hc_L8", "preln_L8")])
    fig = figures.plot_prediction_depth(table, ["hc_L8", "preln_L8"])
    legend = fig.axes[0].get_legend()
    assert legend is not None and [t.get_text() for t in legend.get_texts()] == ["hc_L8", "preln_L8"]


def test_prune_figure_names_the_removal_curve_it_shows():
    """Issue 47: the default prune table has the single-skip-order curve, an opt-in one the greedy curve;
    the figure shows one removal curve per model (never Gromov's beside it) and its title says which."""
    from depthtools.report import figures

    base = {"model": "m", "n_layer": 4, "mode": "prune", "rule": "identity", "tau": 0.05}
    rows = [{**base, "method": method, "n_removed": k, "delta_ce": 0.01 * k}
            for method in ("skip_order", "gromov") for k in (1, 2, 3)]
    fig = figures.plot_prune_curves(pd.DataFrame(rows), ["m"])
    assert fig.axes[0].get_title() == "removal curve: single-skip order"
    greedy = [{**r, "method": "greedy"} for r in rows if r["method"] == "skip_order"]
    fig = figures.plot_prune_curves(pd.DataFrame(rows + greedy), ["m"])
    assert fig.axes[0].get_title() == "removal curve: greedy re-measured"
