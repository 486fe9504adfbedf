"""A killed import's hidden staging folder (`.<target>.<random>.import.tmp`) is removed by the next import of the
same target, and only when its owner process is gone (issue 43, closing note "Left", item 1).

The killed import is a real `python` process, stopped by SIGKILL while its checkpoint is half written; the live
one is a real process blocked in the same place. Owner records of another host are written by hand (their
flock cannot be held from here): a fresh heartbeat keeps the folder, a stale one lets it go.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from test_import_checks import good_hf  # noqa: F401  (fixture: a valid tiny Llama folder with a tokenizer)
from typer.testing import CliRunner

from cli.main import app
from depthtools import checkpoint as ck
from depthtools.fsutil import STAGING_OWNER, StagingFolder, remove_dead_staging
from depthtools.interop.llama import IMPORT_STAGING

from tiny_models import one_thread  # noqa: F401  (autouse: torch on one thread)

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]

# An import that blocks once the weights of its checkpoint are written (the config not yet): it says so by
# creating READY, then sleeps until it is killed. The import itself is the real one; only `save` is wrapped.
BLOCKING_IMPORT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import depthtools.interop.llama as llama
    real = llama.save
    def save(model, folder, **kwargs):
        real(model, folder, **kwargs)
        (Path(folder) / "config.json").unlink()  # half written: the weights are there, the config is not
        Path(sys.argv[3]).write_text(str(folder))
        time.sleep(600)
    llama.save = save
    llama.import_hf(sys.argv[1], out=sys.argv[2], force=True)
""")


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1"}


def _start_blocked_import(source: Path, target: Path, ready: Path) -> tuple[subprocess.Popen, Path]:
    """A real import process stopped inside its staging folder; returns (process, staging folder)."""
    proc = subprocess.Popen([sys.executable, "-c", BLOCKING_IMPORT, str(source), str(target), str(ready)],
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 180
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the blocked import did not start: {proc.communicate()[1].decode()[-2000:]}")
        time.sleep(0.05)
    return proc, Path(ready.read_text())


def _staging_folders(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.endswith(IMPORT_STAGING))


def test_a_killed_import_is_cleaned_up_by_the_next_and_a_live_one_is_left_alone(good_hf, tmp_path):  # noqa: F811
    target = tmp_path / "ckpts" / "tiny"
    proc, staging = _start_blocked_import(good_hf, target, tmp_path / "ready")
    try:
        assert staging.parent == target.parent and staging.name.startswith(".tiny.")
        assert (staging / "model.safetensors").is_file() and (staging / STAGING_OWNER).is_file()
        owner = json.loads((staging / STAGING_OWNER).read_text())
        assert (owner["pid"], owner["host"]) == (proc.pid, socket.gethostname())

        # a second import of the same target while the first one runs: it finishes, the live folder stays
        result = runner.invoke(app, ["import-hf", str(good_hf), "--out", str(target)])
        assert result.exit_code == 0, (result.output, result.exception)
        assert "removed" not in result.stderr and "left" not in result.stderr
        assert _staging_folders(target.parent) == [staging.name] and (staging / "model.safetensors").is_file()
        assert ck.load(target).config.n_layer == 2 and not (target / STAGING_OWNER).exists()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL and staging.is_dir()  # the kill left its folder behind

    result = runner.invoke(app, ["import-hf", str(good_hf), "--out", str(target), "--force"])
    assert result.exit_code == 0, (result.output, result.exception)
    lines = [line for line in result.stderr.splitlines() if line.startswith("removed ")]
    assert len(lines) == 1 and str(staging) in lines[0] and f"pid {proc.pid}" in lines[0], result.stderr
    assert "its process is gone" in lines[0]
    assert _staging_folders(target.parent) == [] and sorted(p.name for p in target.parent.iterdir()) == ["tiny"]
    assert ck.load(target).config.n_layer == 2


def _killed_writer(target: Path) -> Path:
    """The staging folder of a process that took one (StagingFolder) and was SIGKILLed: a real dead owner."""
    code = ("import os, signal, sys; from depthtools.fsutil import StagingFolder; "
            "s = StagingFolder(sys.argv[1], '.import.tmp'); print(s.path, flush=True); "
            "os.kill(os.getpid(), signal.SIGKILL)")
    proc = subprocess.run([sys.executable, "-c", code, str(target)], env=_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    folder = Path(proc.stdout.strip())
    assert folder.is_dir() and (folder / STAGING_OWNER).is_file()
    return folder


def test_an_olmo_core_import_writes_through_the_same_staging_and_cleans_up(tmp_path, capsys):
    """olmo_import.write_checkpoint uses the one staging rule: a dead leftover of the target goes, one line."""
    from depthtools.arch import DepthModel
    from depthtools.config import ModelConfig
    from depthtools.interop.olmo_import import write_checkpoint

    target = tmp_path / "olmo"
    dead = _killed_writer(target)
    other = _killed_writer(tmp_path / "olmo2")  # another target's leftover is not this import's business
    capsys.readouterr()
    model = DepthModel(ModelConfig(arch="preln", vocab_size=64, d_model=16, n_layer=1, n_heads=2, max_seq_len=16))
    write_checkpoint(model, target, {"source": {"format": "test"}, "tokenizer": None, "train": None}, None)
    lines = capsys.readouterr().err.splitlines()
    assert not dead.exists() and other.is_dir()
    assert len(lines) == 1 and lines[0].startswith(f"removed {dead}:"), lines
    assert ck.load(target).config.n_layer == 1 and not (target / STAGING_OWNER).exists()
    assert _staging_folders(tmp_path) == [other.name]


def _hand_made(parent: Path, name: str, record: dict | None, age_s: float = 0.0) -> Path:
    folder = parent / name
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"half")
    if record is not None:
        (folder / STAGING_OWNER).write_text(json.dumps(record) + "\n")
        then = time.time() - age_s
        os.utime(folder / STAGING_OWNER, (then, then))
    return folder


@pytest.mark.parametrize("record, age_s, removed, why", [
    ({"pid": 1, "host": "elsewhere.example", "since": 0}, 5.0, False, None),  # another host, heartbeat fresh
    ({"pid": 1, "host": "elsewhere.example", "since": 0}, 500.0, True, "no heartbeat for 500 s"),
    ("live pid here", 5.0, False, None),  # this host, its pid runs (a reused pid?): kept until no heartbeat
    ("live pid here", 500.0, True, "no heartbeat for 500 s"),
    (None, 0.0, False, None),  # no owner record (an earlier depthtools, or one being made): never removed
])
def test_owner_records_decide(tmp_path, record, age_s, removed, why):
    if record == "live pid here":
        record = {"pid": os.getppid(), "host": socket.gethostname(), "since": 0}
    folder = _hand_made(tmp_path, ".t.abc123.import.tmp", record, age_s)
    lines: list[str] = []
    assert remove_dead_staging(tmp_path, ".t.", IMPORT_STAGING, log=lines.append) == ([folder] if removed else [])
    assert folder.exists() is not removed
    assert (len(lines) == 1 and why in lines[0] and str(folder) in lines[0]) if removed else lines == []


def test_an_old_folder_without_owner_is_named_not_removed(tmp_path):
    folder = _hand_made(tmp_path, ".t.old.import.tmp", None)
    then = time.time() - 3600
    os.utime(folder, (then, then))
    lines: list[str] = []
    assert remove_dead_staging(tmp_path, ".t.", IMPORT_STAGING, log=lines.append) == []
    assert folder.is_dir() and len(lines) == 1 and lines[0].startswith(f"left {folder}:")


def test_only_the_targets_own_staging_folders_are_looked_at(tmp_path):
    dead = {"pid": 1, "host": "elsewhere.example", "since": 0}
    mine = _hand_made(tmp_path, ".t.x1.import.tmp", dead, 500.0)
    others = [_hand_made(tmp_path, n, dead, 500.0) for n in (".t2.x1.import.tmp", ".t.x1.tmp", "t.x1.import.tmp")]
    assert remove_dead_staging(tmp_path, ".t.", IMPORT_STAGING, log=lambda line: None) == [mine]
    assert all(p.is_dir() for p in others)


def test_a_staging_folder_swaps_in_without_its_owner_file_and_a_failure_removes_it(tmp_path):
    target = tmp_path / "out"
    with StagingFolder(target, IMPORT_STAGING) as staging:
        (staging / "a.txt").write_text("a")
        assert (staging / STAGING_OWNER).is_file()
    assert sorted(p.name for p in target.iterdir()) == ["a.txt"] and sorted(os.listdir(tmp_path)) == ["out"]
    with pytest.raises(RuntimeError):
        with StagingFolder(target, IMPORT_STAGING) as staging:
            (staging / "b.txt").write_text("b")
            raise RuntimeError("stop")
    assert sorted(p.name for p in target.iterdir()) == ["a.txt"] and sorted(os.listdir(tmp_path)) == ["out"]


def test_a_gguf_imports_scratch_folder_is_owned_too(tmp_path, monkeypatch, capsys):
    """import_gguf converts into a temporary folder (the whole dequantized model): a killed import's is removed by
    the next GGUF import, a live one's (here: another host's, fresh heartbeat) is left."""
    pytest.importorskip("gguf")
    import tempfile

    from test_gguf import build, write_gguf

    from depthtools.interop.gguf_import import import_gguf

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    code = ("import os, signal, sys, tempfile; from pathlib import Path; from depthtools.fsutil import StagingFolder; "
            "s = StagingFolder(Path(sys.argv[1]) / 'depthtools-gguf', '.convert.tmp'); print(s.path, flush=True); "
            "os.kill(os.getpid(), signal.SIGKILL)")
    proc = subprocess.run([sys.executable, "-c", code, str(scratch)], env=_env(), capture_output=True, text=True,
                          timeout=120)
    dead = Path(proc.stdout.strip())
    assert proc.returncode == -signal.SIGKILL and dead.is_dir(), proc.stderr
    live = _hand_made(scratch, ".depthtools-gguf.live.convert.tmp", {"pid": 1, "host": "elsewhere.example", "since": 0})
    model = build("llama")
    write_gguf(model, "llama", tmp_path / "m.gguf")
    capsys.readouterr()
    import_gguf(tmp_path / "m.gguf", out=tmp_path / "ck")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"removed {dead}:"), lines
    assert sorted(os.listdir(scratch)) == [live.name]
    assert ck.load(tmp_path / "ck").config.n_layer == model.config.num_hidden_layers
