"""`info` and `report` say when a finished cell's weights are missing or damaged (issue 35, item 9).

A cell with eval.json is "finished" as far as training goes, but if its model.safetensors was
deleted, cut short (a full disk, an interrupted copy) or overwritten, nothing can load or probe it.
`info` must not say `finished True` for it, and a report must warn instead of silently including
it. The verdict comes from the safetensors header alone; each damaged file here is checked against
safetensors' own loader, which must refuse exactly the files the header read calls damaged.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import SafetensorError
from safetensors.torch import load_file
from typer.testing import CliRunner

from cli.main import app
from depthtools import checkpoint as ck
from depthtools.arch import DepthModel
from depthtools.config import ModelConfig

from tiny_models import SMALL

runner = CliRunner()


def _cell(directory: Path, seed: int = 0) -> Path:
    """A finished-looking cell: weights, config, a two-record training curve and eval.json."""
    ck.save(DepthModel(ModelConfig(arch="preln", **SMALL), seed=seed), directory)
    records = [{"step": s, "tokens": 256 * s, "train_loss": 5.0 - s, "val_loss": 5.1 - s} for s in (1, 2)]
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    ck.atomic_write_json(directory / "eval.json", {"step": 2, "tokens": 512, "val_loss": 3.1, "train_loss": 3.0,
                                                   "domains": {}})
    return directory


def _damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "missing":
        path.unlink()
    elif how == "truncated-half":
        path.write_bytes(data[: len(data) // 2])
    elif how == "truncated-1-byte":
        path.write_bytes(data[:-1])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "header-only":
        length = int.from_bytes(data[:8], "little")
        path.write_bytes(data[: 8 + length])
    elif how == "garbage":
        path.write_bytes(b"\x07" * 8 + b"not a header" * 100)
    elif how == "garbage-json-header":
        header = b'{"tok_embed.weight": [1, 2, 3]}'
        path.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 64)
    elif how == "extra-bytes":
        path.write_bytes(data + b"\0" * 10)
    else:
        raise AssertionError(how)


DAMAGE = ["missing", "truncated-half", "truncated-1-byte", "empty", "header-only", "garbage", "garbage-json-header",
          "extra-bytes"]


@pytest.mark.parametrize("how", DAMAGE)
def test_header_verdict_agrees_with_the_loader(how, tmp_path):
    cell = _cell(tmp_path / "c")
    assert ck.weights_problem(cell / ck.WEIGHTS) is None
    load_file(str(cell / ck.WEIGHTS))  # the loader takes the whole file
    _damage(cell / ck.WEIGHTS, how)
    problem = ck.weights_problem(cell / ck.WEIGHTS)
    assert problem is not None and str(cell / ck.WEIGHTS) in problem and "\n" not in problem
    assert ("missing" if how == "missing" else "damaged") in problem
    with pytest.raises((SafetensorError, FileNotFoundError, OSError)):
        load_file(str(cell / ck.WEIGHTS))


@pytest.mark.parametrize("how", ["missing", "truncated-half", "truncated-1-byte", "garbage"])
def test_info_does_not_call_a_cell_with_damaged_weights_finished(how, tmp_path):
    good, bad = _cell(tmp_path / "g" / "preln_L2"), _cell(tmp_path / "g" / "bad_L2")
    shown = runner.invoke(app, ["info", "--ckpt", str(good), "--json"])
    assert shown.exit_code == 0 and json.loads(shown.stdout)["finished"] is True
    assert json.loads(shown.stdout)["weights"] == "ok" and "warning" not in shown.stderr

    _damage(bad / ck.WEIGHTS, how)
    shown = runner.invoke(app, ["info", "--ckpt", str(bad), "--json"])
    assert shown.exit_code == 0, shown.output
    info = json.loads(shown.stdout)
    assert info["finished"] is False and ("missing" in info["weights"] or "damaged" in info["weights"])
    warning = shown.stderr.strip().splitlines()
    assert len(warning) == 1 and warning[0].startswith("warning:") and "model.safetensors" in warning[0]
    table = runner.invoke(app, ["info", "--ckpt", str(bad)])
    assert table.exit_code == 0 and "weights" in table.stdout and "warning:" in table.stderr


@pytest.mark.parametrize("how", ["missing", "truncated-half"])
def test_report_warns_about_a_cell_with_damaged_weights(how, tmp_path):
    grid = tmp_path / "g"
    _cell(grid / "preln_L2")
    bad = _cell(grid / "preln_L2b", seed=1)
    out = tmp_path / "r.html"
    clean = runner.invoke(app, ["report", "--grid", str(grid), "-o", str(out)])
    assert clean.exit_code == 0, clean.output
    assert "warning" not in clean.stderr and "Weights missing or damaged" not in out.read_text()

    _damage(bad / ck.WEIGHTS, how)
    result = runner.invoke(app, ["report", "--grid", str(grid), "-o", str(out)])
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "preln_L2b" in warnings[0], result.stderr
    html = out.read_text()
    assert "Weights missing or damaged" in html and "preln_L2b" in html.split("Weights missing or damaged")[1][:2000]
    if how != "missing":  # a readable cell is reported (its losses predate the damage), with the warning
        single = runner.invoke(app, ["report", "--ckpt", str(bad), "-o", str(tmp_path / "one.html")])
        assert single.exit_code == 0 and "preln_L2b" in single.stderr
        assert "Weights missing or damaged" in (tmp_path / "one.html").read_text()
