"""Data-parallel training under torchrun (DDP and FSDP2 on CPU gloo), resume across world sizes,
the grid launchers (local process pool, submitit as Slurm uses it, Slurm dry run) and `grid status`.

Tolerance for 2 processes vs 1 with the same global batch: DDP averages the two ranks' gradients,
which is the same mean-loss gradient the single process forms from its micro-batches; only the
float32 summation order differs (relative error ~1e-7 per step). AdamW normalises updates, so that
relative error stays of the same order in the weights over these 20 steps (measured: ~6e-7 in the
weights, ~1e-8 in the losses). 1e-4 leaves a wide margin for other BLAS/thread paths yet catches
real bugs: a rank training on the wrong rows or a missing all-reduce changes the loss by >1e-3.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from depthtools.checkpoint import read_metrics, read_tensors
from depthtools.config import ModelConfig, TrainConfig
from depthtools.errors import DepthToolsError
from depthtools.grid import grid_spec, plan_grid, save_grid
from depthtools.train import train_cell
from depthtools.train.batches import TrainBatches
from depthtools.train.distributed import Dist, rows_per_rank
from depthtools.train.launch import SlurmResources, parse_time, submit_cells
from depthtools.train.loop import write_heartbeat
from depthtools.train.state import latest_step
from depthtools.train.sweep import cell_specs, cell_status, run_cell

from tiny_models import TINY_CORPUS

ROOT = Path(__file__).resolve().parents[1]
MODEL = ModelConfig(arch="hc", vocab_size=256, d_model=32, n_layer=2, n_heads=2, max_seq_len=32)
# What `depthtools train` below builds from its flags: 20 steps of 8 rows, 4 micro-batches of 2.
RECIPE = TrainConfig(tokens=20 * 8 * 32, batch_size=8, micro_batch_size=2, seq_len=32, lr=1e-2, threads=1,
                     eval_every=10, checkpoint_every=10, log_every=5)
FINISHED = ["config.json", "eval.json", "metrics.jsonl", "model.safetensors"]
RTOL = 1e-4


@pytest.fixture(scope="module")
def reference(data_dir, tmp_path_factory) -> Path:
    """The one-process run every multi-process run is compared with."""
    out = tmp_path_factory.mktemp("ref") / "hc_L2"
    threads = torch.get_num_threads()
    train_cell(MODEL, RECIPE, data_dir, out)
    torch.set_num_threads(threads)
    return out


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(*args: str, wait: bool = True):
    """2 CPU processes under torchrun (gloo), one thread each; returns the finished process or the Popen."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
               f"--master_port={free_port()}", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if wait:
        return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun and its workers (they run in sessions of their own, so not via a process group)."""
    children = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _parent(p) == proc.pid]
    for pid in [proc.pid, *children]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    for pid in children:  # wait until the workers are gone (they are not our children to reap)
        while Path(f"/proc/{pid}").exists() and "Z" not in _state(pid):
            time.sleep(0.02)


def _parent(proc_dir: Path) -> int | None:
    try:
        return int((proc_dir / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


def run_file(path: Path, out_dir: Path, data_dir: Path, recipe: TrainConfig) -> Path:
    path.write_text(json.dumps({"model": MODEL.to_dict(), "train": recipe.to_dict(), "data_dir": str(data_dir),
                                "out_dir": str(out_dir)}))
    return path


def close(a: float, b: float) -> bool:
    return abs(a - b) <= RTOL * abs(b)


def max_weight_diff(a: Path, b: Path) -> float:
    x, y = read_tensors(a / "model.safetensors"), read_tensors(b / "model.safetensors")
    assert x.keys() == y.keys()
    return max(float((x[k] - y[k]).abs().max()) for k in x)


# -- data split and validation (no processes) ---------------------------------------------------
def test_ranks_split_the_global_batch_whatever_the_world_size(data_dir):
    tokens = __import__("numpy").fromfile(data_dir / "train.bin", dtype="uint16")
    one = TrainBatches(tokens, 8, 16, seed=3, device=torch.device("cpu"))
    for world in (2, 4):
        shards = [TrainBatches(tokens, 8, 16, 3, torch.device("cpu"), rank=r, world_size=world) for r in range(world)]
        for step in (0, 7):
            assert torch.equal(torch.cat([s.batch(step)[0] for s in shards]), one.batch(step)[0])


def test_parallel_option_and_batch_split_are_validated():
    with pytest.raises(DepthToolsError, match="unknown parallel 'zero'; valid: ddp, fsdp"):
        TrainConfig(parallel="zero")
    assert TrainConfig(parallel="fsdp").parallel == "fsdp"
    with pytest.raises(DepthToolsError, match="divisible by the world size 3"):
        rows_per_rank(8, None, Dist(world_size=3))
    with pytest.raises(DepthToolsError, match="micro_batch_size dividing 4"):
        rows_per_rank(8, 3, Dist(world_size=2))
    assert rows_per_rank(8, 2, Dist(world_size=2)) == (4, 2) and rows_per_rank(8, None, Dist()) == (8, 8)
    assert parse_time("90") == 90 and parse_time("2:00:00") == 120 and parse_time("1-00:30:00") == 1470
    with pytest.raises(DepthToolsError, match="cannot read time"):
        parse_time("two hours")


# -- torchrun ------------------------------------------------------------------------------------
def test_two_process_ddp_via_cli_matches_one_process(data_dir, reference, tmp_path):
    out = tmp_path / "hc_L2"
    result = torchrun("-m", "cli", "train", "--arch", "hc", "--layers", "2", "--d-model", "32", "--n-heads", "2",
                      "--data", str(data_dir), "--tokens", str(RECIPE.tokens), "--batch-size", "8",
                      "--micro-batch-size", "2", "--seq-len", "32", "--lr", "1e-2", "--threads", "1",
                      "--eval-every", "10", "--checkpoint-every", "10", "--log-every", "5", "--out", str(out), "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count('"resumed_from"') == 1  # only rank 0 prints
    summary = json.loads(result.stdout[result.stdout.index("{"):])
    assert sorted(p.name for p in out.iterdir()) == FINISHED  # no train_state, heartbeat or per-rank files
    ours, theirs = read_metrics(out), read_metrics(reference)
    assert [r["step"] for r in ours] == [r["step"] for r in theirs] == [1, 5, 10, 15, 20]  # lines not doubled
    assert json.loads((out / "config.json").read_text())["train_resolved"]["world_size"] == 2
    for mine, single in zip(ours, theirs):
        assert close(mine["train_loss"], single["train_loss"]) and close(mine["grad_norm"], single["grad_norm"])
    assert ours[0]["depth_grad_norm"] == pytest.approx(theirs[0]["depth_grad_norm"], rel=RTOL)  # probe scaled per rank
    assert close(summary["val_loss"], json.loads((reference / "eval.json").read_text())["val_loss"])
    assert max_weight_diff(out, reference) < RTOL


def test_fsdp2_matches_one_process_and_saves_full_state(data_dir, reference, tmp_path):
    out = tmp_path / "hc_L2"
    recipe = RECIPE.replace(parallel="fsdp", keep_train_state=True)
    result = torchrun("-m", "depthtools.train", str(run_file(tmp_path / "run.json", out, data_dir, recipe)))
    assert result.returncode == 0, result.stderr[-3000:]
    assert max_weight_diff(out, reference) < RTOL
    assert latest_step(out / "train_state") == 10  # gathered to full tensors by rank 0
    for name in ("eval.json", "model.safetensors", "config.json"):  # pretend it stopped after step 10
        (out / name).unlink()
    resumed = train_cell(MODEL, recipe, data_dir, out)  # one process reads the FSDP-written state
    assert resumed["resumed_from"] == 10 and max_weight_diff(out, reference) < RTOL


def test_killed_ddp_run_resumes_on_two_or_one_processes(data_dir, tmp_path):
    recipe = RECIPE.replace(tokens=60 * 8 * 32, eval_every=0, checkpoint_every=5, log_every=5, eval_tokens=512)
    killed = tmp_path / "killed"
    spec = run_file(tmp_path / "run.json", killed, data_dir, recipe)
    proc = torchrun("-m", "depthtools.train", str(spec), wait=False)
    try:
        deadline = time.monotonic() + 120
        while latest_step(killed / "train_state") is None and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, f"run ended before it could be killed: {proc.stderr.read().decode()[-2000:]}"
    finally:
        kill_tree(proc)
    assert not (killed / "eval.json").exists()
    assert cell_status(killed)["state"] == "failed"  # heartbeat of a process that is gone
    one = tmp_path / "one"
    shutil.copytree(killed, one)
    again = torchrun("-m", "depthtools.train", str(spec))  # same command, 2 processes: resumes
    assert again.returncode == 0, again.stderr[-3000:]
    # `python -m depthtools.train` prints its summary on every rank: read the first one.
    two_summary = json.JSONDecoder().raw_decode(again.stdout[again.stdout.index("{"):])[0]
    assert 0 < two_summary["resumed_from"] < 60
    steps = [r["step"] for r in read_metrics(killed)]
    assert steps == sorted(set(steps)) and steps[-1] == 60 and sorted(p.name for p in killed.iterdir()) == FINISHED
    one_summary = train_cell(MODEL, recipe, data_dir, one)  # world size 1 resumes the same train_state
    start = one_summary["resumed_from"]
    assert start == two_summary["resumed_from"]
    # The first record after the resume agrees to float noise. Over the remaining steps at lr 1e-2 that
    # noise can grow chaotically (uninterrupted 1- and 2-process runs drift apart from ~1e-7 at step 20
    # to ~1e-4 at step 30 and ~1% by step 150), so the end is only checked for sanity.
    first_one, first_two = (next(r for r in read_metrics(d) if r["step"] > start) for d in (one, killed))
    assert first_one["step"] == first_two["step"] and close(first_one["train_loss"], first_two["train_loss"])
    assert abs(one_summary["val_loss"] - two_summary["val_loss"]) < 0.05 * two_summary["val_loss"]


# -- grid launchers and status -------------------------------------------------------------------
def mini_grid(tmp_path: Path, steps: int = 6, checkpoint_every: int = 0) -> Path:
    cells = plan_grid(["preln", "hc"], budget=30_000, layers=[1, 2], n_heads=2, ffn_multiple=8, tolerance=0.15,
                      max_seq_len=32)
    train = dict(tokens=steps * 8 * 32, batch_size=8, seq_len=32, lr=1e-2, eval_tokens=512, log_every=10,
                 eval_every=0, depth_stats_every=0, checkpoint_every=checkpoint_every, threads=1)
    data = {"corpus": "text-dir", "text_dir": str(TINY_CORPUS), "val_fraction": 0.3}
    return save_grid(grid_spec(cells, name="mini", train=train, data=data), tmp_path / "mini.json")


def test_local_launcher_trains_a_grid_with_two_one_thread_workers(tmp_path):
    from cli.main import app

    spec, root = mini_grid(tmp_path), tmp_path / "ck"
    args = ["grid", "train", str(spec), "--root", str(root), "--data-root", str(tmp_path / "data"),
            "--workers", "2", "--threads", "1", "--cells", "preln_L1,hc_L2", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output + repr(result.exception)
    summaries = json.loads(result.output)
    assert [s["name"] for s in summaries] == ["preln_L1", "hc_L2"] and not any(s.get("error") for s in summaries)
    assert all(sorted(p.name for p in (root / "mini" / c).iterdir()) == FINISHED for c in ("preln_L1", "hc_L2"))
    assert not (root / "mini" / "preln_L2").exists()


def test_submitit_local_executor_runs_a_cell_through_the_slurm_path(tmp_path):
    spec, root = mini_grid(tmp_path), tmp_path / "ck"
    one_cell = {**json.loads(spec.read_text()), "cells": [json.loads(spec.read_text())["cells"][0]]}
    jobs = submit_cells(one_cell, root, tmp_path / "data", SlurmResources(gpus_per_cell=0, cpus_per_cell=1, time="5"),
                        cluster="local")
    [(name, job)] = jobs
    summary = job.result()
    assert name == "preln_L1" and summary["name"] == "preln_L1" and summary["steps"] == 6
    assert cell_status(root / "mini" / "preln_L1")["state"] == "done"
    assert submit_cells(one_cell, root, tmp_path / "data", cluster="local") == []  # finished: nothing to submit


def test_grid_status_and_slurm_dry_run_after_a_kill(tmp_path):
    from cli.main import app

    spec_path, root, data_root = mini_grid(tmp_path, steps=300, checkpoint_every=5), tmp_path / "ck", tmp_path / "data"
    specs = {c["cell"]["name"]: c for c in cell_specs(json.loads(spec_path.read_text()))}
    run_cell({**specs["preln_L1"], "train": {**specs["preln_L1"]["train"], "tokens": 4 * 8 * 32}}, root, data_root)
    killed = root / "mini" / "hc_L2"
    cell = specs["hc_L2"]
    data_dir = next(p for p in data_root.iterdir() if (p / "meta.json").is_file())
    run = tmp_path / "hc.json"
    run.write_text(json.dumps({"model": cell["cell"]["model"], "train": cell["train"], "data_dir": str(data_dir),
                               "out_dir": str(killed)}))
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "depthtools.train", str(run)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while latest_step(killed / "train_state") is None and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert cell_status(killed)["state"] == "running"  # live pid on this host
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    (root / "mini" / "preln_L2").mkdir()
    write_heartbeat(root / "mini" / "preln_L2", step=3, total_steps=300)  # this test process: alive
    result = CliRunner().invoke(app, ["grid", "status", str(spec_path), "--root", str(root), "--json"])
    assert result.exit_code == 0, result.output
    states = {r["cell"]: (r["state"], r["detail"]) for r in json.loads(result.output)}
    assert {k: v[0] for k, v in states.items()} == {"preln_L1": "done", "preln_L2": "running", "hc_L1": "pending",
                                                     "hc_L2": "failed"}
    assert "stale heartbeat" in states["hc_L2"][1]
    table = CliRunner().invoke(app, ["grid", "status", str(spec_path), "--root", str(root)])
    assert "done 1, running 1, failed 1, pending 1" in table.output
    assert "[dim]" not in table.output and "[/]" not in table.output  # states styled, not shown as markup
    assert all(state in table.output for state in ("done", "running", "failed", "pending"))
    dry = CliRunner().invoke(app, ["grid", "train", str(spec_path), "--root", str(root), "--data-root", str(data_root),
                                   "--launcher", "slurm", "--dry-run", "--partition", "gpu", "--gpus-per-cell", "2",
                                   "--time", "2:00:00"])
    assert dry.exit_code == 0, dry.output + repr(dry.exception)
    lines = [line for line in dry.output.splitlines() if not line.startswith("#")]
    assert [line.split("\t")[0] for line in lines] == ["preln_L2", "hc_L1", "hc_L2"]  # the finished cell is not resubmitted
    assert "torchrun --nproc_per_node=2 -m cli grid train" in lines[0] and "--cells preln_L2" in lines[0]
    assert "partition=gpu gpus=2" in lines[0] and "time=2:00:00" in lines[0]
    as_json = CliRunner().invoke(app, ["grid", "train", str(spec_path), "--root", str(root), "--launcher", "slurm",
                                       "--dry-run", "--json"])
    assert [job["cell"] for job in json.loads(as_json.output)] == ["preln_L2", "hc_L1", "hc_L2"]


def test_other_host_heartbeat_goes_stale_and_failures_are_recorded(tmp_path):
    cell = tmp_path / "cell"
    cell.mkdir()
    (cell / "heartbeat.json").write_text(json.dumps({"state": "running", "host": "elsewhere", "pid": 1, "step": 7}))
    assert cell_status(cell)["state"] == "running"  # fresh, on a host we cannot check
    old = time.time() - 3600
    os.utime(cell / "heartbeat.json", (old, old))
    assert cell_status(cell, stale_after=900)["state"] == "failed"
    write_heartbeat(cell, state="failed", error="TrainingDivergedError: non-finite loss")
    assert cell_status(cell) == {"state": "failed", "step": None, "total_steps": None,
                                 "detail": "TrainingDivergedError: non-finite loss"}


def test_ray_launcher_says_how_to_install_ray(tmp_path, monkeypatch):
    from depthtools.train.launch import launch_ray

    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed
    with pytest.raises(DepthToolsError, match="pip install ray"):
        launch_ray(mini_grid(tmp_path), tmp_path / "ck", tmp_path / "data")
