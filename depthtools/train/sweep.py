"""Train every cell of a grid spec: `train_grid("grid.json")` (or a spec dict from `grid_spec`).

Cells land in `<root>/<grid name>/<cell name>/`. Finished cells are skipped, interrupted ones
resume from their train_state, and the grid's corpus is prepared on first use. A grid never mixes
tokenizers: if finished cells recorded another tokenizer than the data now gives, it refuses.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from depthtools.checkpoint import CONFIG, read_json
from depthtools.config import TrainConfig
from depthtools.data import prepare, read_meta
from depthtools.errors import DepthToolsError
from depthtools.grid import Cell, load_grid
from depthtools.train.loop import Progress, is_finished, train_cell

DEFAULT_DATA = {"corpus": "default", "tokenizer": "byte"}


def load_spec(grid: str | Path | dict[str, Any]) -> dict[str, Any]:
    """A grid spec with `Cell` objects, from a path or an in-memory spec (cells as dicts or Cells)."""
    if isinstance(grid, (str, Path)):
        return load_grid(grid)
    spec = dict(grid)
    try:
        spec["cells"] = [c if isinstance(c, Cell) else Cell(**c) for c in spec["cells"]]
    except (KeyError, TypeError) as exc:
        raise DepthToolsError(f"grid spec is not valid: {exc}") from None
    return spec


def grid_data_dir(spec: dict[str, Any], data_root: str | Path = "data") -> Path:
    """Prepare (or find) the grid's corpus with `depthtools.data.prepare` and return its folder."""
    data = {**DEFAULT_DATA, **(spec.get("data") or {})}
    data.setdefault("out_dir", data_root)
    try:
        return prepare(**data)
    except TypeError as exc:
        raise DepthToolsError(f"grid spec 'data' has an unknown field: {exc}") from None


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


def train_grid(grid: str | Path | dict[str, Any], root: str | Path = "checkpoints", force: bool = False,
               progress: Progress | None = None, data_root: str | Path = "data") -> list[dict[str, Any]]:
    """Train all cells of a grid; returns one summary per cell (skipped ones have skipped=True)."""
    spec = load_spec(grid)
    train_cfg = TrainConfig.from_dict(spec.get("train") or {})
    model_cfgs = [cell.model_config() for cell in spec["cells"]]  # validate every cell before training any
    grid_dir = Path(root) / spec.get("name", "grid")
    data_dir = grid_data_dir(spec, data_root)
    meta = read_meta(data_dir)
    if not force:
        check_tokenizer(grid_dir, meta)
    summaries = []
    for index, (cell, model_cfg) in enumerate(zip(spec["cells"], model_cfgs)):
        out_dir = grid_dir / cell.name
        tag = {"cell_index": index, "n_cells": len(spec["cells"])}
        if is_finished(out_dir) and not force:
            summaries.append({"name": cell.name, "out_dir": str(out_dir), "skipped": True})
            if progress is not None:
                progress({"event": "skip", "cell": cell.name, **tag})
            continue
        relay = None if progress is None else (lambda event, tag=tag: progress({**event, **tag}))
        summaries.append(train_cell(model_cfg, train_cfg, data_dir, out_dir, force=force, progress=relay))
    return summaries
