"""Ablations (depthtools.analysis.ablate) and the `ablate` / `lens` commands."""

import json
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from cli.main import app
from depthtools import checkpoint as ck
from depthtools.analysis import (
    UnsupportedAblation,
    ablate,
    affine_replacement,
    effective_count,
    fit_affine,
    prunable_fraction,
)
from depthtools.arch import DepthModel, Plan, list_archs
from depthtools.config import ModelConfig
from depthtools.errors import DepthToolsError

from tiny_models import VOCAB, one_thread, tiny, windows  # noqa: F401 (fixture)

ARCHS = [spec.name for spec in list_archs()]
runner = CliRunner()


def zero_branches(model: DepthModel, block: int) -> None:
    """Make block `block` the identity in an additive family model: no attention or MLP output."""
    with torch.no_grad():
        model.blocks[block].attn.w_o.weight.zero_()
        model.blocks[block].mlp.w2.weight.zero_()


@pytest.mark.parametrize("arch", ARCHS)
def test_every_mode_gives_tidy_rows_or_a_clear_refusal(arch):
    model, toks = tiny(arch), windows()
    L = model.n_layer
    rules = [r for r in model.scheme.skip_rules if r not in model.scheme.on_request_skip_rules]  # the default sweep
    skip = ablate(model, toks, mode="skip", batch_size=2)
    assert len(skip) == L * len(rules) and sorted(set(skip["rule"])) == sorted(rules)
    assert list(skip["layer"][: L]) == list(range(L)) and list(skip["rel_depth"][:L]) == [l / L for l in range(L)]
    for column in ("arch", "n_layer", "d_model", "mode", "delta_ce", "kl_intact_ablated", "top1_retention", "n_skip"):
        assert column in skip
    assert (skip["kl_intact_ablated"] >= 0).all() and (skip["n_skip"] <= L + 1e-9).all()
    swap = ablate(model, toks, mode="swap", pairs="all", batch_size=3)
    assert len(swap) == L * (L - 1) // 2
    np.testing.assert_allclose(swap["perm_score"], (swap["ce"] - swap["ce_intact"]).abs() / swap["ce_intact"])
    for mode in ("linear", "mean"):
        try:
            df = ablate(model, toks, mode=mode)
        except UnsupportedAblation as exc:
            assert "unsupported for " + arch in str(exc)
        else:
            assert len(df) == L and np.isfinite(df["ce"]).all()


@pytest.mark.parametrize("arch", ["preln", "periln", "lns", "layerscale", "rezero", "completep"])
def test_a_block_without_branch_output_costs_nothing_to_remove(arch):
    model, toks = tiny(arch), windows(8)  # 88 scored rows: the 33-parameter affine fit is well determined
    zero_branches(model, 1)
    for mode in ("skip", "mean", "linear"):
        row = ablate(model, toks, mode=mode).query("layer == 1").iloc[0]
        assert abs(row["delta_ce"]) < 1e-9 and row["kl_intact_ablated"] < 1e-12, mode
        assert row["top1_agree"] == 1.0
    skip = ablate(model, toks, mode="skip").query("layer == 1").iloc[0]
    assert skip["delta_ce"] == 0 and skip["kl_intact_ablated"] == 0  # identity skip of an identity block: exact
    linear = ablate(model, toks, mode="linear").query("layer == 1").iloc[0]
    assert linear["usefulness_ratio"] == pytest.approx(1.0, abs=1e-9) and not linear["significant"]


@pytest.mark.parametrize("arch", ["preln", "postln", "periln"])
def test_swapping_two_identical_blocks_changes_nothing(arch):
    model, toks = tiny(arch), windows()
    model.blocks[2].load_state_dict(model.blocks[1].state_dict())
    row = ablate(model, toks, mode="swap").query("layer == 1").iloc[0]
    assert row["layer2"] == 2 and row["delta_ce"] == 0 and row["kl_intact_ablated"] == 0 and row["perm_score"] == 0
    other = ablate(model, toks, mode="swap").query("layer == 0").iloc[0]
    assert other["kl_intact_ablated"] > 0


def test_affine_fit_recovers_a_known_map_and_replacement_applies_it():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(200, 6, generator=gen, dtype=torch.float64)
    weight, bias = torch.randn(6, 6, generator=gen, dtype=torch.float64), torch.randn(6, generator=gen, dtype=torch.float64)
    y = x @ weight + bias
    xa = torch.cat([x, torch.ones(200, 1, dtype=torch.float64)], 1)
    w_fit, b_fit = fit_affine(xa.T @ xa, xa.T @ y)
    torch.testing.assert_close(w_fit, weight, rtol=1e-7, atol=1e-7)
    torch.testing.assert_close(b_fit, bias, rtol=1e-7, atol=1e-7)
    streams = torch.randn(2, 5, 2, 3, generator=gen, dtype=torch.float64)  # [B,T,n,d] like HC
    out = affine_replacement(weight, bias)(streams)
    assert out.shape == streams.shape
    torch.testing.assert_close(out.reshape(2, 5, 6), streams.reshape(2, 5, 6) @ weight + bias)
    # through Plan.replace: an identity map at a position equals skipping it
    model, toks = tiny("preln"), windows()
    eye = affine_replacement(torch.eye(32, dtype=torch.float64), torch.zeros(32, dtype=torch.float64))
    torch.testing.assert_close(model.run(toks, plan=Plan(replace={2: eye})), model.run(toks, plan=Plan.skipping(2)))


def test_prune_curves_and_prunable_fraction():
    model, toks = tiny("hc"), windows()
    L = model.n_layer
    df = ablate(model, toks, mode="prune", tau=float("inf"), prune="greedy")
    for rule in model.scheme.skip_rules:
        greedy = df.query("rule == @rule and method == 'greedy'")
        assert list(greedy["n_removed"]) == list(range(1, L + 1)) and greedy["f_tau"].iloc[0] == 1.0
        assert sorted(int(x) for x in greedy["layers"].iloc[-1].split(",")) == list(range(L))
        gromov = df.query("rule == @rule and method == 'gromov'")
        assert list(gromov["n_removed"]) == list(range(1, L)) and (gromov["angular_distance"] >= 0).all()
        first = [int(x) for x in gromov["layers"].iloc[1].split(",")]
        assert first == list(range(first[0], first[0] + 2))  # contiguous
    strict = ablate(model, toks, mode="prune", tau=0.0, rules=["identity"], prune="greedy")
    greedy = strict.query("method == 'greedy'")
    assert (greedy["delta_ce"].iloc[:-1] <= 0).all() and (greedy["delta_ce"].iloc[-1] > 0 or len(greedy) == L)
    assert prunable_fraction([0.01, 0.02, 0.2, 0.01], 8, 0.05) == 2 / 8


def _plan_ce(model, toks, skip, rule) -> float:
    """Mean next-token CE of a full re-run with blocks `skip` bypassed (independent of the sweep engine)."""
    with torch.no_grad():
        logits = model.run(toks[:, :-1], plan=Plan(skip=frozenset(skip), skip_rule=rule))
    return float(torch.nn.functional.cross_entropy(logits[:, 1:].flatten(0, 1).double(), toks[:, 2:].flatten()))


def test_default_prune_curve_follows_the_single_skip_order():
    """Issue 47: the default curve removes blocks cumulatively in ascending single-skip ΔCE (L plans, not
    L²/2); every step's ΔCE equals a full re-run with those blocks skipped; the skip table's order reused."""
    model, toks = tiny("preln", n_layer=5), windows(n=4)
    L, rule = model.n_layer, model.scheme.skip_rules[0]
    skip = ablate(model, toks, mode="skip", rules=[rule])
    order = [int(l) for l in skip.sort_values(["delta_ce", "layer"], kind="stable")["layer"]]
    df = ablate(model, toks, mode="prune", tau=0.01, rules=[rule])
    assert set(df["method"]) == {"skip_order", "gromov"}
    curve = df[df["method"] == "skip_order"]
    assert list(curve["n_removed"]) == list(range(1, L + 1))
    assert [int(x) for x in curve["layers"].iloc[-1].split(",")] == order
    intact = _plan_ce(model, toks, [], rule)
    for row in curve.itertuples():
        removed = [int(x) for x in row.layers.split(",")]
        assert removed == order[:row.n_removed] and row.layer_removed == order[row.n_removed - 1]
        assert row.delta_ce == pytest.approx(_plan_ce(model, toks, removed, rule) - intact, abs=1e-9)
    assert curve["f_tau"].iloc[0] == prunable_fraction(list(curve["delta_ce"]), L, 0.01)
    deltas = {rule: list(skip.sort_values("layer")["delta_ce"])}
    reused = ablate(model, toks, mode="prune", tau=0.01, rules=[rule], skip_delta=deltas)
    pd.testing.assert_frame_equal(reused, df)
    capped = ablate(model, toks, mode="prune", rules=[rule], max_prune_steps=2)
    assert list(capped.query("method == 'skip_order'")["n_removed"]) == [1, 2]
    with pytest.raises(DepthToolsError, match="unknown --prune 'best'; valid: order, greedy"):
        ablate(model, toks, mode="prune", prune="best")


def test_effective_count():
    assert effective_count([1, 1, 1, 1]) == pytest.approx(4)
    assert effective_count([0, 3, 0, 0]) == pytest.approx(1)
    assert np.isnan(effective_count([0, 0]))


def test_bad_library_inputs_are_clear():
    model, toks = tiny("preln"), windows()
    with pytest.raises(DepthToolsError, match="unknown ablation mode 'skp'"):
        ablate(model, toks, mode="skp")
    with pytest.raises(DepthToolsError, match="unknown pairs"):
        ablate(model, toks, mode="swap", pairs="some")
    with pytest.raises(DepthToolsError, match="unknown skip rule"):
        ablate(model, toks, mode="skip", rules=["branch"])
    with pytest.raises(UnsupportedAblation, match="not a tensor"):
        ablate(tiny("attnres"), toks, mode="linear")


# -- the CLI -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A prepared fixture corpus and two tiny checkpoints recording it."""
    from depthtools.data import prepare

    root = tmp_path_factory.mktemp("cli")
    data = prepare(corpus="text-dir", text_dir="tests/fixtures/tiny_corpus", out_dir=root / "data")
    for arch in ("preln", "attnres"):
        model = DepthModel(ModelConfig(arch=arch, vocab_size=256, d_model=32, n_layer=4, n_heads=4, max_seq_len=32), seed=0)
        ck.save(model, root / "grid" / f"{arch}_L4", extra={"data": {"path": str(data)}})
    return root, data


def test_cli_ablate_skip_prints_one_row_per_layer_and_writes_the_table(saved, monkeypatch):
    root, _ = saved
    monkeypatch.setenv("DEPTHTOOLS_CHECKPOINTS", str(root / "grid"))
    out = root / "skip.parquet"
    args = ["ablate", "--ckpt", "preln_L4", "--mode", "skip", "--n-tokens", "256", "--seq-len", "16", "--out", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = [line for line in result.stdout.splitlines() if line.startswith("│ preln_L4")]
    assert len(rows) == 4 and "N_skip" in result.stdout
    df = pd.read_parquet(out)
    assert list(df["layer"]) == [0, 1, 2, 3] and (df["arch"] == "preln").all()
    assert (root / "grid" / "preln_L4" / "analysis" / "ablate_skip.parquet").is_file()
    as_json = runner.invoke(app, args[:-2] + ["--json"])
    assert as_json.exit_code == 0 and len(json.loads(as_json.stdout)) == 4
    # a saved table with the same settings is reused; --recompute recomputes it
    saved_path = root / "grid" / "preln_L4" / "analysis" / "ablate_skip.parquet"
    pd.read_parquet(saved_path).assign(delta_ce=123.0).to_parquet(saved_path)
    reused = json.loads(runner.invoke(app, args[:-2] + ["--json"]).stdout)
    assert all(r["delta_ce"] == 123.0 for r in reused)
    fresh = json.loads(runner.invoke(app, args[:-2] + ["--json", "--recompute"]).stdout)
    assert [r["delta_ce"] for r in fresh] == list(df["delta_ce"])


def test_cli_tuned_lens_reports_both_lenses_and_saves_translators(saved, monkeypatch):
    root, _ = saved
    monkeypatch.setenv("DEPTHTOOLS_CHECKPOINTS", str(root / "grid"))
    result = runner.invoke(app, ["lens", "--ckpt", "preln_L4", "--tuned", "--lens-steps", "2", "--lens-tokens", "512",
                                 "--n-tokens", "128", "--seq-len", "16"])
    assert result.exit_code == 0, result.output
    assert "logit lens: mean prediction depth" in result.stdout and "tuned lens" in result.stdout
    assert (root / "grid" / "preln_L4" / "analysis" / "tuned_lens.safetensors").is_file()


def test_cli_tuned_lens_refuses_a_normed_sum_head_before_writing_anything(saved, tmp_path, monkeypatch):
    """Issue 44: `lens --tuned` on HC with readout "normed_sum" (no vector before the final norm for the
    translators): one line naming the architecture and readout, exit 2, no table (not even the logit lens')."""
    root, data = saved
    monkeypatch.setenv("DEPTHTOOLS_CHECKPOINTS", str(tmp_path))
    cfg = ModelConfig(arch="hc", vocab_size=256, d_model=32, n_layer=2, n_heads=4, max_seq_len=32,
                      options={"readout": "normed_sum"})
    ck.save(DepthModel(cfg, seed=0), tmp_path / "hc_L2", extra={"data": {"path": str(data)}})
    result = runner.invoke(app, ["lens", "--ckpt", "hc_L2", "--tuned", "--lens-steps", "2", "--lens-tokens", "512",
                                 "--n-tokens", "128", "--seq-len", "16"])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: the tuned lens") and len(result.stderr.strip().splitlines()) == 1
    assert "hc_L2 (hc with readout='normed_sum')" in result.stderr and result.stdout == ""
    assert not (tmp_path / "hc_L2" / "analysis").exists() or not any((tmp_path / "hc_L2" / "analysis").iterdir())


def test_cli_grid_runs_every_checkpoint_and_skips_unsupported_ones(saved):
    root, data = saved
    result = runner.invoke(app, ["ablate", "--grid", str(root / "grid"), "--mode", "mean", "--n-tokens", "128",
                                 "--seq-len", "16", "--data", str(data), "--json", "--no-save"])
    assert result.exit_code == 0, result.output
    records = json.loads(result.stdout)
    assert {r["model"] for r in records} == {"preln_L4"} and "unsupported for attnres" in result.stderr
    lens = runner.invoke(app, ["lens", "--grid", str(root / "grid"), "--n-tokens", "128", "--seq-len", "16", "--json"])
    assert lens.exit_code == 0, lens.output
    depths = json.loads(lens.stdout)
    assert len(depths) == 2 * 5 and {r["model"] for r in depths} == {"preln_L4", "attnres_L4"}


def test_cli_bad_inputs_are_one_line_errors(saved, monkeypatch):
    root, _ = saved
    monkeypatch.setenv("DEPTHTOOLS_CHECKPOINTS", str(root / "grid"))
    cases = [
        (["ablate", "--ckpt", "nope_L9"], "unknown checkpoint 'nope_L9'"),
        (["ablate", "--ckpt", "preln_L4", "--seq-len", "64"], "exceeds the context 32"),
        (["ablate", "--ckpt", "preln_L4", "--n-tokens", "0"], "empty token set"),
        (["ablate", "--ckpt", "preln_L4", "--mode", "skp"], "unknown ablation mode 'skp'"),
        (["ablate", "--ckpt", "preln_L4", "--mode", "swap", "--pairs", "every"], "unknown pairs 'every'"),
        (["lens", "--ckpt", "attnres_L4", "--device", "gpu"], "unknown device 'gpu'"),
        (["ablate"], "give --ckpt"),
    ]
    for args, message in cases:
        result = runner.invoke(app, args)
        assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output, (args, result.output)
    bare = root / "bare_L4"  # saved without a recorded data directory
    ck.save(DepthModel(ModelConfig(arch="preln", vocab_size=256, d_model=32, n_layer=4, n_heads=4), seed=0), bare)
    result = runner.invoke(app, ["lens", "--ckpt", str(bare)])
    assert result.exit_code == 2 and "records no data directory; pass --data" in result.output
    proc = subprocess.run([sys.executable, "-m", "cli", "ablate", "--ckpt", str(root / "nowhere"), "--mode", "skip"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1
    assert "unknown checkpoint" in proc.stderr


def test_an_on_request_skip_rule_runs_only_when_named():
    """AttnRes' "depthbench" rule (DepthBench's skip_block) is valid but not part of the default skip sweep,
    so a default `ablate --mode skip` keeps its two rules (and its cost)."""
    model, toks = tiny("attnres"), windows()
    default = ablate(model, toks, mode="skip", batch_size=2)
    named = ablate(model, toks, mode="skip", batch_size=2, rules=["depthbench"])
    assert set(default["rule"]) == {"mask", "next-output"}
    assert set(named["rule"]) == {"depthbench"} and len(named) == model.n_layer


def test_sampled_permutation_score_has_its_standard_error_beside_the_mean():
    """Issue 47: the bounded all-pairs swap reports mean ± s/√n·√(1−n/N) of the sampled pairs; all pairs: 0."""
    model, toks = tiny("preln", n_layer=6), windows(n=2, length=9)
    some = ablate(model, toks, mode="swap", pairs="all", swap_pairs_max=5)
    x = some["perm_score"].to_numpy()
    assert some["n_pairs_total"].iloc[0] == 15 and len(some) == 5
    assert some["perm_score_mean"].iloc[0] == pytest.approx(x.mean())
    assert some["perm_score_se"].iloc[0] == pytest.approx(np.std(x, ddof=1) / np.sqrt(5) * np.sqrt(1 - 5 / 15))
    full = ablate(model, toks, mode="swap", pairs="all")
    assert (full["perm_score_se"] == 0).all() and full["perm_score_mean"].iloc[0] == pytest.approx(full["perm_score"].mean())
