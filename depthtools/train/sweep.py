"""Train every cell of a grid spec: `train_grid("grid.json")` (or a spec dict from `grid_spec`).

Cells land in `<root>/<grid name>/<cell name>/`. Finished cells are skipped, interrupted ones
resume from their train_state, and the grid's corpus is prepared on first use. A grid never mixes
tokenizers: if finished cells recorded another tokenizer than the data now gives, it refuses.

Every cell is a pure function of its `cell_specs` entry and the cell folder: `run_cell` (top level,
picklable) is what every launcher (process pool, Slurm via submitit, Ray; `depthtools.train.launch`)
runs, so a cell that died is simply resumed by running it again. `grid_status` tells done / running /
failed / pending cells from their folders alone.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import torch

from depthtools.checkpoint import CONFIG, atomic_write_json, read_json
from depthtools.config import TrainConfig
from depthtools.data import prepare, prepare_inputs, read_meta
from depthtools.data.budget import check_grid
from depthtools.errors import DepthToolsError
from depthtools.fsutil import check_dir_target, check_name
from depthtools.grid import DATA_NOTES, Cell, check_cell, check_data_section, check_spec, load_grid
from depthtools.profiles import apply_to_spec
from depthtools.train.loop import EVAL, HEARTBEAT, METRICS, Progress, held_checkpoint, tidy_finished, train_cell
from depthtools.train.state import STATE_DIR, latest_step

DEFAULT_DATA = {"corpus": "default", "tokenizer": "byte"}


def load_spec(grid: str | Path | dict[str, Any]) -> dict[str, Any]:
    """A checked grid spec with `Cell` objects (`depthtools.grid.check_spec`), from a path or an in-memory
    spec (cells as dicts or Cells), under the recipe profile its train section names ("profile":
    depthtools.profiles.apply_to_spec): nothing is created for a spec that is refused."""
    if isinstance(grid, (str, Path)):
        return apply_to_spec(load_grid(grid))
    return apply_to_spec(check_spec(grid))


def select_cells(spec: dict[str, Any], names: list[str] | None) -> dict[str, Any]:
    """The spec restricted to the named cells (all when names is None); unknown names are an error."""
    if not names:
        return spec
    known = [c.name for c in spec["cells"]]
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise DepthToolsError(f"unknown cell(s) {unknown} in grid {spec.get('name')}; valid: {', '.join(known)}")
    return {**spec, "cells": [c for c in spec["cells"] if c.name in set(names)]}




def grid_data_dir(spec: dict[str, Any], data_root: str | Path = "data") -> Path:
    """The grid's prepared data folder.

    The spec's "data" names a package corpus (`corpus`, `tokenizer`, ...: prepared here on first
    use with `depthtools.data.prepare`), the user's files (`input`, ...: `prepare_inputs`), or a
    folder prepared beforehand (`dir`, relative to data_root), which must exist: if it does not, the
    error says what data the grid needs and the command that prepares it ("needs", "prepare").
    """
    check_data_section(spec.get("data"))
    data = dict(spec.get("data") or {})
    notes = {k: data.pop(k) for k in DATA_NOTES if k in data}
    if "dir" in data:
        folder = Path(data.pop("dir")).expanduser()
        folder = folder if folder.is_absolute() else Path(data_root) / folder
        if data:
            raise DepthToolsError(f"grid spec 'data' with 'dir' takes no other settings, got {sorted(data)}")
        if not (folder / "meta.json").is_file():
            needs = f"; it needs {notes['needs']}" if notes.get("needs") else ""
            how = f"; prepare it with: {notes['prepare'].replace('DATA_ROOT', str(data_root))}" if notes.get("prepare") else ""
            raise DepthToolsError(f"grid {spec.get('name', 'grid')}: no prepared data in {folder}{needs}{how} "
                                  "(or pass --data-root to where it is)")
        return folder
    if "input" in data:
        inputs = data.pop("input")
        return prepare_inputs([inputs] if isinstance(inputs, str) else list(inputs), out_dir=data_root, **data)
    return prepare(**{**DEFAULT_DATA, **data}, out_dir=data_root)


def check_grid_data(spec: dict[str, Any], data_dir: Path) -> list[str]:
    """Every cell's vocabulary and token budget against the grid's data (depthtools.data.budget),
    before any cell trains: raises for a refused cell, returns the epoch warnings."""
    prepare_hint = (spec.get("data") or {}).get("prepare")
    how = f"prepare it with: {prepare_hint}" if prepare_hint else None
    return check_grid(spec["cells"], lambda cell: cell_recipe(spec.get("train"), cell), read_meta(data_dir),
                      str(data_dir), how)


def check_tokenizer(grid_dir: Path, meta: dict[str, Any]) -> None:
    """Refuse to add cells trained on another tokenizer than the grid's finished cells used."""
    wanted = meta["tokenizer"]["fingerprint"]
    for config_path in sorted(Path(grid_dir).glob(f"*/{CONFIG}")):
        recorded = (read_json(config_path).get("tokenizer") or {})
        if recorded.get("fingerprint") not in (None, wanted):
            raise DepthToolsError(
                f"grid {grid_dir} mixes tokenizers: {config_path.parent.name} was trained with "
                f"{recorded.get('name')} ({recorded['fingerprint'][:12]}), the data now gives "
                f"{meta['tokenizer']['name']} ({wanted[:12]}); use another grid name or --force to retrain every cell"
            )


GRID_SPEC_FILE = "grid.json"


def record_spec(spec: dict[str, Any], grid_dir: Path) -> Path:
    """Keep the grid's spec in its folder (`grid.json`), so a report can name the cells that were
    planned but never trained. Cells already recorded stay (training a subset with --cells does not
    forget the rest); the file is rewritten only when it changes (a re-run touches nothing)."""
    path = grid_dir / GRID_SPEC_FILE
    cells = [dataclasses.asdict(c) if isinstance(c, Cell) else dict(c) for c in spec["cells"]]
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
        names = {c["name"] for c in cells}
        kept = [c for c in old["cells"] if c["name"] not in names]
    except (OSError, ValueError, KeyError, TypeError):
        old, kept = None, []
    record = json.loads(json.dumps({**spec, "cells": kept + cells}))  # as it reads back (tuples -> lists)
    if record != old:
        atomic_write_json(path, record)
    return path


def prepare_grid_data(spec: dict[str, Any], root: str | Path, data_root: str | Path, force: bool) -> Path:
    """Prepare (or find) the grid's corpus once, before any cell trains, check the grid's tokenizer
    and record the spec in the grid folder; every launcher and `train_grid` start here."""
    check_dir_target(root, "checkpoint root (--root)")
    data_dir = grid_data_dir(spec, data_root)
    grid_dir = Path(root) / spec.get("name", "grid")
    check_grid_data(spec, data_dir)
    if not force:
        check_tokenizer(grid_dir, read_meta(data_dir))
    record_spec(spec, grid_dir)
    return data_dir


def cell_recipe(train: dict[str, Any] | None, cell: Cell, threads: int | None = None) -> TrainConfig:
    """The TrainConfig of one grid cell: the grid's shared recipe with the cell's training seed.

    Seeds are a grid axis (`plan_grid(seeds=...)`), so a recipe that names another seed than its
    cell is a contradiction and is refused rather than silently overridden.
    """
    if train is not None and not isinstance(train, dict):
        raise DepthToolsError(f"the grid recipe ('train') must be a JSON object, not {type(train).__name__} {train!r}"[:200])
    recipe = dict(train or {})
    if "seed" in recipe and recipe["seed"] != cell.seed:
        raise DepthToolsError(
            f"the grid recipe sets seed={recipe['seed']!r} but cell {cell.name} has seed {cell.seed}; "
            "plan seeds as a grid axis (`depthtools grid plan --seeds 0,1,2`) and drop 'seed' from the recipe")
    if threads:
        recipe["threads"] = threads
    return TrainConfig.from_dict({**recipe, "seed": cell.seed})


def train_grid(grid: str | Path | dict[str, Any], root: str | Path = "checkpoints", force: bool = False,
               progress: Progress | None = None, data_root: str | Path = "data") -> list[dict[str, Any]]:
    """Train all cells of a grid; returns one summary per cell (skipped ones have skipped=True)."""
    spec = load_spec(grid)
    train_cfgs = [cell_recipe(spec.get("train"), cell) for cell in spec["cells"]]
    model_cfgs = [cell.model_config() for cell in spec["cells"]]  # validate every cell before training any
    grid_dir = Path(root) / spec.get("name", "grid")
    data_dir = prepare_grid_data(spec, root, data_root, force)
    summaries = []
    for index, (cell, model_cfg, train_cfg) in enumerate(zip(spec["cells"], model_cfgs, train_cfgs)):
        out_dir = grid_dir / cell.name
        tag = {"cell_index": index, "n_cells": len(spec["cells"])}
        held = None if force else held_checkpoint(out_dir)
        if held is not None:
            tidy_finished(out_dir)
            summaries.append(skipped_summary(cell.name, out_dir, held))
            if progress is not None:
                progress({"event": "skip", "cell": cell.name, "why": skip_reason(held), **tag})
            continue
        relay = None if progress is None else (lambda event, tag=tag: progress({**event, **tag}))
        summaries.append(train_cell(model_cfg, train_cfg, data_dir, out_dir, force=force, progress=relay))
    return summaries


def skip_reason(held: dict[str, str]) -> str:
    """Why a launcher leaves a cell alone (`held_checkpoint`), in words for its skip line: a damaged
    cell is not counted as done, and the line says that --force retrains it."""
    if held["state"] == "finished":
        return "finished"
    if held["state"] == "imported":
        return f"holds a model {held['detail']}; --force replaces it"
    return f"DAMAGED, not retrained: {held['detail']}; --force retrains it"


def skipped_summary(name: str, out_dir: Path, held: dict[str, str]) -> dict[str, Any]:
    """The summary of a cell a launcher skipped, with its state and the reason (`skip_reason`)."""
    return {"name": name, "out_dir": str(out_dir), "skipped": True, "state": held["state"], "why": skip_reason(held)}


# -- one cell, as every launcher runs it ---------------------------------------------------------
def cell_specs(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """One JSON-able dict per cell with all a cell needs: grid name, cell, recipe and data settings."""
    spec = load_spec(spec)
    return [{"grid": spec.get("name", "grid"), "cell": dataclasses.asdict(cell), "train": spec.get("train") or {},
             "data": spec.get("data")} for cell in spec["cells"]]


def run_cell(spec_cell: dict[str, Any], root: str | Path, data_root: str | Path = "data", threads: int | None = None,
             force: bool = False, distributed: bool = False) -> dict[str, Any]:
    """Train (or resume) one grid cell into `<root>/<grid>/<cell>/`; returns its summary.

    A pure function of `spec_cell` and the folder, so any launcher can run it anywhere the folder and
    the prepared data are visible, and rerunning it after a crash resumes. `threads` sets torch's
    threads in this (worker) process; `distributed` joins a multi-task Slurm job as one torch rank.
    """
    if threads:
        torch.set_num_threads(threads)
    if distributed:
        from submitit.helpers import TorchDistributedEnvironment  # optional dependency

        TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    cell = check_cell(spec_cell["cell"])
    recipe = cell_recipe(spec_cell.get("train"), cell, threads)
    out_dir = Path(root) / check_name(spec_cell["grid"], "grid name") / cell.name
    held = None if force else held_checkpoint(out_dir)
    if held is not None:
        tidy_finished(out_dir)
        return skipped_summary(cell.name, out_dir, held)
    data_dir = grid_data_dir({"data": spec_cell.get("data")}, data_root)
    return train_cell(cell.model_config(), recipe, data_dir, out_dir, force=force)


# -- status from the folders alone ---------------------------------------------------------------
STATES = ("done", "imported", "damaged", "running", "failed", "pending")


def _pid_alive(pid: int) -> bool:
    """Whether a process with this pid runs on this host (a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def cell_status(out_dir: str | Path, stale_after: float = 900.0) -> dict[str, Any]:
    """{"state": done|imported|damaged|running|failed|pending, "step", "total_steps", "detail"} of one cell folder.

    done: eval.json and whole weights that match config.json; imported: a model `import-hf` wrote there;
    damaged: either of them with weights (or eval.json, config.json) that are missing or do not match
    (`held_checkpoint`, the rule `grid train` skips cells by). running: heartbeat.json of a live pid on
    this host, or (another host) one updated within `stale_after` seconds. failed: a recorded error
    (NaN stop, exception), a stale heartbeat (killed, timed out), or an interrupted run without one.
    pending: nothing there yet.
    """
    out_dir = Path(out_dir)
    held = held_checkpoint(out_dir)
    if held is not None and held["state"] == "finished":
        evals = read_json(out_dir / EVAL)  # eval_problem checked its step and val_loss
        loss = evals.get("val_loss")
        return {"state": "done", "step": evals["step"], "total_steps": evals["step"],
                "detail": f"val loss {loss:.4f}" if loss is not None else ""}
    if held is not None:
        return {"state": held["state"], "step": None, "total_steps": None, "detail": held["detail"]}
    saved = latest_step(out_dir / STATE_DIR)
    beat = _read_heartbeat(out_dir)
    if beat is not None:
        status = {"step": beat.get("step", saved), "total_steps": beat.get("total_steps")}
        if beat.get("state") == "failed":
            return {**status, "step": saved, "state": "failed", "detail": beat.get("error", "failed")}
        age = time.time() - (out_dir / HEARTBEAT).stat().st_mtime
        here = beat.get("host") == socket.gethostname()
        if (here and _pid_alive(int(beat.get("pid", -1)))) or (not here and age < stale_after):
            return {**status, "state": "running", "detail": f"pid {beat.get('pid')} on {beat.get('host')}"}
        why = f"process {beat.get('pid')} is gone" if here else f"no heartbeat from {beat.get('host')} for {age:.0f}s"
        return {**status, "step": saved, "state": "failed", "detail": f"stale heartbeat: {why}; rerun to resume"}
    if saved is not None or (out_dir / METRICS).is_file():
        return {"state": "failed", "step": saved, "total_steps": None, "detail": "interrupted (no heartbeat)"}
    return {"state": "pending", "step": None, "total_steps": None, "detail": ""}


def _read_heartbeat(out_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((out_dir / HEARTBEAT).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def grid_status(grid: str | Path | dict[str, Any], root: str | Path = "checkpoints",
                stale_after: float = 900.0) -> list[dict[str, Any]]:
    """`cell_status` of every cell of a grid, in spec order, each with its name and folder."""
    spec = load_spec(grid)
    grid_dir = Path(root) / spec.get("name", "grid")
    return [{"cell": c.name, "out_dir": str(grid_dir / c.name), **cell_status(grid_dir / c.name, stale_after)}
            for c in spec["cells"]]
