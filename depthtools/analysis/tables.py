"""Tidy result tables: model columns, and saving beside the checkpoint with the settings used.

`save_table(df, ckpt_dir, "ablate_skip", settings)` writes `<ckpt>/analysis/ablate_skip.parquet`
and `ablate_skip.json` (the settings, row count, columns). `load_table(ckpt_dir, name, settings)`
returns the table only if it was saved with the same settings, so a changed setting never reuses
a stale result (docs/design.md §6: reports read these tables and never recompute). `cached` is the one
cache rule every probe command and `analyze` use: identical settings -> reuse, else recompute.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any, Callable, Sequence

import pandas as pd

from depthtools.checkpoint import CONFIG, atomic_write_bytes, atomic_write_json, has_weights
from depthtools.errors import DepthToolsError
from depthtools.fsutil import check_name

ANALYSIS_DIR = "analysis"


def model_columns(model) -> dict[str, Any]:
    """The columns that identify a model in every table: model (cell name), arch, n_layer, d_model."""
    cfg = model.config
    directory = getattr(model, "checkpoint_dir", None)
    name = Path(directory).name if directory is not None else f"{cfg.arch}_L{cfg.n_layer}"
    return {"model": name, "arch": cfg.arch, "n_layer": cfg.n_layer, "d_model": cfg.d_model}


def normalise_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """Settings as they read back from JSON (tuples -> lists, paths -> strings), for comparison."""
    return json.loads(json.dumps(settings, sort_keys=True, default=str))


def table_paths(ckpt_dir: str | Path, name: str) -> tuple[Path, Path]:
    check_name(name, "table name")  # one file stem in <ckpt>/analysis/, like 'ablate_skip'
    folder = Path(ckpt_dir) / ANALYSIS_DIR
    return folder / f"{name}.parquet", folder / f"{name}.json"


def write_frame(df: pd.DataFrame, path: str | Path) -> Path:
    """Write a table atomically as parquet (default) or CSV (by suffix)."""
    path = Path(path)
    buffer = io.BytesIO()
    if path.suffix.lower() == ".csv":
        df.to_csv(buffer, index=False)
    elif path.suffix.lower() in (".parquet", ".pq"):
        df.to_parquet(buffer, index=False)
    else:
        raise DepthToolsError(f"cannot write {path}: use a .parquet or .csv file name")
    atomic_write_bytes(path, buffer.getvalue())
    return path


def save_table(df: pd.DataFrame, ckpt_dir: str | Path, name: str, settings: dict[str, Any],
               source: dict[str, Any] | None = None) -> Path:
    """Save `df` as `<ckpt>/analysis/<name>.parquet` with `<name>.json` holding the settings and, under
    "source", where the evaluation tokens came from (data folder or text file, split): recorded for the
    reader, not compared (the token hash in the settings already decides reuse)."""
    table_path, settings_path = table_paths(ckpt_dir, name)
    write_frame(df, table_path)
    record = {"settings": normalise_settings(settings), "rows": len(df), "columns": list(map(str, df.columns))}
    if source:
        record["source"] = normalise_settings(source)
    atomic_write_json(settings_path, record)
    return table_path


def load_table(ckpt_dir: str | Path, name: str, settings: dict[str, Any] | None = None) -> pd.DataFrame | None:
    """The saved table, or None if absent, unreadable, or saved with different settings.

    settings=None skips the comparison (read whatever was saved).
    """
    table_path, settings_path = table_paths(ckpt_dir, name)
    if not (table_path.is_file() and settings_path.is_file()):
        return None
    try:
        saved = json.loads(settings_path.read_text())
        if settings is not None and saved.get("settings") != normalise_settings(settings):
            return None
        return pd.read_parquet(table_path)
    except (OSError, ValueError, json.JSONDecodeError):
        return None


def load_settings(ckpt_dir: str | Path, name: str) -> dict[str, Any] | None:
    """The settings a table was saved with (None if absent or unreadable)."""
    _, settings_path = table_paths(ckpt_dir, name)
    try:
        saved = json.loads(settings_path.read_text())
    except (OSError, ValueError):
        return None
    settings = saved.get("settings") if isinstance(saved, dict) else None
    return settings if isinstance(settings, dict) else None


def cached(ckpt_dir: str | Path, names: Sequence[str], settings: dict[str, Any],
           compute: Callable[[], dict[str, pd.DataFrame]], recompute: bool = False,
           save: bool = True, source: dict[str, Any] | None = None) -> tuple[dict[str, pd.DataFrame], bool]:
    """The one cache rule of every probe: ({name: table}, reused).

    When every table in `names` is saved with exactly `settings` (and not `recompute`), the saved tables
    are returned; otherwise `compute()` runs and (if `save`) its tables are saved with `settings`,
    replacing whatever was saved under those names.
    """
    if not recompute:
        saved = {name: load_table(ckpt_dir, name, settings) for name in names}
        if all(df is not None for df in saved.values()):
            return saved, True
    tables = compute()
    if save:
        for name, df in tables.items():
            save_table(df, ckpt_dir, name, settings, source)
    return tables, False


def checkpoint_dirs(grid: str | Path) -> list[Path]:
    """Every checkpoint directory (config.json + model.safetensors or a sharded index) under a grid directory."""
    grid = Path(grid)
    if not grid.is_dir():
        raise DepthToolsError(f"grid directory {grid} does not exist")
    dirs = sorted(p.parent for p in grid.rglob(CONFIG) if has_weights(p.parent) and "train_state" not in p.parts)
    if not dirs:
        raise DepthToolsError(f"no checkpoints (model.safetensors + config.json) under {grid}")
    return dirs


def training_seed(config: dict[str, Any]) -> int:
    """The training seed a checkpoint's config.json records (0 for checkpoints saved without a recipe)."""
    train = config.get("train") if isinstance(config, dict) else None
    seed = train.get("seed", 0) if isinstance(train, dict) else 0
    return int(seed) if isinstance(seed, int) and not isinstance(seed, bool) else 0
