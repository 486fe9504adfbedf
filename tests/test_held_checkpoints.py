"""What a run may train over, and which cells count as done (issue 43, items 1, 9, 10, 13 and the
imported-cell status).

One rule (`depthtools.train.held_checkpoint`) decides for `train`, `grid train` and `grid status`:
a folder holding a finished run or an imported model is not trained over without --force, and a
finished cell whose weights no longer match its config.json (truncated, deleted, another dtype,
other tensors) is `damaged`: not done, and not retrained without --force either. `info` makes the
same header check, plus the values (an all-NaN file).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from cli.main import app
from depthtools import checkpoint as ck
from depthtools.arch import DepthModel
from depthtools.config import ModelConfig
from depthtools.grid import grid_spec, plan_grid, save_grid

from tiny_models import SMALL

runner = CliRunner()
TRAIN = ["--arch", "preln", "--layers", "2", "--d-model", "32", "--n-heads", "2", "--tokens", str(2 * 8 * 32),
         "--batch-size", "8", "--seq-len", "32", "--eval-every", "0", "--threads", "1"]


def _imported(directory: Path) -> Path:
    """A checkpoint as `import-hf` leaves it: weights, a config.json with a "source" and a tokenizer
    record, the carried tokenizer files, and no eval.json or training curve."""
    ck.save(DepthModel(ModelConfig(arch="preln", **SMALL), seed=3), directory, extra={
        "source": {"format": "huggingface-llama", "path": "/models/some-llama"}, "train": None,
        "tokenizer": {"name": "huggingface", "file": "tokenizer.json", "files": ["tokenizer.json"]}})
    (directory / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')
    (directory / "generation_config.json").write_text("{}")
    return directory


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def _one_line_refusal(result, *words: str) -> None:
    assert result.exit_code == 2, (result.output, result.exception)
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    for word in words:
        assert word in result.stderr, result.stderr


def test_train_refuses_an_imported_checkpoint_and_force_replaces_all_of_it(data_dir, tmp_path):
    """Item 1: `train --out <import>` replaced the weights and config.json and left the import's
    tokenizer beside a byte-level model. Now it is refused with nothing changed; --force replaces
    the import whole (its tokenizer and generation files go too)."""
    out = _imported(tmp_path / "llama")
    before = _snapshot(out)
    refused = runner.invoke(app, ["train", *TRAIN, "--data", str(data_dir), "--out", str(out)])
    _one_line_refusal(refused, str(out), "imported from huggingface-llama /models/some-llama", "--force")
    assert _snapshot(out) == before and not (out / "train_state").exists()

    forced = runner.invoke(app, ["train", *TRAIN, "--data", str(data_dir), "--out", str(out), "--force"])
    assert forced.exit_code == 0, (forced.output, forced.exception)
    assert (out / "eval.json").is_file() and "source" not in json.loads((out / "config.json").read_text())
    assert not (out / "tokenizer.json").exists() and not (out / "generation_config.json").exists()


def _weights_edit(cell: Path, edit) -> None:
    tensors = load_file(str(cell / ck.WEIGHTS))
    edit(tensors)
    save_file(tensors, str(cell / ck.WEIGHTS), metadata={"format": "pt"})


EDITS = {
    "int64": lambda t: t.__setitem__("blocks.0.mlp.w1.weight", (t["blocks.0.mlp.w1.weight"] * 100).to(torch.int64)),
    "wrong-shape": lambda t: t.__setitem__("blocks.0.mlp.w1.weight", t["blocks.0.mlp.w1.weight"][:, :-1].clone()),
    "missing-tensor": lambda t: t.pop("blocks.1.mlp.w1.weight"),
    "extra-tensor": lambda t: t.__setitem__("blocks.0.stray.weight", torch.zeros(3)),
}


def _finished(directory: Path) -> Path:
    """A finished-looking cell (weights, config, eval.json), as `finish` writes it."""
    ck.save(DepthModel(ModelConfig(arch="preln", **SMALL)), directory)
    ck.atomic_write_json(directory / "eval.json", {"step": 2, "tokens": 512, "val_loss": 3.1, "train_loss": 3.0,
                                                   "domains": {}})
    return directory


@pytest.mark.parametrize("how", [*EDITS, "all-nan"])
def test_info_warns_about_weights_that_do_not_match_the_config(how, tmp_path):
    """Item 10: dtype, names and shapes are in the header; NaN needs the values. Each edited file is
    one that `load` (safetensors + the model's own state dict) refuses or that would be a useless model."""
    cell = _finished(tmp_path / "c")
    _weights_edit(cell, EDITS[how] if how != "all-nan" else
                  (lambda t: t.__setitem__("blocks.0.mlp.w1.weight", torch.full_like(t["blocks.0.mlp.w1.weight"],
                                                                                       float("nan")))))
    with pytest.raises(ck.CheckpointError):  # the independent verdict: the loader refuses it too
        ck.load(cell)
    shown = runner.invoke(app, ["info", "--ckpt", str(cell), "--json"])
    assert shown.exit_code == 0, (shown.output, shown.exception)
    summary = json.loads(shown.stdout)
    assert summary["finished"] is False and summary["weights"] != "ok"
    assert "warning:" in shown.stderr and str(cell / ck.WEIGHTS) in shown.stderr.replace("\n", "")
    assert ck.weights_problem(cell / ck.WEIGHTS, summary["model"]) is not None or how == "all-nan"


def test_a_whole_finished_cell_is_finished_for_info(tmp_path):
    from depthtools.train import held_checkpoint

    cell = _finished(tmp_path / "c")
    ck.load(cell)
    assert ck.checkpoint_summary(cell)["finished"] is True and held_checkpoint(cell)["state"] == "finished"


def _grid(tmp_path: Path, data_dir: Path) -> tuple[Path, list]:
    cells = plan_grid(["preln"], budget=30_000, layers=[1, 2], n_heads=2, ffn_multiple=8, tolerance=0.3,
                      max_seq_len=32)
    spec = grid_spec(cells, name="g", train={"tokens": 2 * 8 * 32, "batch_size": 8, "seq_len": 32, "eval_every": 0,
                                             "eval_tokens": 512, "threads": 1}, data={"dir": str(data_dir)})
    return save_grid(spec, tmp_path / "grid.json"), cells


def _status(grid: Path, root: Path) -> dict[str, dict]:
    shown = runner.invoke(app, ["grid", "status", str(grid), "--root", str(root), "--json"])
    assert shown.exit_code == 0, (shown.output, shown.exception)
    return {row["cell"]: row for row in json.loads(shown.stdout)}


@pytest.mark.parametrize("how", ["truncated", "deleted", "int64"])
def test_grid_status_and_grid_train_do_not_count_a_damaged_cell_as_done(how, data_dir, tmp_path):
    """Item 9: a cell whose weights were cut short or deleted after eval.json was written showed as
    done, and `grid train` skipped it without a word. Now it is `damaged`; `grid train` leaves it,
    saying so, and retrains it with --force."""
    grid, cells = _grid(tmp_path, data_dir)
    root = tmp_path / "ck"
    first = runner.invoke(app, ["grid", "train", str(grid), "--root", str(root), "--data-root", str(tmp_path)])
    assert first.exit_code == 0, (first.output, first.exception)
    assert {r["state"] for r in _status(grid, root).values()} == {"done"}
    cell = root / "g" / cells[1].name
    weights = cell / ck.WEIGHTS
    if how == "truncated":
        weights.write_bytes(weights.read_bytes()[:-100])
    elif how == "deleted":
        weights.unlink()
    else:
        _weights_edit(cell, EDITS["int64"])
    rows = _status(grid, root)
    assert rows[cells[0].name]["state"] == "done"
    assert rows[cells[1].name]["state"] == "damaged" and str(weights) in rows[cells[1].name]["detail"]
    plain = runner.invoke(app, ["grid", "status", str(grid), "--root", str(root)])
    assert plain.exit_code == 0 and "damaged 1" in plain.stdout, plain.output

    again = runner.invoke(app, ["grid", "train", str(grid), "--root", str(root), "--data-root", str(tmp_path)])
    assert again.exit_code == 0, (again.output, again.exception)
    assert "DAMAGED" in again.stdout and "--force retrains it" in again.stdout.replace("\n", " "), again.stdout
    assert _status(grid, root)[cells[1].name]["state"] == "damaged"

    forced = runner.invoke(app, ["grid", "train", str(grid), "--root", str(root), "--data-root", str(tmp_path),
                                 "--cells", cells[1].name, "--force"])
    assert forced.exit_code == 0, (forced.output, forced.exception)
    assert _status(grid, root)[cells[1].name]["state"] == "done"
    ck.load(cell)


@pytest.mark.parametrize("loss", ['"abc"', "[1, 2]", "NaN", "{}"])
def test_grid_status_reads_a_hostile_eval_json_as_damaged(loss, data_dir, tmp_path):
    """Item 13: a string or list val_loss was a traceback (format of a str with :.4f)."""
    grid, cells = _grid(tmp_path, data_dir)
    root = tmp_path / "ck"
    for cell in cells:
        _finished(root / "g" / cell.name)
    (root / "g" / cells[0].name / "eval.json").write_text(f'{{"step": 2, "val_loss": {loss}}}')
    rows = _status(grid, root)
    assert rows[cells[0].name]["state"] == "damaged" and "val_loss" in rows[cells[0].name]["detail"]
    assert rows[cells[1].name]["state"] == "done"
    plain = runner.invoke(app, ["grid", "status", str(grid), "--root", str(root)])
    assert plain.exit_code == 0, (plain.output, plain.exception)


def test_grid_status_shows_an_imported_checkpoint_in_a_cell_folder_as_imported(data_dir, tmp_path):
    """Smaller item: it showed as `pending`, and `grid train` would then have trained over it."""
    grid, cells = _grid(tmp_path, data_dir)
    root = tmp_path / "ck"
    out = _imported(root / "g" / cells[0].name)
    before = _snapshot(out)
    row = _status(grid, root)[cells[0].name]
    assert row["state"] == "imported" and "imported from huggingface-llama" in row["detail"]
    ran = runner.invoke(app, ["grid", "train", str(grid), "--root", str(root), "--data-root", str(tmp_path)])
    assert ran.exit_code == 0, (ran.output, ran.exception)
    assert _snapshot(out) == before and "--force replaces it" in ran.stdout.replace("\n", " ")
    assert _status(grid, root)[cells[1].name]["state"] == "done"


def test_unknown_checkpoint_lists_each_name_once_with_its_folders(tmp_path):
    """Smaller item: the listing repeated a name once per grid (`available: preln_L2, preln_L2, ...`)."""
    for where in ("g1/preln_L2", "g2/preln_L2", "g1/hc_L2", "loose"):
        (tmp_path / where).mkdir(parents=True)
        (tmp_path / where / "config.json").write_text("{}")
    with pytest.raises(ck.CheckpointError) as exc:
        ck.resolve("preln_L9", root=tmp_path)
    listing = str(exc.value).split("available: ", 1)[1]
    assert listing.count("preln_L2") == 1 and "preln_L2 (in g1, g2)" in listing and "hc_L2 (in g1)" in listing
    assert "loose" in listing and "GRID/NAME" in listing


def test_train_refuses_a_finished_cell_whose_weights_are_damaged(data_dir, tmp_path):
    """The same rule for `train --out`: a finished cell with damaged weights is refused without --force
    (and named damaged), and retrained with it."""
    out = _finished(tmp_path / "cell")
    (out / ck.WEIGHTS).write_bytes((out / ck.WEIGHTS).read_bytes()[:-10])
    before = _snapshot(out)
    refused = runner.invoke(app, ["train", *TRAIN, "--data", str(data_dir), "--out", str(out)])
    _one_line_refusal(refused, "damaged checkpoint", "truncated", "--force")
    assert _snapshot(out) == before
    forced = runner.invoke(app, ["train", *TRAIN, "--data", str(data_dir), "--out", str(out), "--force"])
    assert forced.exit_code == 0, (forced.output, forced.exception)
    ck.load(out)
