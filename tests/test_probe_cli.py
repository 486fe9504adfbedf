"""One analysis CLI (issue 19): the probe commands and `analyze` share options, table names,
settings and the cache rule; old option spellings and old table names keep working."""

import json
from pathlib import Path

import pandas as pd
import pytest
import torch
import typer
from typer.testing import CliRunner

from cli.main import app, fmt
from depthtools import checkpoint as ck
from depthtools.analysis.suite import N_TOKENS, read_result
from depthtools.analysis.summary import load_results
from depthtools.analysis.tables import load_settings, save_table
from depthtools.arch import DepthModel
from depthtools.config import ModelConfig

from tiny_models import one_thread  # noqa: F401  (autouse: one intra-op thread)

runner = CliRunner()
EVAL = ["--n-tokens", "64", "--seq-len", "16"]


@pytest.fixture
def cell(tmp_path, data_dir, monkeypatch):
    """A tiny 2-layer checkpoint recording the fixture corpus, alone in its grid directory."""
    model = DepthModel(ModelConfig(arch="preln", vocab_size=256, d_model=32, n_layer=2, n_heads=4, max_seq_len=32),
                       seed=0)
    directory = tmp_path / "grid" / "preln_L2"
    ck.save(model, directory, extra={"data": {"path": str(data_dir)}})
    monkeypatch.setenv("DEPTHTOOLS_CHECKPOINTS", str(tmp_path / "grid"))
    return directory


def ok(*args):
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result


def analyze(cell, only, *extra):
    return ok("analyze", "--grid", cell.parent, *EVAL, "--only", only, *extra).stdout


# -- one table-naming scheme and one cache rule --------------------------------------------------------

def test_lens_then_analyze_reuses_the_lens_tables(cell):
    ok("lens", "--ckpt", "preln_L2", *EVAL)  # used to save analysis/lens, which analyze never read
    for table in ("lens_logit", "lens_logit_summary", "prediction_depth"):
        assert (cell / "analysis" / f"{table}.parquet").is_file()
    assert "0 run, 1 already saved" in analyze(cell, "lens_logit")
    again = ok("lens", "--ckpt", "preln_L2", *EVAL)
    assert "reused" in again.stderr and "logit lens: mean prediction depth" in again.stdout


def test_ablate_and_analyze_write_the_same_ablate_skip_and_reuse_each_other(cell):
    ok("ablate", "--ckpt", "preln_L2", "--mode", "skip", *EVAL)
    by_command = load_settings(cell, "ablate_skip")
    assert "0 run, 1 already saved" in analyze(cell, "ablate_skip")
    assert "1 run, 0 already saved" in analyze(cell, "ablate_skip", "--recompute")
    assert load_settings(cell, "ablate_skip") == by_command
    assert "reused" in ok("ablate", "--ckpt", "preln_L2", *EVAL).stderr
    assert "1 run" in analyze(cell, "ablate_skip", "--batch-size", "4")  # other settings: recomputed


def test_adjacent_swaps_do_not_overwrite_the_all_pairs_table(cell):
    analyze(cell, "ablate_swap")
    all_pairs = pd.read_parquet(cell / "analysis" / "ablate_swap.parquet")
    ok("ablate", "--ckpt", "preln_L2", "--mode", "swap", *EVAL)  # default --pairs adjacent
    assert (cell / "analysis" / "ablate_swap_adjacent.parquet").is_file()
    pd.testing.assert_frame_equal(pd.read_parquet(cell / "analysis" / "ablate_swap.parquet"), all_pairs)
    assert "reused" in ok("ablate", "--ckpt", "preln_L2", "--mode", "swap", "--pairs", "all", *EVAL).stderr


def test_single_commands_reuse_a_saved_table_unless_recompute(cell):
    first = json.loads(ok("causal", "--ckpt", "preln_L2", *EVAL, "--json").stdout)
    path = cell / "analysis" / "causal.parquet"
    pd.read_parquet(path).assign(value=123.0).to_parquet(path)
    reused = json.loads(ok("causal", "--ckpt", "preln_L2", *EVAL, "--json").stdout)
    assert all(r["value"] == 123.0 for r in reused["table"]) and reused["settings"] == first["settings"]
    fresh = json.loads(ok("causal", "--ckpt", "preln_L2", *EVAL, "--json", "--recompute").stdout)
    assert fresh["table"] == first["table"]


def test_probe_commands_take_several_checkpoints(cell):
    other = cell.parent / "preln_L3"
    ck.save(DepthModel(ModelConfig(arch="preln", vocab_size=256, d_model=32, n_layer=3, n_heads=4, max_seq_len=32),
                       seed=0), other, extra={"data": {"path": json.loads((cell / "config.json").read_text())["data"]["path"]}})
    out = json.loads(ok("routing", "--grid", cell.parent, *EVAL, "--json", "--no-save").stdout)
    assert isinstance(out["settings"], list) and len(out["settings"]) == 2
    sim = json.loads(ok("similarity", "--ckpt", "preln_L2", "--ckpt", "preln_L3", *EVAL, "--json").stdout)
    assert {r["model"] for r in sim["table"]} == {"preln_L2", "preln_L3"}


# -- old spellings and old tables ------------------------------------------------------------------------

@pytest.mark.parametrize("old, new, command", [
    (["--tokens", "64"], ["--n-tokens", "64"], ["ablate", "--ckpt", "preln_L2", "--seq-len", "16"]),
    (["--force"], ["--recompute"], ["analyze", "--grid", "{grid}", *EVAL, "--only", "routing"]),
    (["--swap-pairs", "adjacent"], ["--pairs", "adjacent"], ["analyze", "--grid", "{grid}", *EVAL, "--only", "routing"]),
    (["--tuned-lens"], ["--tuned"], ["analyze", "--grid", "{grid}", *EVAL, "--only", "routing"]),
])
def test_old_option_spellings_still_work_with_a_one_line_note(cell, old, new, command):
    args = [str(cell.parent) if a == "{grid}" else a for a in command]
    result = ok(*args, *old)
    notes = [line for line in result.stderr.splitlines() if "deprecated" in line]
    assert notes == [f"note: {old[0]} is deprecated; use {new[0]}"]
    assert "deprecated" not in ok(*args, *new).stderr


def test_old_lens_and_swap_tables_are_read_by_their_new_names_and_never_reused(cell):
    ok("lens", "--ckpt", "preln_L2", *EVAL, "--no-save", "--out", cell.parent / "lens.parquet")
    merged = pd.read_parquet(cell.parent / "lens.parquet")  # what the old `lens` command saved as analysis/lens
    save_table(merged, cell, "lens", {"analysis": "lens", "tuned": False, "tokens": "x", "batch_size": 8, "model": "y"})
    swaps = pd.DataFrame({"model": ["preln_L2"], "mode": ["swap"], "layer": [0], "layer2": [1], "perm_score": [0.5],
                          "pairs": ["adjacent"]})
    save_table(swaps, cell, "ablate_swap", {"analysis": "ablate", "mode": "swap", "pairs": "adjacent"})
    assert read_result(cell, "ablate_swap") is None  # adjacent pairs are not the all-pairs table
    pd.testing.assert_frame_equal(read_result(cell, "ablate_swap_adjacent"), swaps)
    depths = read_result(cell, "lens_logit")
    assert list(depths["depth"]) == [0, 1, 2] and "pd_mean" not in depths
    summary = read_result(cell, "lens_logit_summary")
    assert summary["pd_mean_over_L"].iloc[0] == merged["pd_mean_over_L"].iloc[0]
    assert {"lens_logit", "lens_logit_summary", "ablate_swap_adjacent"} <= set(load_results(cell))
    assert "1 run, 0 already saved" in analyze(cell, "lens_logit")  # recomputed under the new name
    assert load_settings(cell, "lens_logit")["analysis"] == "lens_logit"


def test_a_table_saved_with_another_analysis_under_a_suite_name_is_not_misread(cell):
    save_table(pd.DataFrame({"x": [1]}), cell, "similarity", {"analysis": "something_else"})
    assert read_result(cell, "similarity") is None


# -- one vocabulary, one formatter (help for every command: test_cli.py) -------------------------------------------------

PROBES = ("lens", "ablate", "causal", "similarity", "contrib", "routing", "analyze")



def test_probe_commands_share_one_option_vocabulary():
    commands = typer.main.get_command(app).commands
    shared = {"--ckpt", "--grid", "--data", "--n-tokens", "--seq-len", "--split", "--seed", "--batch-size", "--device",
              "--recompute"}
    for name in PROBES:
        params = {opt: p for p in commands[name].params for opt in p.opts}
        assert shared <= set(params), (name, shared - set(params))
        assert params["--n-tokens"].default == N_TOKENS and params["--seq-len"].default is None
        assert params["--ckpt"].multiple
        assert not {"--tokens", "--force", "--swap-pairs", "--tuned-lens"} & set(params)


def test_one_number_formatter():
    assert fmt(float("nan")) == fmt(None) == fmt(pd.NA) == "–"
    assert fmt(0.123456) == "0.1235" and fmt(0.123456, 3) == "0.123" and fmt(7) == "7"



def test_tuned_lens_of_the_lens_command_is_reused_by_analyze(cell):
    tuned = ["--lens-steps", "2", "--lens-tokens", "256"]
    ok("lens", "--ckpt", "preln_L2", *EVAL, "--tuned", *tuned)
    assert "0 run, 2 already saved" in ok("analyze", "--ckpt", "preln_L2", *EVAL, "--only", "lens_logit,lens_tuned",
                                          *tuned).stdout
    assert read_result(cell, "lens_tuned")["lens"].eq("tuned").all()


def test_analyze_grid_old_argument_names_warn_and_still_apply(cell):
    from depthtools.analysis.suite import analyze_grid

    sizes = dict(n_tokens=64, seq_len=16, only="routing")
    assert analyze_grid(cell.parent, **sizes).ran == 1
    with pytest.warns(DeprecationWarning, match="force"):
        assert analyze_grid(cell.parent, force=True, **sizes).ran == 1  # recomputed, not silently reused
    with pytest.raises(Exception, match="unknown analysis option"):
        analyze_grid(cell.parent, tua=0.1, **sizes)


# -- --protocol depthbench on the single probes (issue 37) -----------------------------------------------

PROBE_DEPTHBENCH = [  # (probe command line, the DepthBench metrics it maps to)
    (["causal"], "causal_score"),
    (["ablate", "--mode", "skip"], "layer_pruning"),
    (["ablate", "--mode", "swap"], "permutation_score"),
    (["ablate", "--mode", "linear"], "usefulness_score"),
    (["similarity"], "angular_distance,token_collapse"),
    (["lens"], "logit_lens"),
    (["contrib"], "jacobian"),
]


@pytest.mark.parametrize("command,metrics", PROBE_DEPTHBENCH, ids=[" ".join(c) for c, _ in PROBE_DEPTHBENCH])
def test_probe_protocol_depthbench_equals_the_depthbench_command(cell, command, metrics):
    """Each probe's DepthBench counterpart: the same rows, same values, as `depthtools depthbench --metrics`."""
    common = ["--ckpt", "preln_L2", *EVAL, "--batch-size", "4", "--json", "--no-save"]
    probe = json.loads(ok(*command, "--protocol", "depthbench", *common).stdout)
    direct = json.loads(ok("depthbench", "--metrics", metrics, *common).stdout)
    got, want = pd.DataFrame(probe["table"]), pd.DataFrame(direct["table"])
    assert len(got) and set(got["protocol"]) == {"depthbench"}
    pd.testing.assert_frame_equal(got, want)
    own = {"causal": "causal_score", "skip": "layer_pruning_delta", "swap": "mean_permutation_score",
           "linear": "global_usefulness_score", "similarity": "angular_distance", "lens": "early_exit_ce",
           "contrib": "jacobian_norm"}[command[-1]]
    assert own in set(got["metric"])


def test_probe_protocol_depthbench_prints_a_table(cell):
    result = ok("causal", "--ckpt", "preln_L2", *EVAL, "--protocol", "depthbench", "--no-save")
    assert "mean_causal_score" in result.stdout and "pairwise rows (causal_score" in result.stdout


@pytest.mark.parametrize("args,message", [
    (["ablate", "--mode", "prune"], "ablate --mode prune has no DepthBench metric: DepthBench prunes one block"),
    (["ablate", "--mode", "mean"], "ablate --mode mean has no DepthBench metric"),
    (["routing"], "routing has no DepthBench metric"),
    (["lens", "--tuned"], "lens --tuned has no DepthBench metric"),
    (["contrib", "--no-jacobian"], "contrib --no-jacobian has no DepthBench metric"),
    (["causal", "--rule", "mask"], "--rule does not apply to --protocol depthbench"),
])
def test_probe_protocol_depthbench_without_a_counterpart_is_one_line(cell, args, message):
    result = runner.invoke(app, [*args, "--ckpt", "preln_L2", *EVAL, "--protocol", "depthbench"])
    assert result.exit_code == 2 and message in result.output
    assert len(result.output.strip().splitlines()) == 1
    bad = runner.invoke(app, ["causal", "--ckpt", "preln_L2", *EVAL, "--protocol", "olmo"])
    assert bad.exit_code == 2 and "unknown --protocol 'olmo'; valid: depthtools, depthbench" in bad.output


def test_probe_protocol_depthbench_names_metric_and_architecture(tmp_path, data_dir, monkeypatch):
    """A DepthBench metric undefined for the architecture: one line naming both (usefulness on AttnRes)."""
    model = DepthModel(ModelConfig(arch="attnres", vocab_size=256, d_model=32, n_layer=2, n_heads=4, max_seq_len=32),
                       seed=0)
    ck.save(model, tmp_path / "grid" / "attnres_L2", extra={"data": {"path": str(data_dir)}})
    monkeypatch.setenv("DEPTHTOOLS_CHECKPOINTS", str(tmp_path / "grid"))
    result = runner.invoke(app, ["ablate", "--mode", "linear", "--ckpt", "attnres_L2", *EVAL, "--protocol", "depthbench"])
    assert result.exit_code == 2 and "DepthBench's usefulness_score is undefined for attnres" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_one_checkpoint_loop_draws_windows_before_weights_and_skips_only_when_asked(cell, tmp_path, data_dir,
                                                                                     monkeypatch):
    """suite.loaded_checkpoints, the loop of `analyze` and of the probe commands (issue 46): a checkpoint whose
    windows cannot be drawn (--seq-len beyond its context) is refused before its weights are read, handed to
    `skip` when given, raised when not; the others come back loaded, with windows equal to checkpoint_tokens'."""
    from depthtools.analysis.suite import checkpoint_tokens, loaded_checkpoints
    from depthtools.errors import DepthToolsError

    short = tmp_path / "grid" / "preln_L2_short"
    model = DepthModel(ModelConfig(arch="preln", vocab_size=256, d_model=32, n_layer=2, n_heads=4, max_seq_len=8),
                       seed=0)
    ck.save(model, short, extra={"data": {"path": str(data_dir)}})
    loads = []
    real_load = ck.load
    monkeypatch.setattr(ck, "load", lambda d, **kw: (loads.append(Path(d).name), real_load(d, **kw))[1])
    skipped = []
    got = list(loaded_checkpoints([short, cell], None, 64, 16, "val", 0, skip=skipped.append))
    assert loads == ["preln_L2"] and len(skipped) == 1 and "preln_L2_short" in str(skipped[0])
    (ckpt_dir, loaded, tokens), = got
    assert ckpt_dir == cell and not loaded.training
    assert torch.equal(tokens.cpu(), checkpoint_tokens(cell, None, 64, 16, "val", 0).cpu())
    with pytest.raises(DepthToolsError, match="preln_L2_short"):
        list(loaded_checkpoints([cell, short], None, 64, 16, "val", 0))
    assert loads == ["preln_L2", "preln_L2"]  # the first came back loaded; the second raised before its load
