"""The Typer CLI through Typer's test runner, and the console script's error contract."""

import json
import subprocess
import sys

import pytest
import typer
from typer.core import TyperGroup
from typer.testing import CliRunner

from cli.main import app
from depthtools import checkpoint as ck
from depthtools.arch import DepthModel
from depthtools.config import ModelConfig

runner = CliRunner()


def test_archs_json_lists_every_architecture_with_formula_and_paper():
    result = runner.invoke(app, ["archs", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    names = {r["name"] for r in rows}
    assert {"preln", "postln", "periln", "lns", "deepnorm", "keel", "mixln", "rezero", "layerscale",
            "depthmup", "completep"} <= names
    assert all(r["paper"] and r["description"] and r["extra_params"] for r in rows)
    kernels = {r["name"]: r["cpu_kernels"] for r in rows}  # which path each fused CPU kernel takes (C or torch ops)
    assert set(kernels["hc"]) == {"connector"} and set(kernels["attnres"]) == {"bank"} and kernels["preln"] == {}
    assert all(path.startswith(("C (", "torch ops (")) for path in kernels["moda"].values())
    table = runner.invoke(app, ["archs"])
    assert table.exit_code == 0 and "keel" in table.stdout and "CPU kernels" in table.stdout


def test_grid_plan_depthbench_example_prints_json():
    args = ["grid", "plan", "--arch", "preln", "--budget", "405.4M", "--vocab-size", "50280", "--n-heads", "16",
            "--head-dim-multiple", "2", "--ffn-multiple", "16", "--layers", "16,20,24,28,32", "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    cells = json.loads(result.stdout)
    assert [c["n_layer"] for c in cells] == [16, 20, 24, 28, 32]
    for key in ("name", "arch", "n_layer", "d_model", "n_heads", "head_dim", "d_ff", "params_total",
                "params_non_embedding", "deviation"):
        assert key in cells[0]
    assert cells[2]["d_model"] == 1024


def test_grid_plan_out_writes_a_spec(tmp_path):
    out = tmp_path / "grid.json"
    result = runner.invoke(app, ["grid", "plan", "--arch", "preln,lns", "--budget", "300k", "--n-heads", "2",
                                 "--layers", "2,4", "--tolerance", "0.06", "--out", str(out)])
    assert result.exit_code == 0, result.output
    spec = json.loads(out.read_text())
    assert [c["name"] for c in spec["cells"]] == ["preln_L2", "preln_L4", "lns_L2", "lns_L4"]


def test_info_shows_a_checkpoint(tmp_path, monkeypatch):
    model = DepthModel(ModelConfig(arch="lns", vocab_size=40, d_model=32, n_layer=2, n_heads=4), seed=0)
    ck.save(model, tmp_path / "g" / "lns_L2")
    monkeypatch.setenv("DEPTHTOOLS_CHECKPOINTS", str(tmp_path))
    result = runner.invoke(app, ["info", "--ckpt", "lns_L2", "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert info["arch"] == "lns" and info["params"]["total"] == model.param_counts()["total"]
    assert info["finished"] is False


def _commands(group, prefix: tuple[str, ...] = ()):
    """(path, command) of every command and group registered on the app, walked from the click group."""
    for name, command in sorted(group.commands.items()):
        yield (*prefix, name), command
        if isinstance(command, TyperGroup):
            yield from _commands(command, (*prefix, name))


COMMANDS = list(_commands(typer.main.get_command(app)))


def test_the_walk_finds_every_command():
    names = {" ".join(path) for path, _ in COMMANDS}
    assert len(names) >= 22 and {"archs", "grid plan", "lens", "analyze", "tasks eval", "data prepare"} <= names


@pytest.mark.parametrize("path, command", COMMANDS, ids=[" ".join(path) for path, _ in COMMANDS])
def test_every_command_has_help_with_usage(path, command):
    result = runner.invoke(app, [*path, "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert f"Usage: depthtools {' '.join(path)} " in " ".join(result.stdout.split()), result.stdout
    if not isinstance(command, TyperGroup):
        assert "Example" in result.stdout, f"depthtools {' '.join(path)} --help shows no example"


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "cli", *args], capture_output=True, text=True, env=env)


def test_user_errors_are_one_line_on_stderr_with_exit_code_2(tmp_path):
    bad_arch = run_cli("grid", "plan", "--arch", "nope", "--budget", "1M", "--layers", "2")
    assert bad_arch.returncode == 2 and bad_arch.stdout == ""
    assert "unknown architecture 'nope'" in bad_arch.stderr and len(bad_arch.stderr.strip().splitlines()) == 1
    missing = run_cli("info", "--ckpt", str(tmp_path / "nothing_here"))
    assert missing.returncode == 2 and "unknown checkpoint" in missing.stderr
    usage = run_cli("grid", "plan", "--layers", "x", "--budget", "1M")
    assert usage.returncode == 2 and "cannot read --layers 'x'" in usage.stderr
    typo = run_cli("archz")
    assert typo.returncode == 2 and "No such command" in typo.stderr


def test_cli_and_analysis_package_start_without_torch_and_keep_their_exports():
    """`depthtools --help`, `data prepare` and `grid status` need no model: importing the CLI used to load
    torch and TransformerLens (~4 s) through depthtools.analysis' eager imports. The package's exports stay
    what they were, including `ablate` and `sweep`, functions named like their own submodules."""
    import subprocess
    import sys

    code = ("import sys, cli.main; loaded = [m for m in ('torch', 'transformer_lens') if m in sys.modules]; "
            "import depthtools.analysis.ablate, depthtools.analysis.sweep; "
            "from depthtools.analysis import ablate, sweep, linear_cka, grid_summary, tasks; "
            "import depthtools.analysis as a, depthtools.analysis.similarity as s; "
            "assert callable(ablate) and callable(sweep) and callable(linear_cka), (ablate, sweep); "
            "assert set(s.__all__) <= set(a.__all__), set(s.__all__) - set(a.__all__); "
            "assert all(hasattr(a, n) for n in a.__all__); print(loaded)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout
