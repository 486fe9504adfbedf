"""Where cells go, who can read them, and what a finished cell keeps (issue 22, "Concurrency and defaults")."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from typer.testing import CliRunner

from cli.main import app

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
