"""Checkpoints are not tied to the folder training ran in (issue 35, item 8).

A cell is trained the usual way, from a project folder with relative paths (`--data data/...`,
`--out checkpoints/...`). Its probes must then find the training data from any other working
directory (a notebook in `notebooks/`, a script elsewhere), as a library call and as a CLI
subprocess, and still after the whole project tree is moved. Checkpoints written before the fix
(a relative "path" only) must keep working where they worked, and now also from below the project.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from depthtools.analysis.suite import eval_tokens
from depthtools.analysis.tokens import checkpoint_data_dir
from depthtools.config import ModelConfig, TrainConfig
from depthtools.errors import DepthToolsError

from tiny_models import SMALL, one_thread, prepare_tiny  # noqa: F401  (autouse: torch on one thread)

ROOT = Path(__file__).resolve().parents[1]
FAST = dict(batch_size=8, seq_len=32, lr=1e-2, eval_tokens=512, log_every=2, eval_every=0, depth_stats_every=0,
            checkpoint_every=0, threads=1, tokens=4 * 8 * 32)
CELL = Path("checkpoints") / "g" / "preln_L2"


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A project folder whose cell was trained with paths relative to it (cwd = the project)."""
    from depthtools.train import train_cell

    project = tmp_path_factory.mktemp("portable") / "project"
    (project / "notebooks").mkdir(parents=True)
    here = os.getcwd()
    os.chdir(project)
    try:
        data = prepare_tiny(Path("data"))
        assert not data.is_absolute()
        train_cell(ModelConfig(arch="preln", **SMALL), TrainConfig(**FAST), data, CELL)
    finally:
        os.chdir(here)
    return project


def _cli_lens(ckpt: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "cli", "lens", "--ckpt", str(ckpt), "--n-tokens", "64", "--seq-len",
                           "16", "--no-save", "--json"], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _probe_from(ckpt: Path, cwd: Path, monkeypatch, cli: bool = False) -> Path:
    """The data folder a probe of `ckpt` uses when run from `cwd`, by library call (and CLI subprocess)."""
    monkeypatch.chdir(cwd)
    found = checkpoint_data_dir(ckpt)
    assert eval_tokens(ckpt, None, 64, 16).shape[0] >= 1
    if cli:
        result = _cli_lens(ckpt, cwd)
        assert result.returncode == 0, result.stderr[-2000:]
        assert json.loads(result.stdout)  # the lens ran and printed its table
    return found


def test_data_is_recorded_absolute_and_relative_to_the_checkpoint(project):
    record = json.loads((project / CELL / "config.json").read_text())["data"]
    assert Path(record["path"]).is_absolute() and Path(record["path"]) == project / "data" / "text-dir"
    assert record["path_from_checkpoint"] == os.path.join("..", "..", "..", "data", "text-dir")


def test_probes_find_the_data_from_another_working_directory(project, monkeypatch):
    for cwd in (project / "notebooks", project.parent, Path("/")):
        assert _probe_from(project / CELL, cwd, monkeypatch, cli=cwd.name == "notebooks") == project / "data" / "text-dir"


def test_probes_find_the_data_after_the_tree_moves(project, tmp_path, monkeypatch):
    moved = tmp_path / "elsewhere" / "project-moved"
    shutil.copytree(project, moved)  # a copy, then the original goes: the recorded absolute path is gone
    hidden = project.with_name("project-hidden")
    project.rename(hidden)
    try:
        assert _probe_from(moved / CELL, moved / "notebooks", monkeypatch, cli=True) == moved / "data" / "text-dir"
        assert _probe_from(moved / CELL, tmp_path, monkeypatch) == moved / "data" / "text-dir"
    finally:
        hidden.rename(project)


def test_checkpoints_recorded_before_the_fix_work_where_they_did_and_below_the_project(project, tmp_path, monkeypatch):
    old = tmp_path / "old-project"
    shutil.copytree(project, old)
    config_path = old / CELL / "config.json"
    config = json.loads(config_path.read_text())
    config["data"] = {**config["data"], "path": "data/text-dir"}  # as the trainer wrote it before issue 35
    config["data"].pop("path_from_checkpoint", None)
    config_path.write_text(json.dumps(config))
    assert _probe_from(old / CELL, old, monkeypatch) == Path("data/text-dir")  # the training folder: as before
    assert _probe_from(old / CELL, old / "notebooks", monkeypatch, cli=True) == old / "data" / "text-dir"
    # a same-named folder nearer the cwd holding other data is not taken for it
    other = prepare_tiny(old / "notebooks" / "data", seed=5, name="text-dir")
    assert _probe_from(old / CELL, old / "notebooks", monkeypatch) == old / "data" / "text-dir"
    shutil.rmtree(old / "data")
    monkeypatch.chdir(old / "notebooks")
    with pytest.raises(DepthToolsError, match="no longer holds the data"):
        checkpoint_data_dir(old / CELL)
    assert other.is_dir()


def test_missing_data_is_still_one_line_naming_where_it_looked(project, tmp_path, monkeypatch):
    lonely = tmp_path / "lonely" / "preln_L2"
    shutil.copytree(project / CELL, lonely)
    config = json.loads((lonely / "config.json").read_text())
    config["data"]["path"] = str(tmp_path / "gone" / "text-dir")
    (lonely / "config.json").write_text(json.dumps(config))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DepthToolsError, match="does not exist.*--data") as err:
        checkpoint_data_dir(lonely)
    assert "\n" not in str(err.value)
    result = _cli_lens(lonely, tmp_path)
    assert result.returncode == 2 and "pass --data DIR" in result.stderr
