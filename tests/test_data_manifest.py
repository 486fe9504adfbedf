"""A dataset's meta.json names only files inside its folder, its fingerprint covers every split file,
and a run checks the files against their recorded sha256 before training (issue 43, item 7).

Before: `splits.*.file` could be '../x' or an absolute path and was trained on and evaluated;
`tokenizer.file = "meta.json"` passed the name rule; a split record edited to name another file kept
the old data fingerprint; a split file changed after preparation was trained on without a word.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from cli.main import app
from depthtools.data import load_split, prepare_inputs, read_meta
from depthtools.errors import DepthToolsError

from tiny_models import TINY_CORPUS, prepare_tiny

runner = CliRunner()
TRAIN = ["train", "--arch", "preln", "--layers", "2", "--d-model", "32", "--n-heads", "2", "--tokens", str(2 * 8 * 32),
         "--batch-size", "8", "--seq-len", "32", "--eval-every", "0", "--threads", "1"]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    return prepare_tiny(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("sharded")
    return prepare_inputs([str(p) for p in sorted(TINY_CORPUS.glob("*.txt"))], out_dir=folder, val_fraction=0.3,
                          shard_tokens=4096)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit(folder: Path, edit) -> None:
    meta = json.loads((folder / "meta.json").read_text())
    edit(meta)
    (folder / "meta.json").write_text(json.dumps(meta))


def _one_line(exc: pytest.ExceptionInfo, *words: str) -> None:
    text = str(exc.value)
    assert "\n" not in text
    for word in words:
        assert word in text, text


OUTSIDE = ["../outside.bin", "/etc/hostname", "sub/../../x.bin", "", 7, None, ".hidden.bin"]


@pytest.mark.parametrize("bad", OUTSIDE)
def test_a_split_file_outside_the_folder_is_refused(bad, prepared, tmp_path):
    folder = _copy(prepared, tmp_path / "d")
    (tmp_path / "outside.bin").write_bytes((folder / "train.bin").read_bytes())
    _edit(folder, lambda m: m["splits"]["train"].__setitem__("file", bad))
    with pytest.raises(DepthToolsError) as exc:
        load_split(folder, "train")
    _one_line(exc, "splits.train.file")


@pytest.mark.parametrize("key", ["file", "index"])
def test_a_shard_outside_the_folder_is_refused(key, sharded, tmp_path):
    folder = _copy(sharded, tmp_path / "d")
    read_meta(folder)
    _edit(folder, lambda m: m["splits"]["val"]["shards"][0].__setitem__(key, "../../escape.bin"))
    with pytest.raises(DepthToolsError) as exc:
        read_meta(folder)
    _one_line(exc, f"splits.val.shards[0].{key}")


@pytest.mark.parametrize("name", ["meta.json", "splits.json", "train.bin"])
def test_tokenizer_file_may_not_name_the_datasets_own_files(name, prepared, tmp_path):
    folder = _copy(prepared, tmp_path / "d")
    _edit(folder, lambda m: m["tokenizer"].__setitem__("file", name))
    with pytest.raises(DepthToolsError) as exc:
        read_meta(folder)
    _one_line(exc, "tokenizer.file", name)


def test_the_fingerprint_covers_every_split_file(prepared, tmp_path):
    """Pointing a split at another file (with its sha256, so nothing else looks wrong) changes the
    files the run reads: the recorded fingerprint no longer matches the records and meta.json is refused."""
    meta = read_meta(prepared)
    domain = next(k for k in meta["splits"] if k.startswith("val_"))
    folder = _copy(prepared, tmp_path / "d")
    _edit(folder, lambda m: m["splits"].__setitem__(domain, {**m["splits"]["val"], "domain": m["splits"][domain]["domain"]}))
    with pytest.raises(DepthToolsError) as exc:
        read_meta(folder)
    _one_line(exc, "data_fingerprint", "edited")
    # the fingerprint is sha256 over the tokenizer and every split's files: recompute it independently
    parts = [meta["tokenizer"]["fingerprint"]]
    for key in sorted(meta["splits"]):
        split = meta["splits"][key]
        parts += [key, split["sha256"], split["file"], hashlib.sha256((prepared / split["file"]).read_bytes()).hexdigest()]
    assert meta["data_fingerprint"] == hashlib.sha256("\0".join(parts).encode()).hexdigest()


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_a_run_refuses_data_changed_after_preparation(layout, prepared, sharded, tmp_path):
    folder = _copy(prepared if layout == "single" else sharded, tmp_path / "d")
    meta = read_meta(folder)
    changed = meta["splits"]["train"]["file"] if layout == "single" else meta["splits"]["train"]["shards"][0]["file"]
    tokens = np.fromfile(folder / changed, dtype=meta.get("dtype", "uint16"))
    tokens[5] = (int(tokens[5]) + 1) % 256  # same size, same vocabulary: only the sha256 can tell
    tokens.tofile(folder / changed)
    out = tmp_path / "cell"
    result = runner.invoke(app, [*TRAIN, "--data", str(folder), "--out", str(out)])
    assert result.exit_code == 2, (result.output, result.exception)
    assert len(result.stderr.strip().splitlines()) == 1 and changed in result.stderr and "sha256" in result.stderr
    assert not out.exists()


def test_untouched_data_trains(prepared, tmp_path):
    result = runner.invoke(app, [*TRAIN, "--data", str(prepared), "--out", str(tmp_path / "cell")])
    assert result.exit_code == 0, (result.output, result.exception)


@pytest.mark.parametrize("command", [["lens"], ["analyze", "--only", "lens_logit"]])
def test_data_naming_a_file_is_refused_and_points_to_text(command, tmp_path):
    """Item 6: `--data FILE` (the help says a prepared data folder) was tokenized as text, silently."""
    from depthtools import checkpoint as ck
    from depthtools.arch import DepthModel
    from depthtools.config import ModelConfig

    from tiny_models import SMALL

    cell = ck.save(DepthModel(ModelConfig(arch="preln", **SMALL)), tmp_path / "cell",
                   extra={"tokenizer": {"name": "byte", "vocab_size": 256, "sep_id": 0}})
    text = tmp_path / "notes.txt"
    text.write_text("A plain text file, not a prepared dataset folder. " * 20)
    result = runner.invoke(app, [*command, "--ckpt", str(cell), "--data", str(text), "--n-tokens", "32",
                                 "--seq-len", "16"])
    assert result.exit_code == 2, (result.output, result.exception)
    assert len(result.stderr.strip().splitlines()) == 1 and f"--text {text}" in result.stderr, result.stderr
    assert not (cell / "analysis").exists()
    ran = runner.invoke(app, [*command, "--ckpt", str(cell), "--text", str(text), "--n-tokens", "32", "--seq-len", "16"])
    assert ran.exit_code == 0, (ran.output, ran.exception)


def test_train_data_naming_a_file_points_to_data_prepare(tmp_path):
    """`train --data FILE` was refused as an unknown corpus; it now says how to make the file a dataset."""
    text = tmp_path / "notes.txt"
    text.write_text("Some text. " * 50)
    result = runner.invoke(app, [*TRAIN, "--data", str(text), "--out", str(tmp_path / "cell")])
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1
    assert f"depthtools data prepare --input {text}" in result.stderr and not (tmp_path / "cell").exists()
