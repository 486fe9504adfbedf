"""The rough edges a new user meets with an imported model (issue 38 part 6): `info` says finished and where
it came from, the report does not ask to finish training, a wide causal matrix is not squeezed into "2…"
cells, the lens figure's y-range is not set by depth 0, `summarize` on one model is quiet, and a set of
models that are not iso-parameter is not called a grid of equal size."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from cli.main import app

from tiny_models import one_thread  # noqa: F401  (autouse: torch on one thread)

runner = CliRunner()


@pytest.fixture
def imported(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from test_pretrained_data import hf_folder

    monkeypatch.setenv("DEPTHTOOLS_CHECKPOINTS", str(tmp_path / "ckpts"))
    folder = hf_folder(tmp_path)
    assert runner.invoke(app, ["import-hf", str(folder), "--name", "tiny"]).exit_code == 0
    return tmp_path / "ckpts" / "tiny", folder


def test_info_on_an_imported_model_says_finished_and_imported(imported):
    ckpt, folder = imported
    result = runner.invoke(app, ["info", "--ckpt", str(ckpt), "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert info["finished"] is True
    assert info["provenance"] == f"imported from huggingface-llama {folder.resolve()}"


def test_report_of_an_imported_model_misses_no_training(imported):
    from depthtools.report.data import read_cell

    ckpt, _ = imported
    cell = read_cell(ckpt)
    assert not any("training has not finished" in why or "training curve" in why for _, why in cell.missing), cell.missing


def test_wide_causal_matrix_is_printed_in_blocks_without_truncation():
    from rich.console import Console

    from cli.main import fmt, table
    from cli.probe_cmd import column_blocks

    columns = list(range(1, 30))  # a 30-layer model
    blocks = column_blocks(columns, 80)
    assert [c for b in blocks for c in b] == columns and len(blocks) > 1
    console = Console(width=80, record=True)
    for block in blocks:
        console.print(table("m", ["s", *map(str, block)], [["3", *(fmt(-0.0001234567) for _ in block)]]))
    text = console.export_text()
    assert "…" not in text and text.count("-0.0001235") == len(columns)


def test_lens_figure_range_is_not_set_by_depth_zero():
    from depthtools.report.figures import plot_lens_curves

    rows = [{"model": "m", "lens": "logit", "rel_depth": l / 30, "kl_final_lens": 114.0 if l == 0 else 2.0 - l / 30,
             "ce": 120.0 if l == 0 else 5.0 - l / 30, "top1_agree": l / 30} for l in range(31)]
    fig = plot_lens_curves(pd.DataFrame(rows), ["m"])
    kl_axis = fig.axes[0]
    low, high = kl_axis.get_ylim()
    assert high < 10  # layers 1-30 (1..2 nats) fill the panel; depth 0's 114 nats is off scale and noted
    assert any("off scale" in t.get_text() for t in kl_axis.texts)


def test_summarize_slopes_of_one_model_are_quiet():
    from depthtools.analysis.summary import grid_slopes

    rng = np.random.default_rng(0)
    rows = [{"metric": "ce_intact", "seq": s, "layer": -1, "value": float(rng.random())} for s in range(6)]
    rows += [{"metric": "skip_kl", "seq": s, "layer": l, "value": float(rng.random())} for s in range(6) for l in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # "Mean of empty slice" would raise here
        out = grid_slopes([(3, pd.DataFrame(rows))], n_boot=20)
    assert out["n_models"] == 1


def test_not_iso_parameter_models_are_said_to_be():
    from depthtools.report.build import parameter_spread

    grid = pd.DataFrame({"arch": ["preln"] * 3, "params": [1.00e6, 1.02e6, 0.99e6]})
    pythia = pd.DataFrame({"arch": ["preln"] * 3, "params": [70e6, 160e6, 410e6]})
    assert parameter_spread(grid) < 1.1 and parameter_spread(pythia) > 5


def test_comparison_of_different_sizes_says_not_iso_parameter(tmp_path):
    from depthtools import checkpoint as ck
    from depthtools.report.build import model_report

    from tiny_models import tiny

    for L in (2, 3, 8):  # same width, so more layers = more parameters (like a family of real model sizes)
        ck.save(tiny("preln", L, vocab=40, context=32, seed=0, at_init=True), tmp_path / f"m{L}")
    small = ck.read_json(tmp_path / "m2" / ck.CONFIG)["params"]["total"]
    big = ck.read_json(tmp_path / "m8" / ck.CONFIG)["params"]["total"]
    assert big / small > 2
    html = model_report([tmp_path / "m2", tmp_path / "m8"], tmp_path / "r.html").read_text()
    assert "not iso-parameter" in html
    close = model_report([tmp_path / "m2", tmp_path / "m3"], tmp_path / "r2.html").read_text()
    ratio = ck.read_json(tmp_path / "m3" / ck.CONFIG)["params"]["total"] / small
    assert ("not iso-parameter" in close) == (ratio > 1.1)
