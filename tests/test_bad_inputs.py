"""Bad inputs that used to give a wrong result with exit code 0 (issue 22, "fix first").

Each must now be refused with one line on stderr and exit code 2 (the CLI's DepthToolsError
contract), or, where a library call is the natural level, with a one-line DepthToolsError.
Real files and real small models throughout.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app
from depthtools import checkpoint as ck
from depthtools.arch import DepthModel
from depthtools.config import ModelConfig
from depthtools.errors import DepthToolsError

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "tiny_corpus"
SMALL = dict(vocab_size=256, d_model=32, n_layer=2, n_heads=2, max_seq_len=32)

runner = CliRunner()


def refused(args: list[str], *words: str) -> str:
    """Run the CLI; assert exit 2 with one line on stderr holding every word; return that line."""
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 2, (result.exit_code, result.output, result.stderr, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def save_model(directory: Path, **changes) -> Path:
    return ck.save(DepthModel(ModelConfig(arch="preln", **{**SMALL, **changes}), seed=0), directory)


# -- checkpoint names match whole path components --------------------------------------------------
def test_names_with_a_slash_match_whole_path_components(tmp_path, monkeypatch):
    save_model(tmp_path / "xgridC" / "preln_L2")
    monkeypatch.setenv("DEPTHTOOLS_CHECKPOINTS", str(tmp_path))
    with pytest.raises(ck.CheckpointError, match="unknown checkpoint 'gridC/preln_L2'"):
        ck.resolve("gridC/preln_L2")
    refused(["info", "--ckpt", "gridC/preln_L2"], "unknown checkpoint", "gridC/preln_L2")
    save_model(tmp_path / "gridC" / "preln_L2")  # the real one: found, and not ambiguous with xgridC
    assert ck.resolve("gridC/preln_L2") == tmp_path / "gridC" / "preln_L2"
    assert ck.resolve("xgridC/preln_L2/") == tmp_path / "xgridC" / "preln_L2"


# -- a head count of 0 is an error, not "use the default" ------------------------------------------
@pytest.mark.parametrize("args", [
    ["train", "--arch", "preln", "--layers", "2", "--d-model", "32", "--n-heads", "0"],
    ["train", "--arch", "preln", "--layers", "2", "--budget", "100k", "--n-heads", "0", "--preset-recipe", "tiny"],
    ["grid", "plan", "--arch", "preln", "--budget", "100k", "--layers", "2,4", "--n-heads", "0"],
])
def test_zero_heads_is_refused(args, data_dir, tmp_path):
    if args[0] == "train":
        args = [*args, "--data", data_dir, "--out", tmp_path / "cell", "--tokens", "64"]
    refused(args, "--n-heads", "0")
    assert not (tmp_path / "cell").exists()
