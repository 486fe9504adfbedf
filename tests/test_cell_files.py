"""Where cells go, who can read them, and what a finished cell keeps (issue 22, "Concurrency and defaults")."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from typer.testing import CliRunner

from cli.main import app

from tiny_models import SMALL, prepare_tiny

runner = CliRunner()


def _train(data_dir: Path, *extra: str, tokens: int = 4 * 8 * 32):
    args = ["train", "--arch", "preln", "--layers", "2", "--d-model", "32", "--n-heads", "2", "--data", str(data_dir),
            "--tokens", str(tokens), "--batch-size", "8", "--seq-len", "32", "--eval-every", "0", "--threads", "1",
            *extra]
    return runner.invoke(app, args)


def test_train_without_out_writes_where_ckpt_names_resolve(data_dir, tmp_path, monkeypatch):
    root, here, there = tmp_path / "shared-ck", tmp_path / "here", tmp_path / "there"
    here.mkdir()
    there.mkdir()
    monkeypatch.setenv("DEPTHTOOLS_CHECKPOINTS", str(root))
    monkeypatch.chdir(here)
    result = _train(data_dir)
    assert result.exit_code == 0, (result.output, result.exception)
    assert (root / "preln_L2" / "eval.json").is_file() and not (here / "checkpoints").exists()
    assert str(root / "preln_L2") in result.stdout.replace("\n", "")
    monkeypatch.chdir(there)  # another directory: the name resolves through the same root
    shown = runner.invoke(app, ["info", "--ckpt", "preln_L2", "--json"])
    assert shown.exit_code == 0, (shown.output, shown.exception)
    assert json.loads(shown.stdout)["path"] == str(root / "preln_L2")


def _modes(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): stat.S_IMODE(p.stat().st_mode) for p in sorted(folder.rglob("*"))}


def test_written_files_follow_the_umask(tmp_path):
    """Checkpoints, metrics, tables and datasets get 0666/0777 less the umask (they were 0600 and 0755
    whatever the umask: collaborators on a shared filesystem could not read the weights)."""
    import pandas as pd

    from depthtools.analysis.tables import save_table
    from depthtools.config import ModelConfig, TrainConfig
    from depthtools.train import train_cell

    recipe = TrainConfig(tokens=2 * 8 * 32, batch_size=8, seq_len=32, eval_tokens=512, eval_every=0, log_every=1,
                         depth_stats_every=0, checkpoint_every=0, threads=1)
    before = os.umask(0o022)
    try:
        for mask, file_mode, dir_mode in ((0o022, 0o644, 0o755), (0o077, 0o600, 0o700)):
            os.umask(mask)
            base = tmp_path / f"umask{mask:03o}"
            data = prepare_tiny(base / "data")
            cell = base / "g" / "preln_L2"
            train_cell(ModelConfig(arch="preln", **SMALL), recipe, data, cell)
            save_table(pd.DataFrame({"layer": [0, 1], "value": [0.5, 0.25]}), cell, "probe", {"n": 1})
            modes = {**{f"cell/{k}": v for k, v in _modes(cell).items()}, **{f"data/{k}": v for k, v in _modes(data).items()},
                     "data": stat.S_IMODE(data.stat().st_mode)}
            for name in ("cell/model.safetensors", "cell/config.json", "cell/metrics.jsonl", "cell/eval.json",
                         "cell/analysis/probe.parquet", "cell/analysis/probe.json", "data/meta.json", "data/train.bin"):
                assert modes[name] == file_mode, (mask, name, oct(modes[name]))
            for name in ("cell/analysis", "data"):
                assert modes[name] == dir_mode, (mask, name, oct(modes[name]))
            assert all(v in (file_mode, dir_mode) for v in modes.values()), {k: oct(v) for k, v in modes.items()}
    finally:
        os.umask(before)


def _leave_final_write_leftovers(out: Path) -> None:
    """What a kill between eval.json and the cleanup leaves: the last train_state and a "running" heartbeat."""
    (out / "heartbeat.json").write_text(json.dumps({"state": "running", "host": "h", "pid": 999999, "step": 4}))
    (out / "train_state").mkdir()
    (out / "train_state" / "latest.json").write_text('{"step": 2, "tensors": "step_00000002.safetensors"}')
    (out / "train_state" / "step_00000002.safetensors").write_bytes(b"state")


def test_a_finished_cell_loses_train_state_and_heartbeat_left_by_a_kill_in_the_final_write(data_dir, tmp_path):
    """finish() writes eval.json, then removes train_state/ and heartbeat.json: a kill between those
    left both behind for good (and grid status read the stale heartbeat). The next run that finds the
    cell finished, `train` or `grid train`, removes them."""
    from depthtools.grid import grid_spec, plan_grid
    from depthtools.train import train_grid

    out = tmp_path / "cell"
    args = ("--out", str(out), "--checkpoint-every", "2")
    first = _train(data_dir, *args)
    assert first.exit_code == 0, (first.output, first.exception)
    assert not (out / "train_state").exists() and not (out / "heartbeat.json").exists()
    _leave_final_write_leftovers(out)
    weights = (out / "model.safetensors").read_bytes()
    again = _train(data_dir, *args)
    assert again.exit_code == 2 and "already holds a finished run" in again.stderr, (again.output, again.exception)
    assert not (out / "train_state").exists() and not (out / "heartbeat.json").exists()
    assert (out / "eval.json").is_file() and (out / "model.safetensors").read_bytes() == weights

    cells = plan_grid(["preln"], budget=30_000, layers=[1], n_heads=2, ffn_multiple=8, tolerance=0.15, max_seq_len=32)
    spec = grid_spec(cells, name="g", train={"tokens": 2 * 8 * 32, "batch_size": 8, "seq_len": 32, "eval_every": 0,
                                             "eval_tokens": 512, "threads": 1}, data={"dir": str(data_dir)})
    train_grid(spec, root=tmp_path / "ck", data_root=tmp_path)
    cell = tmp_path / "ck" / "g" / cells[0].name
    _leave_final_write_leftovers(cell)
    from depthtools.train.launch import SlurmResources, dry_run

    assert dry_run(spec, tmp_path / "ck", tmp_path, SlurmResources()) == []  # a dry run changes nothing
    assert (cell / "train_state").is_dir() and (cell / "heartbeat.json").is_file()
    assert train_grid(spec, root=tmp_path / "ck", data_root=tmp_path)[0]["skipped"]
    assert not (cell / "train_state").exists() and not (cell / "heartbeat.json").exists()
