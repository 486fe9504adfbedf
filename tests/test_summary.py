"""Effective-depth summary, grid slopes with bootstrap CIs, and the probe and suite commands on tiny checkpoints."""

import json
import math

import numpy as np
import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

import cli.main  # noqa: F401  (the app, with every command registered)
from cli.main import app
from depthtools import checkpoint as ck
from depthtools.analysis.ablate import ablate_skip
from depthtools.analysis.summary import SUMMARY_FIELDS, effective_depth_row, grid_slopes, sequence_profile
from depthtools.analysis.tables import model_columns

from tiny_models import (
    one_thread,  # noqa: F401 (fixture)
    tiny as tiny_model,
)


def tiny(arch="preln", n_layer=4, vocab=40, seed=0):
    """As initialised, float32."""
    return tiny_model(arch, n_layer, vocab=vocab, context=32, seed=seed, at_init=True)


def test_zeroed_blocks_reduce_n_skip_to_the_live_blocks():
    L, zeroed = 4, (1, 2)
    model = tiny(n_layer=L)
    with torch.no_grad():
        for b in zeroed:
            model.blocks[b].attn.w_o.weight.zero_()
            model.blocks[b].mlp.w2.weight.zero_()
    tokens = torch.randint(0, 40, (4, 13), generator=torch.Generator().manual_seed(2))
    skip = ablate_skip(model, tokens)
    row = effective_depth_row(model_columns(model), {"ablate_skip": skip})
    assert abs(row["n_skip_over_L"] * L - (L - len(zeroed))) < 0.5
    assert "n_skip_over_L" not in row["notes"] and "f_tau: no ablate prune table" in row["notes"]
    assert all(math.isnan(row[f]) for f in SUMMARY_FIELDS if f != "n_skip_over_L")
    # the per-sequence profile agrees with the sweep's token-averaged KL (equal tokens per sequence)
    profile = sequence_profile(model, tokens, batch_size=3)
    kl = profile[profile.metric == "skip_kl"].groupby("layer").value.mean().sort_index().to_numpy()
    assert kl[list(zeroed)] == pytest.approx([0.0, 0.0], abs=1e-9)
    assert kl == pytest.approx(skip.sort_values("layer").kl_intact_ablated.to_numpy(), rel=1e-4, abs=1e-9)


def _synthetic_profile(n_layer, n_seqs, rng, loss_slope):
    rows = []
    for s in range(n_seqs):
        rows.append({"seq": s, "layer": None, "metric": "ce_intact",
                     "value": 3.0 + loss_slope * np.log(n_layer) + 0.05 * rng.standard_normal()})
        for l in range(n_layer):
            rows.append({"seq": s, "layer": l, "metric": "skip_kl", "value": 1.0 + 0.1 * rng.random()})
    df = pd.DataFrame(rows)
    df["layer"] = df["layer"].astype("Int64")
    return df


def test_grid_slopes_one_seed_has_a_bootstrap_but_no_seed_interval():
    rng = np.random.default_rng(0)
    profiles = [(L, _synthetic_profile(L, 40, rng, loss_slope=-0.2)) for L in (2, 4, 8, 16)]
    out = grid_slopes(profiles, n_boot=200, seed=0)
    assert out["paired_bootstrap"] and out["n_models"] == 4 and out["n_seeds"] == 1
    assert out["slope_n_skip"] == pytest.approx(1.0, abs=0.02)  # near-equal importances: N_skip ≈ L
    assert math.isnan(out["slope_n_skip_lo"]) and math.isnan(out["slope_n_skip_hi"])  # one seed: no noise estimate
    assert out["interval"] == "none (one seed)"
    assert out["slope_n_skip_boot_lo"] <= out["slope_n_skip"] <= out["slope_n_skip_boot_hi"]
    assert out["slope_loss_log_L_boot_lo"] < -0.2 < out["slope_loss_log_L_boot_hi"]
    assert out["slope_loss_log_L_boot_hi"] - out["slope_loss_log_L_boot_lo"] < 0.1


def test_grid_slopes_are_fitted_per_seed_with_a_t_interval_across_seeds():
    """Three seeds with different true loss slopes: the mean and interval equal an explicit per-seed
    polyfit followed by mean ± t(0.975, 2)·sd/sqrt(3)."""
    rng = np.random.default_rng(1)
    layers = (2, 4, 8)
    true = {0: -0.30, 1: -0.10, 2: -0.20}
    profiles = [(L, _synthetic_profile(L, 30, rng, loss_slope=true[s]), s) for s in true for L in layers]
    out = grid_slopes(profiles, n_boot=50, seed=0)
    assert out["n_seeds"] == 3 and out["n_models"] == 9 and out["seeds"] == "0,1,2"
    fitted = []
    for s in true:
        loss = [_profile_ce(p) for L, p, seed in profiles if seed == s]
        fitted.append(np.polyfit(np.log(layers), loss, 1)[0])
    mean, sd = np.mean(fitted), np.std(fitted, ddof=1)
    half = 4.302652729911275 * sd / math.sqrt(3)  # scipy-independent: t(0.975, df=2)
    assert out["slope_loss_log_L"] == pytest.approx(mean, abs=1e-12)
    assert out["slope_loss_log_L_lo"] == pytest.approx(mean - half, abs=1e-9)
    assert out["slope_loss_log_L_hi"] == pytest.approx(mean + half, abs=1e-9)
    # the seed interval is far wider than the evaluation-sequence bootstrap at this noise level
    assert out["slope_loss_log_L_hi"] - out["slope_loss_log_L_lo"] > 2 * (
        out["slope_loss_log_L_boot_hi"] - out["slope_loss_log_L_boot_lo"])


def _profile_ce(profile: pd.DataFrame) -> float:
    return float(profile[profile["metric"] == "ce_intact"]["value"].mean())


def test_cli_single_commands_analyze_and_summarize(tmp_path, data_dir, monkeypatch):
    data = data_dir  # read only
    grid = tmp_path / "grid"
    for L in (2, 3):
        ck.save(tiny(n_layer=L, vocab=256), grid / f"preln_L{L}", extra={"data": {"path": str(data)}})
    monkeypatch.setenv("DEPTHTOOLS_CHECKPOINTS", str(tmp_path))
    runner = CliRunner()
    common = ["--n-tokens", "48", "--seq-len", "16"]
    for command in ("causal", "similarity", "contrib", "routing"):
        result = runner.invoke(app, [command, "--ckpt", "preln_L3", *common, "--json"])
        assert result.exit_code == 0, result.output
        payload = json.loads(result.stdout)
        assert payload["settings"]["analysis"] == command
        if command != "routing":  # preln: no native routing (empty table + note)
            assert payload["table"] and payload["table"][0]["model"] == "preln_L3"
        assert (grid / "preln_L3" / "analysis" / f"{command}.parquet").is_file()
    shown = runner.invoke(app, ["causal", "--ckpt", "preln_L2", *common, "--no-save", "--out", str(tmp_path / "c.csv")])
    assert shown.exit_code == 0 and "causal score" in shown.stdout and (tmp_path / "c.csv").is_file()
    only = ["--only", "causal,similarity,sequence_profile,ablate_skip,lens_logit"]
    first = runner.invoke(app, ["analyze", "--grid", str(grid), *common, *only])
    assert first.exit_code == 0, first.output
    assert "8 run, 2 already saved" in first.stdout  # causal + similarity of preln_L3 came from the commands
    again = runner.invoke(app, ["analyze", "--grid", str(grid), *common, *only])
    assert again.exit_code == 0 and "0 run, 10 already saved" in again.stdout
    summary = runner.invoke(app, ["summarize", "--grid", str(grid), "--n-boot", "50", "--json"])
    assert summary.exit_code == 0, summary.output
    out = json.loads(summary.stdout)
    models = {m["model"]: m for m in out["models"]}
    assert set(models) == {"preln_L2", "preln_L3"}
    for m in models.values():
        for field in ("n_skip_over_L", "n_lens_over_L", "pd_mean_over_L", "n_rep_over_L1", "causal_pair_fraction"):
            assert m[field] is not None, field
        assert m["f_tau"] is None and "ablate prune" in m["notes"]
    (row,) = out["grid"]
    assert row["arch"] == "preln" and row["n_models"] == 2 and row["slope_n_skip"] is not None
    assert (grid / "analysis" / "effective_depth_grid.parquet").is_file()
    bad = runner.invoke(app, ["analyze", "--grid", str(grid), "--only", "nope"])
    assert bad.exit_code != 0


def test_f_tau_reads_the_greedy_curve_where_saved_else_the_single_skip_order():
    """Issue 47: the default prune table has the single-skip-order curve; an opt-in greedy one wins."""
    from depthtools.analysis.summary import removal_curve

    base = {"model": "m", "mode": "prune", "rule": "identity"}
    order = pd.DataFrame([{**base, "method": "skip_order", "f_tau": 0.5}, {**base, "method": "gromov", "f_tau": 0.25}])
    rows, method = removal_curve(order)
    assert method == "skip_order" and list(rows["f_tau"]) == [0.5]
    both = pd.concat([order, pd.DataFrame([{**base, "method": "greedy", "f_tau": 0.75}])])
    rows, method = removal_curve(both)
    assert method == "greedy" and list(rows["f_tau"]) == [0.75]
    assert removal_curve(order.drop(columns="method"))[1] is None
