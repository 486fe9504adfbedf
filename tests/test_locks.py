"""One trainer per cell, one preparation per dataset, and no orphaned grid workers (issue 22).

Real processes throughout: a second `depthtools train` on a cell another process is training must
refuse (exit 2, one line naming the holder) and write nothing into it; a lock left by a killed process
is taken over; a `grid train` parent stopped with SIGTERM takes its worker processes with it.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.main import app
from depthtools import checkpoint as ck
from depthtools.config import ModelConfig, TrainConfig
from depthtools.fsutil import LockHeldError, acquire_lock

from tiny_models import SMALL, TINY_CORPUS

ROOT = Path(__file__).resolve().parents[1]
FAST = dict(batch_size=8, seq_len=32, lr=1e-2, eval_tokens=512, log_every=1, eval_every=0,
            depth_stats_every=0, checkpoint_every=0, threads=1)
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _train_args(data_dir: Path, out: Path, steps: int) -> list[str]:
    return [sys.executable, "-m", "cli", "train", "--arch", "preln", "--layers", "2", "--d-model", "32", "--n-heads",
            "2", "--data", str(data_dir), "--out", str(out), "--tokens", str(steps * 8 * 32), "--batch-size", "8",
            "--seq-len", "32", "--log-every", "1", "--eval-every", "0", "--checkpoint-every", "20", "--threads", "1"]


def _wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: the process ended first ({proc.returncode}): {proc.stderr.read()}")
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _steps(out: Path) -> list[int]:
    return [r["step"] for r in ck.read_metrics(out)]


def test_a_second_trainer_on_the_same_cell_is_refused_and_a_dead_holder_is_taken_over(data_dir, tmp_path, caplog):
    from depthtools.train import train_cell

    out = tmp_path / "cell"
    first = subprocess.Popen(_train_args(data_dir, out, 100_000), env=ENV, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: len(_steps(out)) >= 3, 120, "the first trainer's first steps", first)
        holder = json.loads((out / "train.lock").read_text())
        assert holder["pid"] == first.pid and holder["host"] == socket.gethostname()
        second = CliRunner().invoke(app, _train_args(data_dir, out, 100_000)[3:])  # this (pytest) process
        assert second.exit_code == 2, (second.exit_code, second.output, second.exception)
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1, second.stderr
        for word in (f"cell {out}", "is locked by", f"pid {first.pid}", f"host {socket.gethostname()}", "since"):
            assert word in lines[0], (word, lines[0])
        assert first.poll() is None  # still training, undisturbed
        beat = json.loads((out / "heartbeat.json").read_text())
        assert beat["state"] == "running" and beat["pid"] == first.pid  # the refused run wrote no "failed"
    finally:
        first.kill()  # SIGKILL: the kernel drops its flock; train.lock stays behind, naming a dead pid
        first.wait()
    steps = _steps(out)
    assert steps == list(range(1, len(steps) + 1)), steps[:20]  # one writer: no duplicated, out-of-order steps
    assert json.loads((out / "train.lock").read_text())["pid"] == first.pid
    recipe = TrainConfig(tokens=6 * 8 * 32, **FAST)
    with caplog.at_level(logging.WARNING, logger="depthtools.train.loop"):
        summary = train_cell(ModelConfig(arch="preln", **SMALL), recipe, data_dir, out, force=True)
    assert summary["steps"] == 6 and _steps(out) == [1, 2, 3, 4, 5, 6]
    assert f"taking over the stale lock of pid {first.pid}" in caplog.text and "its process is gone" in caplog.text
    assert not (out / "train.lock").exists()  # released (and removed) at the end


def test_the_cell_lock_is_released_when_training_fails(data_dir, tmp_path, monkeypatch):
    from depthtools.train import loop, train_cell

    out = tmp_path / "cell"

    def fail_inside_the_lock(*args, **kwargs):
        assert (out / "train.lock").exists()
        raise RuntimeError("simulated failure while training")

    monkeypatch.setattr(loop, "prepare_run", fail_inside_the_lock)
    with pytest.raises(RuntimeError, match="simulated failure"):
        train_cell(ModelConfig(arch="preln", **SMALL), TrainConfig(tokens=6 * 8 * 32, **FAST), data_dir, out)
    monkeypatch.undo()
    assert not (out / "train.lock").exists()
    train_cell(ModelConfig(arch="preln", **SMALL), TrainConfig(tokens=2 * 8 * 32, **FAST), data_dir, out)  # not locked


def _hold_lock(path: Path) -> subprocess.Popen:
    """Another process holding the lock at `path` (the lock a real preparation would hold) until killed."""
    code = ("import sys, time; from pathlib import Path; from depthtools.fsutil import acquire_lock; "
            "acquire_lock(Path(sys.argv[1]), 'test'); print('held', flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True, env=ENV)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_preparation_of_a_dataset_is_refused(tmp_path):
    target = tmp_path / "data" / "mine"
    holder = _hold_lock(tmp_path / "data" / ".mine.lock")
    try:
        args = ["data", "prepare", "--corpus", "text-dir", "--text-dir", str(TINY_CORPUS), "--out", str(tmp_path / "data"),
                "--name", "mine", "--val-fraction", "0.3"]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2, (result.output, result.exception)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and f"dataset {target} is locked by pid {holder.pid}" in lines[0], result.stderr
        assert not target.exists()
        inputs = ["data", "prepare", "--input", str(TINY_CORPUS), "--out", str(tmp_path / "data"), "--name", "mine"]
        result = CliRunner().invoke(app, inputs)  # the --input (sharded) path takes the same lock
        assert result.exit_code == 2 and f"pid {holder.pid}" in result.stderr, (result.output, result.exception)
        assert not target.exists()
    finally:
        holder.kill()
        holder.wait()
    result = CliRunner().invoke(app, args)  # its holder is gone: prepared, and the lock file removed
    assert result.exit_code == 0, (result.output, result.exception)
    assert (target / "meta.json").is_file() and not (tmp_path / "data" / ".mine.lock").exists()


def test_a_lock_from_another_host_is_honoured_until_its_heartbeat_is_stale(tmp_path):
    """A shared filesystem whose flock does not reach other hosts: the lock file's heartbeat decides."""
    path = tmp_path / "train.lock"
    path.write_text(json.dumps({"pid": 4242, "host": "node-7", "since": time.time() - 60}))
    with pytest.raises(LockHeldError, match=r"cell x is locked by pid 4242 on host node-7 since .*taken over after"):
        acquire_lock(path, "cell x")
    old = time.time() - 2000
    os.utime(path, (old, old))
    said = []
    lock = acquire_lock(path, "cell x", log=said.append)
    assert said and "taking over the stale lock of pid 4242 on host node-7" in said[0] and "no heartbeat" in said[0]
    assert json.loads(path.read_text())["pid"] == os.getpid()
    with pytest.raises(LockHeldError, match=f"pid {os.getpid()}"):  # held: another open of it is refused
        acquire_lock(path, "cell x")
    lock.release()
    assert not path.exists()
    # this host, a live pid, a fresh heartbeat, yet no flock (a filesystem without flock): still refused
    path.write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname(), "since": time.time()}))
    with pytest.raises(LockHeldError, match=f"pid {os.getppid()} on host"):
        acquire_lock(path, "cell x")
    os.utime(path, (old, old))  # ... until its heartbeat is stale
    acquire_lock(path, "cell x").release()


def _descendants(pid: int) -> set[int]:
    """Live processes below `pid` (via /proc/<pid>/task/*/children)."""
    found, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            for child in children:
                if child not in found:
                    found.add(child)
                    todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_grid_train_workers_die_with_a_terminated_parent(data_dir, tmp_path):
    from depthtools.grid import grid_spec, plan_grid, save_grid

    cells = plan_grid(["preln"], budget=30_000, layers=[1, 2], n_heads=2, ffn_multiple=8, tolerance=0.15, max_seq_len=32)
    spec = save_grid(grid_spec(cells, name="orphans", train={**FAST, "tokens": 100_000 * 8 * 32},
                               data={"dir": str(data_dir)}), tmp_path / "orphans.json")
    root = tmp_path / "ck"
    parent = subprocess.Popen([sys.executable, "-m", "cli", "grid", "train", str(spec), "--root", str(root),
                               "--data-root", str(tmp_path), "--workers", "2", "--threads", "1"],
                              env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    workers: set[int] = set()
    try:
        cell_dirs = [root / "orphans" / c.name for c in cells]
        _wait_for(lambda: all(len(_steps(d)) >= 2 for d in cell_dirs), 180, "both cells training", parent)
        workers = {json.loads((d / "train.lock").read_text())["pid"] for d in cell_dirs}
        assert len(workers) == 2 and workers <= _descendants(parent.pid)
        parent.send_signal(signal.SIGTERM)
        parent.wait(timeout=60)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(_alive(p) for p in workers):
            time.sleep(0.2)
        assert not [p for p in workers if _alive(p)], "grid workers outlived their parent"
    finally:
        for pid in workers:  # only the processes this test started
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if parent.poll() is None:
            parent.kill()
            parent.wait()
