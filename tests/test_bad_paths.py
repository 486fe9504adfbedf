"""Output paths that cannot be written, and metadata that cannot be read: one line, exit 2 (issue 22).

Each case runs the real command on real files; the one line on stderr must name the path and the
cause, and nothing is written.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app

from tiny_models import SMALL, TINY_CORPUS, prepare_tiny

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    """No case may write into the repository's own checkpoints/ or data/ (a wrong --out would)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DEPTHTOOLS_CHECKPOINTS", str(tmp_path / "default-checkpoints"))


def refused(args: list, *words: str) -> str:
    """Run the CLI; assert exit 2 with one error line on stderr holding every word; return that line. A probe's
    one-line cost plan ("plan <ckpt> ...", printed before it runs) and its plain progress lines ("[m:ss] ...",
    printed when stderr is not a terminal) may precede it."""
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = [line for line in result.stderr.strip().splitlines()
             if line.strip() and not line.startswith("plan ") and not re.match(r"\[\d+:\d\d\] ", line)]
    assert len(lines) == 1, result.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def _train(data_dir, out) -> list:
    return ["train", "--arch", "preln", "--layers", "2", "--d-model", "32", "--n-heads", "2", "--data", data_dir,
            "--out", out, "--tokens", "512", "--batch-size", "8", "--seq-len", "32", "--threads", "1"]


def _tiny_spec(tmp_path: Path, data_dir: Path) -> Path:
    from depthtools.grid import grid_spec, plan_grid, save_grid

    cells = plan_grid(["preln"], budget=30_000, layers=[1], n_heads=2, ffn_multiple=8, tolerance=0.15, max_seq_len=32)
    train = {"tokens": 512, "batch_size": 8, "seq_len": 32, "eval_every": 0, "eval_tokens": 512, "threads": 1}
    return save_grid(grid_spec(cells, name="g", train=train, data={"dir": str(data_dir)}), tmp_path / "g.json")


# (name, build the args from (tmp_path, data_dir, a regular file, a folder), words of the one line)
OUT_PATHS = [
    ("train --out FILE", lambda t, d, f, _: _train(d, f), ["cell folder (--out)", "is an existing file, not a folder"]),
    ("train --out FILE/cell", lambda t, d, f, _: _train(d, f / "cell"), ["cannot be created", "is a file, not a folder"]),
    ("grid plan --out FOLDER", lambda t, d, f, folder: ["grid", "plan", "--preset", "tiny", "--out", folder],
     ["grid spec file (--out)", "is a folder; give a file name"]),
    ("grid plan --out FILE/x.json", lambda t, d, f, _: ["grid", "plan", "--preset", "tiny", "--out", f / "x.json"],
     ["cannot be created", "is a file"]),
    ("data prepare --out FILE", lambda t, d, f, _: ["data", "prepare", "--corpus", "text-dir", "--text-dir", TINY_CORPUS,
                                                    "--out", f], ["data folder (--out)", "is an existing file"]),
    ("data prepare --input --out FILE", lambda t, d, f, _: ["data", "prepare", "--input", TINY_CORPUS, "--out", f],
     ["data folder (--out)", "is an existing file"]),
    ("grid train --root FILE", lambda t, d, f, _: ["grid", "train", _tiny_spec(t, d), "--root", f],
     ["checkpoint root (--root)", "is an existing file"]),
]


@pytest.mark.parametrize("name,build,words", OUT_PATHS, ids=[c[0] for c in OUT_PATHS])
def test_an_output_path_that_is_the_wrong_kind_of_thing_is_one_line(name, build, words, tmp_path, data_dir):
    existing, folder = tmp_path / "notes.txt", tmp_path / "folder.json"
    existing.write_text("keep me")
    folder.mkdir()
    args = build(tmp_path, data_dir, existing, folder)
    line = refused(args, *words)
    assert str(existing) in line or str(folder) in line, line
    assert existing.read_text() == "keep me" and not any(folder.iterdir())


# -- metadata that is not what it should be ---------------------------------------------------------
DEEP = "[" * 200_000 + "]" * 200_000  # json.loads: RecursionError


def _cell(directory: Path) -> Path:
    from depthtools import checkpoint as ck
    from depthtools.arch import DepthModel
    from depthtools.config import ModelConfig

    return ck.save(DepthModel(ModelConfig(arch="preln", **SMALL), seed=0), directory)


def _config(cell: Path, text: str) -> None:
    (cell / "config.json").write_text(text)


def _model_section(cell: Path, value) -> None:
    import json

    config = json.loads((cell / "config.json").read_text())
    config["model"] = value
    (cell / "config.json").write_text(json.dumps(config))


# (name, how the cell is damaged, words of the one line). Each runs `info` (reads config, metrics, eval)
# and `lens` (loads the model).
BROKEN_CELLS = [
    ("config.json a list", lambda c: _config(c, "[1, 2]"), ["config.json", "a JSON object", "list"]),
    ("config.json a string", lambda c: _config(c, '"preln"'), ["config.json", "a JSON object", "str"]),
    ("config.json nested 200k deep", lambda c: _config(c, DEEP), ["config.json", "nested too deeply"]),
    ("config.json not UTF-8", lambda c: (c / "config.json").write_bytes(b'{"model": "\xff\xfe"}'),
     ["config.json", "not UTF-8"]),
    ("model section a list", lambda c: _model_section(c, [1, 2]), ["config.json", "'model'", "list"]),
    ("model section a string", lambda c: _model_section(c, "preln"), ["config.json", "'model'", "str"]),
    ("metrics.jsonl not UTF-8", lambda c: (c / "metrics.jsonl").write_bytes(b'{"step": 1}\n\xff\xfe\x00garbage\n'),
     ["metrics.jsonl", "line 2", "not UTF-8"]),
    ("metrics.jsonl a record that is a list", lambda c: (c / "metrics.jsonl").write_text('{"step": 1}\n[1, 2]\n'),
     ["metrics.jsonl", "line 2", "not a JSON object"]),
    ("eval.json a list", lambda c: (c / "eval.json").write_text("[]"), ["eval.json", "a JSON object", "list"]),
]


@pytest.mark.parametrize("name,damage,words", BROKEN_CELLS, ids=[c[0] for c in BROKEN_CELLS])
def test_malformed_checkpoint_metadata_is_one_line_naming_the_file(name, damage, words, tmp_path, data_dir):
    cell = _cell(tmp_path / "g" / "preln_L2")
    (cell / "metrics.jsonl").write_text('{"step": 1, "train_loss": 5.0}\n')
    damage(cell)
    line = refused(["info", "--ckpt", cell], *words)
    assert str(cell) in line, line
    if "metrics" not in name and "eval" not in name:  # loading the model reads config.json only
        refused(["lens", "--ckpt", cell, "--data", data_dir, "--n-tokens", "64", "--seq-len", "16", "--no-save"],
                *words)


def _interrupted_cell(data_dir: Path, out: Path) -> Path:
    """A real run stopped after its step-2 checkpoint (train_state/ holds step 2)."""
    from depthtools.config import ModelConfig, TrainConfig
    from depthtools.train import train_cell

    class Stop(Exception):
        pass

    def progress(event):
        if event["event"] == "step" and event["step"] >= 3:
            raise Stop

    recipe = TrainConfig(tokens=4 * 8 * 32, batch_size=8, seq_len=32, eval_tokens=512, eval_every=0, log_every=1,
                         depth_stats_every=0, checkpoint_every=2, threads=1)
    with pytest.raises(Stop):
        train_cell(ModelConfig(arch="preln", **SMALL), recipe, data_dir, out, progress=progress)
    assert (out / "train_state" / "step_00000002.json").is_file()
    return out / "train_state"


def _edit_json(path: Path, change) -> None:
    import json

    obj = json.loads(path.read_text())
    change(obj)
    path.write_text(json.dumps(obj))


def _drop_tensor(path: Path, key: str) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    del tensors[key]
    save_file(tensors, str(path))


def _retype_tensor(path: Path, key: str) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    tensors[key] = tensors[key].float()
    save_file(tensors, str(path))


BROKEN_STATES = [  # (name, damage, words of the one-line refusal; None: resumes from the intact pair, saying so)
    ("latest.json 'state' an int", lambda s: _edit_json(s / "latest.json", lambda o: o.update(state=5)), None),
    ("latest.json a list", lambda s: (s / "latest.json").write_text("[2]"), None),
    ("latest.json nested 200k deep", lambda s: (s / "latest.json").write_text(DEEP), None),
    ("step JSON without optimizer", lambda s: _edit_json(s / "step_00000002.json", lambda o: o.pop("optimizer")),
     ["latest.json", "step_00000002.json", "not a complete train state", "no intact"]),
    ("step JSON 'optimizer' a list", lambda s: _edit_json(s / "step_00000002.json", lambda o: o.update(optimizer=[])),
     ["step_00000002.json", "not a complete train state"]),
    ("step JSON a list", lambda s: (s / "step_00000002.json").write_text("[]"),
     ["step_00000002.json", "a JSON object"]),
    ("step JSON nested 200k deep", lambda s: (s / "step_00000002.json").write_text(DEEP),
     ["step_00000002.json", "nested too deeply"]),
    ("step JSON optimizer without param_groups",
     lambda s: _edit_json(s / "step_00000002.json", lambda o: o["optimizer"].pop("param_groups")),
     ["step_00000002", "cannot be restored", "KeyError"]),
    ("step JSON optimizer scalars a list",
     lambda s: _edit_json(s / "step_00000002.json", lambda o: o["optimizer"].update(scalars=[1])),
     ["step_00000002", "cannot be restored"]),
    ("train state RNG tensor of the wrong dtype",
     lambda s: _retype_tensor(s / "step_00000002.safetensors", "rng/torch_cpu"), ["step_00000002", "cannot be restored"]),
    ("train state without its RNG tensor", lambda s: _drop_tensor(s / "step_00000002.safetensors", "rng/torch_cpu"),
     ["step_00000002.safetensors", "RNG state"]),
]


@pytest.mark.parametrize("name,damage,words", BROKEN_STATES, ids=[c[0] for c in BROKEN_STATES])
def test_malformed_train_state_is_one_line_and_kept(name, damage, words, tmp_path, data_dir, caplog):
    out = tmp_path / "cell"
    state = _interrupted_cell(data_dir, out)
    damage(state)
    before = {p.name: p.read_bytes() for p in state.iterdir()}
    args = [*_train(data_dir, out)[:-8], "--tokens", 4 * 8 * 32, "--batch-size", "8", "--seq-len", "32",
            "--checkpoint-every", "2", "--log-every", "1", "--eval-every", "0", "--threads", "1"]
    if words is not None:
        refused(args, *words, "--force")
        assert {p.name: p.read_bytes() for p in state.iterdir()} == before  # nothing discarded
        return
    with caplog.at_level("WARNING", logger="depthtools.train.state"):  # a bad pointer: the intact pair is used
        result = runner.invoke(app, [*map(str, args), "--json"])
    assert result.exit_code == 0, (result.output, result.exception)
    assert json.loads(result.stdout)["resumed_from"] == 2
    assert "latest.json" in caplog.text and "resuming from the newest intact train state instead, step 2" in caplog.text


BROKEN_DATA = [
    ("meta.json a list", lambda d: (d / "meta.json").write_text("[]"), ["meta.json", "a JSON object", "list"]),
    ("meta.json nested 200k deep", lambda d: (d / "meta.json").write_text(DEEP), ["meta.json", "nested too deeply"]),
    ("meta.json not UTF-8", lambda d: (d / "meta.json").write_bytes(b"{\xff}"), ["meta.json", "not UTF-8"]),
    ("meta.json splits a list", lambda d: _edit_json(d / "meta.json", lambda o: o.update(splits=[])),
     ["meta.json", "'splits'"]),
]


@pytest.mark.parametrize("name,damage,words", BROKEN_DATA, ids=[c[0] for c in BROKEN_DATA])
def test_malformed_dataset_metadata_is_one_line(name, damage, words, tmp_path):

    data = prepare_tiny(tmp_path / "data")
    damage(data)
    refused(_train(data, tmp_path / "cell"), *words)
    assert not (tmp_path / "cell" / "model.safetensors").exists()


def test_a_grid_spec_that_is_not_an_object_is_one_line(tmp_path):
    for text, words in (("[]", ["a JSON object", "list"]), (DEEP, ["nested too deeply"])):
        (tmp_path / "g.json").write_text(text)
        refused(["grid", "train", tmp_path / "g.json", "--root", tmp_path / "ck"], "g.json", *words)
        refused(["grid", "status", tmp_path / "g.json", "--root", tmp_path / "ck"], "g.json", *words)


# -- a config.json that does not describe its weights: refused from the header, before any allocation -----
ABSURD_CONFIGS = [  # (field, value, words): each would have tried to allocate terabytes (or a million blocks)
    ("d_model", 2**20, ["tok_embed.weight has shape (256, 32)", "config implies (256, 1048576)"]),
    ("vocab_size", 10**12, ["tok_embed.weight has shape (256, 32)", "(1000000000000, 32)"]),
    ("n_layer", 10**6, ["n_layer=1000000", "the weights hold 2 blocks"]),
    ("d_ff", 2**30, ["blocks.0.", "config implies"]),
]


@pytest.mark.parametrize("field,value,words", ABSURD_CONFIGS, ids=[c[0] for c in ABSURD_CONFIGS])
def test_a_config_that_does_not_match_the_weights_header_is_refused_before_building_the_model(
        field, value, words, tmp_path, data_dir):
    import resource
    import time

    from depthtools import checkpoint as ck

    cell = _cell(tmp_path / "g" / "preln_L2")
    _edit_json(cell / "config.json", lambda o: o["model"].update({field: value}))
    rss_before, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.perf_counter()
    with pytest.raises(ck.CheckpointError) as err:
        ck.load(cell)
    assert all(w in str(err.value) for w in words), str(err.value)
    assert time.perf_counter() - t0 < 10
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 200_000  # KiB: nothing of that size
    refused(["lens", "--ckpt", cell, "--data", data_dir, "--n-tokens", "64", "--seq-len", "16", "--no-save"], *words)


# -- permission and disk errors: one line naming the path and the cause, no traceback --------------------
def _limited(max_bytes: int):
    """A child process whose files cannot grow past max_bytes: writes fail with EFBIG ("File too large"),
    as they do on a full disk or quota (SIGXFSZ ignored, so write() returns the error). Works as root."""
    import resource
    import signal

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, max_bytes))

    return limit


def _cli(args: list, max_bytes: int):
    import os
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "cli", *map(str, args)], capture_output=True, text=True, timeout=300,
                          preexec_fn=_limited(max_bytes), env={**os.environ, "OMP_NUM_THREADS": "1"})


def _one_line(proc, *words: str) -> str:
    """Exit 2 and one error line (progress log lines may precede it on stderr), no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = [line for line in proc.stderr.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def test_a_full_disk_while_training_is_one_line_naming_the_file(tmp_path, data_dir):
    """The weights (~170 KB) cannot be written: safetensors raises a SafetensorError naming no file."""
    out = tmp_path / "cell"
    proc = _cli(_train(data_dir, out), max_bytes=100_000)
    _one_line(proc, f"cannot write {out / 'model.safetensors'}", "File too large")
    assert not (out / "model.safetensors").exists() and not list(out.glob(".model.safetensors.*"))
    assert not (out / "eval.json").exists()


def test_a_full_disk_while_preparing_data_is_one_line_naming_the_file(tmp_path):
    proc = _cli(["data", "prepare", "--corpus", "text-dir", "--text-dir", TINY_CORPUS, "--out", tmp_path / "data",
                 "--name", "mine", "--val-fraction", "0.3"], max_bytes=20_000)
    _one_line(proc, "cannot write", "train.bin", "is the disk full?")
    assert not (tmp_path / "data" / "mine").exists()
    assert [p.name for p in (tmp_path / "data").iterdir()] == []  # no staging folder or lock left


def test_an_analysis_folder_that_cannot_be_written_is_one_line(tmp_path, data_dir):
    cell = _cell(tmp_path / "g" / "preln_L2")
    (cell / "analysis").write_text("a file where the analysis folder goes")
    refused(["lens", "--ckpt", cell, "--data", data_dir, "--n-tokens", "64", "--seq-len", "16"],
            f"cannot write {cell / 'analysis'}", "File exists")


def test_a_folder_the_system_refuses_is_one_line(tmp_path, data_dir):
    """/sys refuses new folders even to root (EPERM): a real PermissionError from mkdir."""
    refused(_train(data_dir, "/sys/depthtools-test-cell/cell"), "cannot use /sys/depthtools-test-cell",
            "not permitted")


@pytest.mark.skipif(not hasattr(__import__("os"), "geteuid") or __import__("os").geteuid() == 0,
                    reason="root writes into read-only folders; the EFBIG, /sys and file-as-folder cases cover root")
def test_a_read_only_cell_is_one_line(tmp_path, data_dir):
    cell = _cell(tmp_path / "g" / "preln_L2")
    cell.chmod(0o555)
    try:
        refused(["lens", "--ckpt", cell, "--data", data_dir, "--n-tokens", "64", "--seq-len", "16"],
                "cannot write", str(cell), "Permission denied")
    finally:
        cell.chmod(0o755)


@pytest.mark.skipif(not Path("/proc/self/mem").exists(), reason="needs Linux /proc")
def test_a_weights_file_that_cannot_be_read_is_not_called_corrupt(tmp_path, data_dir):
    """An I/O error reading the weights (here /proc/self/mem, which cannot be mapped: ENODEV even for
    root) names the file and the OS's reason instead of calling the file corrupt."""
    import os

    cell = _cell(tmp_path / "g" / "preln_L2")
    (cell / "model.safetensors").unlink()
    os.symlink("/proc/self/mem", cell / "model.safetensors")
    refused(["lens", "--ckpt", cell, "--data", data_dir, "--n-tokens", "64", "--seq-len", "16", "--no-save"],
            f"cannot read weights file {cell / 'model.safetensors'}", "No such device")
