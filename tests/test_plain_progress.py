"""Long commands print plain progress lines when their output is not a terminal (issue 35, item 10).

rich's live bars draw nothing into a pipe or a file, so `depthtools demo > log` (nohup, Slurm) used to
print nothing for ten minutes. Each test runs the command as a subprocess whose stdout and stderr are
pipes and reads what arrives: a line per stage and per cell, stamped with the elapsed time, and (the
demo test) arriving while the command is still running, not at its end.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from depthtools.grid import grid_spec, plan_grid, save_grid

ROOT = Path(__file__).resolve().parents[1]
STAMP = r"^\[\d+:\d\d\] "  # [m:ss] at the start of every plain line
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", *args], cwd=cwd, env=ENV, capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data_dir) -> tuple[Path, subprocess.CompletedProcess]:
    """`grid train` of a two-cell grid, run with its output on pipes."""
    tmp = tmp_path_factory.mktemp("plain")
    cells = plan_grid(["preln"], budget=30_000, layers=[1, 2], n_heads=2, ffn_multiple=8, tolerance=0.15,
                      max_seq_len=32)
    train = {"tokens": 512, "batch_size": 8, "seq_len": 32, "eval_every": 0, "eval_tokens": 512, "threads": 1}
    spec = save_grid(grid_spec(cells, name="g", train=train, data={"dir": str(data_dir)}), tmp / "g.json")
    result = _run(["grid", "train", str(spec), "--root", str(tmp / "ck")], tmp)
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp / "ck" / "g", result


def test_grid_train_prints_a_stamped_line_per_cell(trained):
    _grid, result = trained
    lines = result.stdout.splitlines()
    for cell in ("preln_L1", "preln_L2"):
        started = [l for l in lines if re.match(STAMP, l) and f" {cell}: started" in l]
        done = [l for l in lines if re.match(STAMP, l) and f" {cell}: done in " in l and "val loss" in l]
        assert len(started) == 1 and len(done) == 1, result.stdout[-3000:]
    assert "\x1b[" not in result.stdout  # no terminal control sequences in a log


def test_analyze_prints_a_stamped_line_per_checkpoint(trained, tmp_path):
    grid, _ = trained
    result = _run(["analyze", "--grid", str(grid), "--n-tokens", "64", "--seq-len", "16", "--only",
                   "lens_logit,ablate_skip"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [l for l in result.stdout.splitlines() if re.match(STAMP, l)]
    assert any("analyze: preln_L1 done" in l for l in lines), result.stdout
    assert any("analyze: preln_L2 done" in l for l in lines), result.stdout


DRIVER = r'''
import sys, time
from pathlib import Path
import depthtools.demo as demo

marker, out = Path(sys.argv[1]), Path(sys.argv[2])

def fake_run_demo(preset, log=None, on_progress=None, **kwargs):
    """The real stage bookkeeping (demo._Stages, demo._train_progress) around a pause the test ends."""
    stages = demo._Stages(on_progress, ["data", "train", "report"], log)
    stages.update("data", 0.0, "preparing corpus default")
    stages.done("data")
    deadline = time.time() + 30
    while not marker.exists():  # the test creates it once it has READ the data line from the pipe
        if time.time() > deadline:
            sys.exit(3)
        time.sleep(0.05)
    relay = demo._train_progress(stages, {"cells": [{}, {}]})
    relay({"event": "skip", "cell": "preln_L2", "cell_index": 0})
    relay({"event": "start", "cell": "preln_L4", "cell_index": 1, "step": 0, "total_steps": 10})
    relay({"event": "done", "cell": "preln_L4", "cell_index": 1, "step": 10, "total_steps": 10, "val_loss": 4.5})
    stages.done("train")
    stages.update("report", 0.0, "writing the grid report")
    stages.done("report", str(out))
    return demo.DemoResult(grid_dir=out.parent, report=out, seconds=stages.seconds)

demo.run_demo = fake_run_demo
from cli.main import app
app(["demo", "--preset", "tiny", "--workers", "1"], prog_name="depthtools")
'''


def test_demo_lines_arrive_while_it_runs(tmp_path):
    """The data line must reach the pipe before the demo goes on (the driver waits for the test to read it)."""
    marker = tmp_path / "go"
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(marker), str(tmp_path / "index.html")], cwd=tmp_path,
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        seen = []
        while True:
            line = proc.stdout.readline()
            assert line, ("the demo ended before printing its data stage", proc.wait(), proc.stderr.read())
            seen.append(line.rstrip("\n"))
            if "data: done in" in line:
                break
        assert proc.poll() is None  # still running: the line was not held back until the end
        marker.touch()
        rest, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    lines = seen + rest.splitlines()
    stamped = [l for l in lines if re.match(STAMP, l)]
    for expected in ("data: preparing corpus default", "data: done in", "train: preln_L2 already trained (1/2)",
                     "train: preln_L4 trained (2/2, val loss 4.5000)", "train: done in", "report: done in"):
        assert any(expected in l for l in stamped), (expected, lines)
    assert any("report:" in l and "index.html" in l for l in lines)


def test_probe_commands_print_stamped_lines_on_stderr(trained, tmp_path):
    """Issue 47: a probe command whose stderr is not a terminal says when each probe starts and ends
    (stdout stays the result); `causal`, which used to be silent for its whole run, counts its blocks."""
    grid, _ = trained
    for command in (["ablate", "--mode", "skip"], ["causal"]):
        result = _run([*command, "--ckpt", str(grid / "preln_L2"), "--n-tokens", "64", "--seq-len", "16"], tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
        name = "ablate_skip" if command[0] == "ablate" else "causal"
        lines = [l for l in result.stderr.splitlines() if re.match(STAMP, l)]
        assert any(f"{name} preln_L2: started" in l for l in lines), result.stderr
        assert any(f"{name} preln_L2: done in" in l for l in lines), result.stderr
        assert not any(re.match(STAMP, l) for l in result.stdout.splitlines())
        assert "\x1b[" not in result.stderr


def test_plain_progress_prints_at_least_every_interval_without_steps():
    """The watch thread prints a status line when a probe reports nothing for `every_s` seconds."""
    import io

    from rich.console import Console

    from cli.plain import PlainLog, PlainProgress

    out = io.StringIO()
    log = PlainLog(out=Console(file=out, width=200))
    with PlainProgress("similarity m", 10, log, every_s=0.2) as bar:
        bar.advance(3)
        time.sleep(0.9)
    lines = out.getvalue().splitlines()
    assert lines[0].endswith("similarity m: started, 10 steps") and "similarity m: done in" in lines[-1]
    status = [l for l in lines if "3/10 (30%)" in l]
    assert len(status) >= 2 and all(re.match(STAMP, l) for l in lines), lines
