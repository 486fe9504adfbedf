"""Resuming an interrupted cell (issue 43, smaller items): a refused resume names the settings that
differ, and the temporary files a kill inside a checkpoint write left in train_state/ go when the run
resumes."""

from __future__ import annotations

from pathlib import Path

import pytest

from depthtools.config import ModelConfig, TrainConfig
from depthtools.errors import CheckpointError
from depthtools.train import train_cell
from depthtools.train.state import STATE_DIR

from tiny_models import SMALL, train_killed_after

MODEL = ModelConfig(arch="preln", **SMALL)
RECIPE = dict(tokens=6 * 4 * 16, batch_size=4, seq_len=16, eval_every=0, eval_tokens=256, checkpoint_every=2,
              log_every=1, threads=1)


@pytest.mark.parametrize("change, named", [
    ({"param_dtype": "bfloat16"}, "train.param_dtype (default) -> 'bfloat16'"),
    ({"weight_decay": 0.05}, "train.weight_decay 0.1 -> 0.05"),
])
def test_a_refused_resume_names_the_field_that_differs(change, named, data_dir, tmp_path):
    """Before, every such refusal said only "a different model, recipe or data"."""
    out = tmp_path / "cell"
    train_killed_after(3, MODEL, TrainConfig(**RECIPE), data_dir, out)
    assert (out / STATE_DIR / "latest.json").is_file()
    with pytest.raises(CheckpointError) as exc:
        train_cell(MODEL, TrainConfig(**RECIPE, **change), data_dir, out)
    assert named in str(exc.value) and "\n" not in str(exc.value), str(exc.value)


def test_a_resume_removes_temporary_files_of_a_killed_checkpoint_write(data_dir, tmp_path):
    out = tmp_path / "cell"
    train_killed_after(3, MODEL, TrainConfig(**RECIPE), data_dir, out)
    state = out / STATE_DIR
    leftovers = [state / ".step_00000004.safetensors.k3j9x2.tmp", state / ".latest.json.a8b7c6.tmp"]
    for path in leftovers:
        path.write_bytes(b"half a write")
    kept = state / "notes.txt"  # not ours: left alone
    kept.write_text("mine")
    seen: list[list[str]] = []

    def progress(event):  # the leftovers are gone before the first step of the resumed run
        if event["event"] == "start":
            seen.append(sorted(p.name for p in Path(state).glob(".*.tmp")))

    train_cell(MODEL, TrainConfig(**RECIPE, keep_train_state=True), data_dir, out, progress=progress)
    assert seen == [[]] and not any(p.exists() for p in leftovers) and kept.read_text() == "mine"
