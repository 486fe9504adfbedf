"""Training seeds as a grid axis, and seed-level statistics in summaries, figures and findings."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats
from typer.testing import CliRunner

from depthtools.analysis.seeds import contrast, depth_effects, seed_interval, seed_means
from depthtools.errors import DepthToolsError
from depthtools.grid import cell_name, parse_seeds, plan_grid
from depthtools.report import findings
from depthtools.train.sweep import cell_recipe, load_spec

# -- statistics against closed forms and scipy's own tests ------------------------------------------

def test_seed_interval_is_the_student_t_interval():
    values = [2.41, 2.44, 2.39, 2.47]
    iv = seed_interval(values)
    m, sd = np.mean(values), np.std(values, ddof=1)
    half = 3.182446305284263 * sd / 2  # t(0.975, df=3) · sd / sqrt(4)
    assert (iv.mean, iv.n) == (pytest.approx(m), 4)
    assert iv.lo == pytest.approx(m - half) and iv.hi == pytest.approx(m + half)
    assert iv.noise() == f"±{half:.3g} over 4 seeds"
    one = seed_interval([2.5, float("nan")])
    assert one.n == 1 and math.isnan(one.lo) and not one.has_noise and one.noise() == "one seed: no noise estimate"
    assert one.overlaps(seed_interval([9.0, 9.1]))  # nothing is resolved without a noise estimate


def test_contrast_matches_welchs_t_test():
    a, b = [0.10, 0.14, 0.12], [0.02, -0.01, 0.04, 0.00]
    c = contrast(a, b)
    expected = stats.ttest_ind(a, b, equal_var=False).confidence_interval(0.95)
    assert c.mean == pytest.approx(np.mean(a) - np.mean(b))
    assert (c.lo, c.hi) == (pytest.approx(expected.low), pytest.approx(expected.high))
    assert c.excludes_zero()


def _cells(values: dict[tuple[str, int], list[float]]) -> pd.DataFrame:
    rows = []
    for (arch, n_layer), losses in values.items():
        for seed, loss in enumerate(losses):
            rows.append({"model": cell_name(arch, n_layer, seed), "arch": arch, "n_layer": n_layer,
                         "d_model": 256 // n_layer, "seed": seed, "val_loss": loss})
    return pd.DataFrame(rows)


def test_depth_effects_pair_each_seeds_shallow_and_deep_cell():
    cells = _cells({("hc", 2): [2.0, 2.1, 2.2], ("hc", 8): [1.9, 2.05, 2.0]})
    (row,) = depth_effects(cells).to_dict(orient="records")
    assert row["per_seed"] == pytest.approx([-0.1, -0.05, -0.2])
    assert row["effect"] == pytest.approx(np.mean([-0.1, -0.05, -0.2])) and row["n_seeds"] == 3
    means = seed_means(cells).set_index("n_layer")
    assert means.loc[8, "val_loss"] == pytest.approx(np.mean([1.9, 2.05, 2.0])) and means.loc[8, "seeds"] == "0,1,2"


# -- findings: ties inside the seed noise, no ranking without it -------------------------------------

OVERLAPPING = {("preln", 2): [2.40, 2.50, 2.45], ("preln", 8): [2.46, 2.38, 2.52],
               ("hc", 2): [2.41, 2.49, 2.44], ("hc", 8): [2.43, 2.47, 2.37]}


def test_overlapping_seed_intervals_are_worded_as_ties():
    text = " ".join(findings.seed_noise(_cells(OVERLAPPING)) + findings.loss_vs_depth(_cells(OVERLAPPING))
                    + findings.lowest_loss(_cells(OVERLAPPING)))
    assert "3 training seeds per cell" in text
    assert "within seed noise" in text and "improves" not in text and "worsens" not in text
    assert "a tie within seed noise" in text  # hc's depth effect minus preln's
    assert "tied within seed noise with" in text  # the lowest loss is not a ranking
    assert "the grid is a pipeline check" in text


def test_separated_seed_intervals_are_ranked_and_one_seed_says_no_noise_estimate():
    separated = {("preln", 2): [2.40, 2.41, 2.42], ("preln", 8): [2.60, 2.61, 2.62],
                 ("hc", 2): [2.40, 2.41, 2.42], ("hc", 8): [2.30, 2.31, 2.33]}
    text = " ".join(findings.loss_vs_depth(_cells(separated)))
    assert "preln worsens by 0.200 nats from L2 to L8" in text and "hc improves by" in text
    assert "hc loses 0.297 nats less than preln" in text and "pipeline check" not in text
    single = _cells({k: v[:1] for k, v in separated.items()})
    text = " ".join(findings.seed_noise(single) + findings.loss_vs_depth(single) + findings.lowest_loss(single))
    assert "no seed-noise estimate exists" in text and "one seed: no noise estimate" in text
    assert "worsens" not in text and "improves" not in text
    assert "not ranked without a noise estimate" in text


def test_slope_findings_use_the_seed_interval():
    slopes = pd.DataFrame([
        {"arch": "hc", "n_seeds": 3, "slope_n_skip": 0.8, "slope_n_skip_lo": 0.5, "slope_n_skip_hi": 1.1,
         "slope_loss_log_L": -0.05, "slope_loss_log_L_lo": -0.12, "slope_loss_log_L_hi": 0.02},
        {"arch": "preln", "n_seeds": 3, "slope_n_skip": 0.6, "slope_n_skip_lo": 0.4, "slope_n_skip_hi": 0.8,
         "slope_loss_log_L": 0.09, "slope_loss_log_L_lo": 0.03, "slope_loss_log_L_hi": 0.15}])
    text = " ".join(findings.marginal_depth(slopes))
    assert "within seed noise of it, so the ranking is not resolved" in text
    assert "rises for preln" in text and "no trend beyond seed noise" in text and "hc (-0.05" in text


# -- seeds in the plan, the recipe and the names -----------------------------------------------------

def test_plan_grid_makes_one_cell_per_arch_depth_and_seed():
    cells = plan_grid(["preln", "hc"], 30_000, layers=[2, 4], n_heads=2, ffn_multiple=8, tolerance=0.25,
                      max_seq_len=32, seeds="0,1,2")
    assert [c.name for c in cells[:3]] == ["preln_L2", "preln_L2_s1", "preln_L2_s2"]
    assert len(cells) == 12 and {c.seed for c in cells} == {0, 1, 2}
    by_shape = {(c.arch, c.n_layer): c.d_model for c in cells if c.seed == 0}
    assert all(c.d_model == by_shape[(c.arch, c.n_layer)] for c in cells)  # seeds never change the shape
    assert parse_seeds(3) == [0, 1, 2] and parse_seeds(None) == [0]
    for bad in ("0,0", "a", [-1], 0):
        with pytest.raises(DepthToolsError):
            parse_seeds(bad)


def test_a_cell_trains_with_its_own_seed_and_a_contradicting_recipe_is_refused():
    (cell,) = [c for c in plan_grid("preln", 30_000, layers=[2], n_heads=2, ffn_multiple=8, tolerance=0.25,
                                    seeds=[0, 4]) if c.seed == 4]
    assert cell.name == "preln_L2_s4" and cell_recipe({"tokens": 100}, cell).seed == 4
    with pytest.raises(DepthToolsError, match="plan seeds as a grid axis"):
        cell_recipe({"seed": 1}, cell)
    before_seeds = {**{k: v for k, v in cell.__dict__.items() if k != "seed"}, "name": "preln_L2"}
    old = load_spec({"cells": [before_seeds]})  # a spec from before seeds: no seed field, no _s<seed> in names
    assert old["cells"][0].seed == 0
    with pytest.raises(DepthToolsError, match="the name states seed=4 but the cell trains seed=0"):
        load_spec({"cells": [{**before_seeds, "name": "preln_L2_s4"}]})


def test_tiny_preset_with_two_seeds_plans_trains_resolves_and_aggregates(tmp_path, monkeypatch):
    """The tiny preset with --seeds 0,1 (the preln cells at L2 and L4, a smaller token budget) through the CLI:
    plan, train, status, analyze, summarize, report, and `--ckpt preln_L2_s1`."""
    from cli.main import app
    from depthtools.checkpoint import read_config, resolve

    runner = CliRunner()

    def ok(*args):
        result = runner.invoke(app, list(args))
        assert result.exit_code == 0, f"{args}: {result.output}\n{result.exception!r}"
        return result

    spec_path = tmp_path / "tiny2.json"
    ok("grid", "plan", "--preset", "tiny", "--seeds", "0,1", "--name", "tiny2", "--out", str(spec_path))
    spec = json.loads(spec_path.read_text())
    assert spec["plan"]["seeds"] == [0, 1] and len(spec["cells"]) == 2 * 12
    cells = ["preln_L2", "preln_L2_s1", "preln_L4", "preln_L4_s1"]
    spec["train"] = {**spec["train"], "tokens": 8192, "eval_tokens": 2048}
    spec["cells"] = [c for c in spec["cells"] if c["name"] in cells]
    spec_path.write_text(json.dumps(spec))
    root = tmp_path / "ck"
    ok("grid", "train", str(spec_path), "--root", str(root), "--data-root", str(tmp_path / "data"))
    status = json.loads(ok("grid", "status", str(spec_path), "--root", str(root), "--json").stdout)
    assert sorted(s["cell"] for s in status if s["state"] == "done") == sorted(cells)
    monkeypatch.setenv("DEPTHTOOLS_CHECKPOINTS", str(root))
    assert resolve("preln_L2_s1") == root / "tiny2" / "preln_L2_s1"
    assert read_config("preln_L2_s1")["train"]["seed"] == 1 and read_config("preln_L2")["train"]["seed"] == 0
    w0 = resolve("preln_L2") / "model.safetensors"
    assert w0.read_bytes() != (resolve("preln_L2_s1") / "model.safetensors").read_bytes()  # another init
    grid = root / "tiny2"
    ok("analyze", "--grid", str(grid), "--n-tokens", "512", "--seq-len", "64", "--only", "sequence_profile,ablate_skip")
    summary = json.loads(ok("summarize", "--grid", str(grid), "--n-boot", "20", "--json").stdout)
    assert sorted((m["model"], m["seed"]) for m in summary["models"]) == [
        ("preln_L2", 0), ("preln_L2_s1", 1), ("preln_L4", 0), ("preln_L4_s1", 1)]
    (row,) = summary["grid"]
    assert row["n_seeds"] == 2 and row["n_models"] == 4 and row["interval"] == "t over seeds"
    assert row["slope_n_skip_lo"] <= row["slope_n_skip"] <= row["slope_n_skip_hi"]
    report = tmp_path / "r.html"
    ok("report", "--grid", str(grid), "-o", str(report))
    html = report.read_text()
    assert "2 training seeds per cell (seeds 0,1)" in html and "training seeds 0, 1" in html
    assert "table-seed-means" in html and "table-depth-effects" in html


def test_welch_combination_is_contrast_for_two_and_a_closed_form_for_four():
    from depthtools.analysis.seeds import welch_combination

    a, b, c, d = [1.0, 1.2, 0.9], [0.5, 0.4, 0.7], [2.0, 2.5, 2.2, 2.1], [0.1, 0.3]
    two, ref = welch_combination([a, b], [1, -1]), contrast(a, b)
    assert (two.mean, two.lo, two.hi) == pytest.approx((ref.mean, ref.lo, ref.hi), rel=1e-12)
    four = welch_combination([a, b, c, d], [1, -1, -1, 1])
    # by hand: the Welch-Satterthwaite interval of (mean a - mean b) - (mean c - mean d)
    v = [np.var(x, ddof=1) / len(x) for x in (a, b, c, d)]
    dof = sum(v) ** 2 / sum(vi**2 / (len(x) - 1) for vi, x in zip(v, (a, b, c, d)))
    value = (np.mean(a) - np.mean(b)) - (np.mean(c) - np.mean(d))
    half = stats.t.ppf(0.975, dof) * math.sqrt(sum(v))
    assert (four.mean, four.lo, four.hi) == pytest.approx((value, value - half, value + half), rel=1e-12)
    assert four.n == 2 and math.isnan(welch_combination([a, [1.0]], [1, -1]).lo)
