"""Tests of the trainer: recipe, schedule, parameter groups, learning on every architecture,
exact resume after a kill, NaN handling, finished-cell protection, grid training and the CLI."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from depthtools.arch import DepthModel, list_archs
from depthtools.checkpoint import load, read_json, read_metrics, read_tensors
from depthtools.config import ModelConfig, TrainConfig
from depthtools.errors import DepthToolsError
from depthtools.grid import grid_spec, plan_grid, save_grid
from depthtools.train import (
    CellFinishedError,
    TrainingDivergedError,
    depth_scaling,
    loop as train_loop,
    lr_multiplier,
    param_groups,
    train_cell,
    train_grid,
)
from depthtools.train.flops import flops_per_token
from depthtools.train.optim import build_optimizer
from depthtools.train.state import latest_step, load_train_state

from tiny_models import SMALL, TINY_CORPUS, prepare_tiny

ROOT = Path(__file__).resolve().parents[1]
FAST = dict(batch_size=8, seq_len=32, lr=1e-2, eval_tokens=512, log_every=10, eval_every=0,
            depth_stats_every=0, checkpoint_every=0, threads=1)


def tensors_of(directory: Path) -> dict[str, torch.Tensor]:
    return read_tensors(Path(directory) / "model.safetensors")


# -- recipe, schedule, groups ------------------------------------------------------------------
def test_train_config_round_trips_and_validates():
    cfg = TrainConfig(tokens=1000, lr_overrides={"lns": 1e-2}, schedule="wsd")
    assert TrainConfig.from_json(cfg.to_json()) == cfg
    assert cfg.lr_for("lns") == 1e-2 and cfg.lr_for("preln") == cfg.lr
    assert TrainConfig().total_tokens(1000) == 20_000  # tokens_per_param defaults to 20
    with pytest.raises(DepthToolsError, match="schedule"):
        TrainConfig(schedule="linear")
    with pytest.raises(DepthToolsError, match="not both"):
        TrainConfig(tokens=10, tokens_per_param=2.0)
    with pytest.raises(DepthToolsError, match="unknown TrainConfig field"):
        TrainConfig.from_dict({"learning_rate": 1.0})


def test_schedules_warm_up_then_decay_to_final_fraction():
    cfg = TrainConfig(tokens=1, warmup_fraction=0.1, final_lr_fraction=0.1)
    values = [lr_multiplier(s, 100, cfg) for s in range(100)]
    assert values[0] == pytest.approx(0.1) and values[9] == pytest.approx(1.0)
    assert values[-1] == pytest.approx(0.1) and all(a >= b for a, b in zip(values[9:], values[10:]))
    wsd = [lr_multiplier(s, 100, cfg.replace(schedule="wsd", decay_fraction=0.2)) for s in range(100)]
    assert wsd[50] == 1.0 and wsd[79] == 1.0 and wsd[-1] == pytest.approx(0.1)


def test_param_groups_decay_only_matrices_and_scale_depth_mup():
    model = DepthModel(ModelConfig(arch="hc", **SMALL))
    groups, names = param_groups(model, TrainConfig(tokens=1))
    decayed = {n for g in groups if g["weight_decay"] > 0 for n in _names(model, g)}
    assert "blocks.0.attn.w_q.weight" in decayed
    assert not any("norm" in n or "static_alpha" in n or "static_beta" in n for n in decayed)
    assert len(names) == len(list(model.parameters()))
    model = DepthModel(ModelConfig(arch="completep", **{**SMALL, "n_layer": 48}))
    lr_factor, eps_factor = depth_scaling(model.config)
    assert lr_factor == pytest.approx(1.0) and eps_factor == pytest.approx(0.5)  # a=1, L/L_base=2
    groups, _ = param_groups(model, TrainConfig(tokens=1, lr=1e-3, eps=1e-8))
    blocks = [g for g in groups if g["group"].endswith("/blocks")]
    assert blocks and all(g["eps"] == pytest.approx(5e-9) for g in blocks)
    lr, eps = depth_scaling(ModelConfig(arch="depthmup", **{**SMALL, "n_layer": 96}))
    assert lr == pytest.approx(4 ** -0.5) and eps == pytest.approx(4 ** -0.5)


def _names(model, group) -> list[str]:
    ids = {id(p) for p in group["params"]}
    return [n for n, p in model.named_parameters() if id(p) in ids]


def test_flops_per_token_counts_matmuls_and_attention():
    cfg = ModelConfig(arch="preln", **SMALL)
    params = DepthModel(cfg).param_counts()["total"]
    assert flops_per_token(cfg, params, 32) == 6 * (params - 256 * 32) + 12 * 2 * 32 * 32
    assert flops_per_token(cfg.replace(arch="hc"), params, 32) > flops_per_token(cfg, params, 32)


def test_block_attnres_flops_use_the_models_own_block_size():
    """MFU of Block AttnRes was computed for S = round(sqrt(L)) blocks of transformer blocks while the model
    uses S = 2*ceil(L/8) sublayers: the default must count what the built model mixes (tests/test_flops.py
    checks every architecture's count against a counted forward)."""
    from depthtools.arch import DepthModel
    from depthtools.train.flops import scheme_extra_flops

    for L in (4, 12, 24):
        cfg = ModelConfig(arch="blockattnres", d_model=32, n_layer=L, n_heads=2)
        scheme = DepthModel(cfg).scheme
        explicit = cfg.replace(options={"attnres_block_size": scheme.block_size})
        assert scheme_extra_flops(cfg) == scheme_extra_flops(explicit)
        assert scheme_extra_flops(cfg) < (2 * L + 1) * 4 * 32 * scheme.capacity  # most mixes read fewer than capacity


# -- learning ------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", [spec.name for spec in list_archs()])
def test_loss_decreases_for_every_architecture(arch, data_dir, tmp_path):
    recipe = TrainConfig(tokens=40 * 8 * 32, **{**FAST, "log_every": 20, "depth_stats_every": 20})
    summary = train_cell(ModelConfig(arch=arch, **SMALL), recipe, data_dir, tmp_path / arch)
    records = read_metrics(tmp_path / arch)
    first, last = records[0], records[-1]
    assert first["step"] == 1 and last["step"] == 40
    assert last["train_loss"] < first["train_loss"] - 1.0, (arch, first["train_loss"], last["train_loss"])
    assert summary["val_loss"] < math.log(256) - 1.0
    depth = [r for r in records if "depth_fwd_norm" in r]
    assert depth and all(len(r["depth_fwd_norm"]) == 3 and len(r["depth_grad_norm"]) == 3 for r in depth)
    assert all(v is not None and math.isfinite(v) and v > 0 for r in depth for v in r["depth_grad_norm"]), arch


def test_finished_cell_has_everything_and_loads(data_dir, tmp_path):
    out = tmp_path / "cell"
    recipe = TrainConfig(tokens=10 * 8 * 32, lr_overrides={"lns": 5e-3}, **FAST)
    train_cell(ModelConfig(arch="lns", **SMALL), recipe, data_dir, out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "eval.json", "metrics.jsonl", "model.safetensors"]
    config = read_json(out / "config.json")
    assert TrainConfig.from_dict(config["train"]) == recipe
    assert config["train_resolved"]["lr"] == 5e-3 and config["train_resolved"]["lr_overridden"]
    assert config["tokenizer"]["name"] == "byte" and config["data"]["data_fingerprint"]
    evals = read_json(out / "eval.json")
    assert set(evals["domains"]) == {"text"} and evals["val_loss"] > 0
    record = read_metrics(out)[-1]
    assert {"step", "tokens", "lr", "train_loss", "val_loss", "grad_norm", "tokens_per_s"} <= set(record)
    model = load(out)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in tensors_of(out).items())


def test_bpe_cell_carries_its_tokenizer_and_exports_after_the_data_is_gone(tmp_path):
    from depthtools.interop.tokenizer import resolve_tokenizer

    data = prepare_tiny(tmp_path / "data", tokenizer="bpe4k")
    vocab = json.loads((data / "meta.json").read_text())["tokenizer"]["vocab_size"]
    out = tmp_path / "cell"
    train_cell(ModelConfig(arch="preln", **{**SMALL, "vocab_size": vocab}), TrainConfig(tokens=2 * 8 * 32, **FAST), data, out)
    assert (out / "tokenizer.json").read_bytes() == (data / "tokenizer.json").read_bytes()
    shutil.rmtree(data)  # the data folder is gone: the cell alone names and holds its tokenizer
    config = read_json(out / "config.json")
    plan = resolve_tokenizer(out, config, load(out).config)  # fingerprint-checked against config.json
    assert plan.kind == "bpe" and plan.source == str(out / "tokenizer.json"), plan


def test_refuses_finished_cell_unless_forced(data_dir, tmp_path):
    out, recipe = tmp_path / "cell", TrainConfig(tokens=4 * 8 * 32, **FAST)
    train_cell(ModelConfig(arch="preln", **SMALL), recipe, data_dir, out)
    before = (out / "eval.json").stat().st_mtime_ns
    with pytest.raises(CellFinishedError, match="force"):
        train_cell(ModelConfig(arch="preln", **SMALL), recipe, data_dir, out)
    assert (out / "eval.json").stat().st_mtime_ns == before
    summary = train_cell(ModelConfig(arch="preln", **SMALL), recipe.replace(seed=1), data_dir, out, force=True)
    assert summary["resumed_from"] == 0 and (out / "eval.json").stat().st_mtime_ns != before


# -- reliability ---------------------------------------------------------------------------------
def test_kill_and_resume_is_bit_identical(data_dir, tmp_path):
    """A run killed (SIGKILL) after a checkpoint resumes and ends bit-identical to an uninterrupted one."""
    model_cfg = ModelConfig(arch="preln", **SMALL)
    recipe = TrainConfig(tokens=300 * 8 * 32, **{**FAST, "eval_every": 100, "checkpoint_every": 10,
                                                 "depth_stats_every": 50})
    killed = tmp_path / "killed"
    run_file = tmp_path / "run.json"
    run_file.write_text(json.dumps({"model": model_cfg.to_dict(), "train": recipe.to_dict(),
                                    "data_dir": str(data_dir), "out_dir": str(killed)}))
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "depthtools.train", str(run_file)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while latest_step(killed / "train_state") is None and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, f"run ended before it could be killed: {proc.stderr.read().decode()[-500:]}"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert not (killed / "eval.json").exists()
    resumed = train_cell(model_cfg, recipe, data_dir, killed)
    assert 0 < resumed["resumed_from"] < 300
    reference = train_cell(model_cfg, recipe, data_dir, tmp_path / "reference")
    a, b = tensors_of(killed), tensors_of(tmp_path / "reference")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert resumed["val_loss"] == reference["val_loss"]
    steps = [r["step"] for r in read_metrics(killed)]
    assert steps == sorted(set(steps)) and steps[-1] == 300  # no duplicated records after resume
    assert not (killed / "train_state").exists()


def test_nan_stops_run_and_keeps_last_good_checkpoint(data_dir, tmp_path, monkeypatch):
    calls = {"n": 0}
    real = train_loop.forward_loss

    def poisoned(model, inputs, targets, probe=None):
        loss = real(model, inputs, targets, probe)
        if model.training:
            calls["n"] += 1
            if calls["n"] >= 8:  # the 8th update goes bad
                return loss * float("nan")
        return loss

    monkeypatch.setattr(train_loop, "forward_loss", poisoned)
    out, model_cfg = tmp_path / "cell", ModelConfig(arch="preln", **SMALL)
    recipe = TrainConfig(tokens=20 * 8 * 32, **{**FAST, "log_every": 1, "checkpoint_every": 5})
    with pytest.raises(TrainingDivergedError, match=r"non-finite .* step 8.*step 5"):
        train_cell(model_cfg, recipe, data_dir, out)
    assert not (out / "eval.json").exists() and not (out / "model.safetensors").exists()
    assert latest_step(out / "train_state") == 5
    model = DepthModel(model_cfg)
    optimizer, names = build_optimizer(model, recipe, torch.device("cpu"))
    info = load_train_state(out / "train_state", model, optimizer, names,
                            train_loop.run_fingerprint(model_cfg, recipe, json.loads((data_dir / "meta.json").read_text())["data_fingerprint"]))
    assert info["step"] == 5 and all(torch.isfinite(p).all() for p in model.parameters())


# -- grids and CLI -------------------------------------------------------------------------------
def _tiny_grid(tmp_path: Path) -> Path:
    cells = plan_grid(["preln", "hc"], budget=30_000, layers=[1, 2], n_heads=2, ffn_multiple=8,
                      tolerance=0.15, max_seq_len=32)
    train = {**FAST, "tokens": 6 * 8 * 32}
    data = {"corpus": "text-dir", "text_dir": str(TINY_CORPUS), "val_fraction": 0.3}
    return save_grid(grid_spec(cells, name="mini", train=train, data=data), tmp_path / "mini.json")


def test_grid_train_cli_trains_every_cell_then_does_nothing(tmp_path):
    from cli.main import app

    spec_path, root = _tiny_grid(tmp_path), tmp_path / "ck"
    args = ["grid", "train", str(spec_path), "--root", str(root), "--data-root", str(tmp_path / "data")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output + repr(result.exception)
    cells = ["preln_L1", "preln_L2", "hc_L1", "hc_L2"]
    assert all((root / "mini" / c / "eval.json").is_file() for c in cells)
    stamps = {c: (root / "mini" / c / "model.safetensors").stat().st_mtime_ns for c in cells}
    again = CliRunner().invoke(app, args + ["--json"])
    assert again.exit_code == 0, again.output
    assert [s["skipped"] for s in json.loads(again.output)] == [True] * 4
    assert stamps == {c: (root / "mini" / c / "model.safetensors").stat().st_mtime_ns for c in cells}


def test_grid_folder_keeps_its_spec_and_the_report_names_untrained_cells(tmp_path):
    from cli.main import app
    from depthtools.report.data import read_grid

    spec_path, root = _tiny_grid(tmp_path), tmp_path / "ck"
    args = ["grid", "train", str(spec_path), "--root", str(root), "--data-root", str(tmp_path / "data")]
    result = CliRunner().invoke(app, args + ["--cells", "preln_L1,hc_L1"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    recorded = root / "mini" / "grid.json"
    assert sorted(c["name"] for c in json.loads(recorded.read_text())["cells"]) == ["hc_L1", "preln_L1"]
    stamp = recorded.stat().st_mtime_ns
    assert CliRunner().invoke(app, args + ["--cells", "hc_L1"]).exit_code == 0  # a subset forgets nothing
    assert recorded.stat().st_mtime_ns == stamp  # and an unchanged spec is not rewritten
    assert sorted(c["name"] for c in json.loads(recorded.read_text())["cells"]) == ["hc_L1", "preln_L1"]
    shutil.rmtree(root / "mini" / "preln_L1")  # a planned cell whose folder is gone
    missing = read_grid(root / "mini").missing
    assert ("preln_L1", "cell directory") in {(where, what) for where, what, _ in missing}
    config_path = root / "mini" / "hc_L1" / "config.json"  # pretend one cell used another tokenizer
    config = json.loads(config_path.read_text())
    config["tokenizer"]["fingerprint"] = "0" * 64
    config_path.write_text(json.dumps(config))
    with pytest.raises(DepthToolsError, match="mixes tokenizers"):
        train_grid(spec_path, root=root, data_root=tmp_path / "data")


def test_tiny_preset_grid_trains_with_a_cut_budget(tmp_path):
    """The tiny preset's plan + default corpus path end to end (token budget cut for the test)."""
    from depthtools.presets import get_preset

    spec = get_preset("tiny").grid_spec()
    spec["train"] = {**spec["train"], "tokens": 2 * spec["train"]["batch_size"] * spec["train"]["seq_len"],
                     "eval_tokens": 256}
    spec["data"] = {**spec["data"], "max_bytes": 100_000}
    summaries = train_grid(spec, root=tmp_path / "ck", data_root=tmp_path / "data")
    assert len(summaries) == len(spec["cells"]) and not any(s["skipped"] for s in summaries)
    assert all(s["val_loss"] < math.log(256) + 0.5 for s in summaries)


def test_cli_train_one_cell_and_refuse_rerun(data_dir, tmp_path):
    from cli.main import app

    out = tmp_path / "one"
    args = ["train", "--arch", "hc", "--layers", "2", "--budget", "40k", "--n-heads", "2", "--tolerance", "0.2",
            "--data", str(data_dir), "--tokens", "1024", "--batch-size", "4", "--seq-len", "32", "--threads", "1",
            "--out", str(out), "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output + repr(result.exception)
    summary = json.loads(result.output[result.output.index("{"):])
    assert summary["arch"] == "hc" and summary["n_layer"] == 2 and (out / "eval.json").is_file()
    again = CliRunner().invoke(app, args)  # a finished cell is refused: one line, exit code 2
    assert again.exit_code == 2 and "finished" in again.output and "--force" in again.output
    bad = CliRunner().invoke(app, ["train", "--arch", "hc", "--layers", "2", "--data", str(data_dir)])
    assert bad.exit_code == 2 and "--budget" in bad.output and "Traceback" not in bad.output
