"""Read what a report shows: cell configs, training curves, eval losses and the saved analysis tables.

Reports never recompute (docs/design.md §6): everything here reads files that training, `depthtools analyze`,
`depthtools summarize` and `depthtools tasks eval` wrote. A missing or unreadable file is not an
error; it becomes a line in `missing` naming the cell, the file and the command that produces it,
so a report of a half-finished grid says what it lacks instead of failing.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from depthtools.analysis.suite import read_result
from depthtools.analysis.tables import ANALYSIS_DIR, checkpoint_dirs, load_table, training_seed
from depthtools.checkpoint import CONFIG, WEIGHTS, imported_from, read_json, read_metrics, resolve, weights_problem
from depthtools.errors import DepthToolsError

EVAL = "eval.json"
METRICS = "metrics.jsonl"

# Tables `depthtools analyze --grid` writes beside every checkpoint (lens_tuned only with --tuned).
SUITE_TABLES = ("lens_logit", "lens_logit_summary", "ablate_skip", "ablate_prune", "ablate_swap", "similarity",
                "causal", "contrib", "routing", "sequence_profile")
OPTIONAL_TABLES = ("lens_tuned", "lens_tuned_summary", "tasks_eval", "tasks_depth_reached", "prediction_depth",
                   "depthbench")

@dataclass
class CellData:
    """One checkpoint as a report sees it: identity, config, curve, final losses and saved tables."""

    name: str  # the cell (directory) name; the label every table and figure uses
    directory: Path
    config: dict[str, Any]
    metrics: pd.DataFrame  # training curve (metrics.jsonl), possibly empty
    eval: dict[str, Any] | None  # eval.json, None when training has not finished
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)
    missing: list[tuple[str, str]] = field(default_factory=list)  # (what, how to produce it)
    weights_problem: str | None = None  # why model.safetensors cannot be loaded (None: whole)

    @property
    def model_config(self) -> dict[str, Any]:
        return self.config.get("model") or {}

    @property
    def arch(self) -> str:
        return str(self.model_config.get("arch", "?"))

    @property
    def n_layer(self) -> int:
        return int(self.model_config.get("n_layer", 0) or 0)

    @property
    def d_model(self) -> int:
        return int(self.model_config.get("d_model", 0) or 0)

    @property
    def seed(self) -> int:
        """The training seed recorded in config.json (0 when none is)."""
        return training_seed(self.config)

    @property
    def provenance(self) -> str | None:
        """'imported from <format> <path>' for a model `import-hf` wrote (no training run here), else None."""
        return imported_from(self.config)

    @property
    def family(self) -> str | None:
        """The pretrained family of an imported model (gemma3_text, llama, ...): the `family` its Pre-LN block
        options record, else the model_type of the config it was imported from (a plain Llama block has no
        options to record one). None for a model trained here."""
        options = self.model_config.get("options")
        family = options.get("family") if isinstance(options, dict) else None
        source = self.config.get("source") if isinstance(self.config.get("source"), dict) else {}
        hf = source.get("hf_config") if isinstance(source.get("hf_config"), dict) else {}
        family = family or hf.get("model_type")
        return str(family) if family and self.provenance else None

    def info(self) -> dict[str, Any]:
        """The identifying columns every report table starts with."""
        # an imported model is named by its family (gemma3_text), not by the Pre-LN block (preln) expressing it
        arch = self.family if self.provenance and self.family else self.arch
        return {"model": self.name, "arch": arch, "n_layer": self.n_layer, "d_model": self.d_model,
                "seed": self.seed}

    def table(self, name: str) -> pd.DataFrame | None:
        return self.tables.get(name)


@dataclass
class GridData:
    """A grid directory as a report sees it: its cells plus the grid-level summary tables."""

    name: str
    directory: Path
    cells: list[CellData]
    models_summary: pd.DataFrame | None  # effective_depth_models (depthtools summarize)
    grid_summary: pd.DataFrame | None  # effective_depth_grid (depthtools summarize)
    spec: dict[str, Any] | None  # a grid spec JSON found in the grid directory, if any
    missing: list[tuple[str, str, str]] = field(default_factory=list)  # (where, what, how to produce it)


# -- one checkpoint --------------------------------------------------------------------------------

def _relabel(df: pd.DataFrame, cell: CellData) -> pd.DataFrame:
    """The table with the report's identity columns (a copied or renamed cell keeps its own name)."""
    df = df.copy()
    for key, value in cell.info().items():
        df[key] = value
    return df


def _read_table(directory: Path, name: str) -> pd.DataFrame | None:
    """A probe table by the name `analyze` and the probe commands share (older names translated)."""
    return read_result(directory, name)


def analyze_advice(directory: Path, config: dict[str, Any], grid: str | Path | None = None) -> str:
    """How to write a checkpoint's missing tables. A trained cell: `analyze` over its grid. An
    imported model has no grid and no recorded data: `analyze` of that checkpoint alone, on a text file
    tokenized with the tokenizer it carries (`--text`), or on data prepared with its original tokenizer.json
    when it carries none (a GGUF import that records its vocabulary only)."""
    if imported_from(config) is None:
        return f"run `depthtools analyze --grid {grid if grid is not None else directory.parent}`"
    record = config.get("tokenizer") if isinstance(config.get("tokenizer"), dict) else {}
    ckpt = _ckpt_argument(directory)
    if record.get("file") == "tokenizer.json" and (directory / "tokenizer.json").is_file():
        return f"run `depthtools analyze --ckpt {ckpt} --text YOUR_TEXT.txt` (tokenized with the model's own tokenizer)"
    return (f"run `depthtools analyze --ckpt {ckpt} --data DIR`, DIR prepared with the model's original "
            "tokenizer: `depthtools data prepare --input YOUR_TEXT.txt --tokenizer .../tokenizer.json`")


def _ckpt_argument(directory: Path) -> str:
    """The shortest --ckpt that finds `directory`: its name when that resolves to it under
    $DEPTHTOOLS_CHECKPOINTS (where import-hf --name puts it), else its path."""
    try:
        if resolve(directory.name).resolve() == directory.resolve():
            return directory.name
    except (DepthToolsError, OSError):
        pass
    return str(directory)


def read_cell(directory: str | Path, name: str | None = None, grid: str | Path | None = None) -> CellData:
    """Everything saved for one checkpoint directory (tables relabelled with `name`, default the dir name)."""
    directory = Path(directory)
    config = read_json(directory / CONFIG)
    if not isinstance(config, dict):
        raise DepthToolsError(f"{directory / CONFIG} is not a JSON object")
    advice = analyze_advice(directory, config, grid)
    metrics = pd.DataFrame(read_metrics(directory))
    cell = CellData(name=name or directory.name, directory=directory, config=config, metrics=metrics, eval=None)
    cell.weights_problem = weights_problem(directory / WEIGHTS)
    if cell.weights_problem is not None:
        cell.missing.append((WEIGHTS, f"{cell.weights_problem}: its losses and tables predate the damage and it "
                                      "cannot be probed again; restore the file, or retrain it "
                                      f"(`depthtools grid train SPEC --cells {directory.name} --force`)"))

    imported = imported_from(config)  # no training run: no eval.json or curve to miss
    try:
        cell.eval = read_json(directory / EVAL)
    except DepthToolsError as exc:
        if (directory / EVAL).is_file() or imported is None:
            how = (f"unreadable ({exc})" if (directory / EVAL).is_file()
                   else "training has not finished: rerun `depthtools grid train` (it resumes)")
            cell.missing.append((EVAL, how))
    if metrics.empty and imported is None:
        cell.missing.append((METRICS, "no training curve was logged"))
    for table in (*SUITE_TABLES, *OPTIONAL_TABLES):
        df = _read_table(directory, table)
        if df is not None:
            cell.tables[table] = _relabel(df, cell)
        elif table in SUITE_TABLES and not (imported and table == "routing"):  # imported: a plain residual stream
            cell.missing.append((f"{ANALYSIS_DIR}/{table}.parquet", advice))
    return cell


def resolve_checkpoints(ckpts: list[str | Path]) -> list[tuple[Path, str]]:
    """(directory, unique label) per checkpoint name or path; labels add the grid when names collide."""
    if not ckpts:
        raise DepthToolsError("give at least one checkpoint (a path or a cell name like hc_L8)")
    dirs = [resolve(c) for c in ckpts]
    seen = set()
    for given, d in zip(ckpts, dirs):
        key = d.resolve()
        if key in seen:
            raise DepthToolsError(f"checkpoint {given} is given twice; give each checkpoint once")
        seen.add(key)
    names = [d.name for d in dirs]
    labels = [f"{d.parent.name}/{d.name}" if names.count(d.name) > 1 else d.name for d in dirs]
    return list(zip(dirs, labels))


# -- a grid ----------------------------------------------------------------------------------------

def _grid_cell_dirs(grid: Path) -> tuple[list[Path], list[Path]]:
    """(checkpoint dirs, sub-directories that look like unfinished cells: a config but no weights)."""
    if not grid.is_dir():
        raise DepthToolsError(f"grid directory {grid} does not exist; give a directory like checkpoints/tiny")
    dirs = checkpoint_dirs(grid)
    partial = sorted(p for p in grid.iterdir() if p.is_dir() and p.name != ANALYSIS_DIR and p not in dirs
                     and ((p / CONFIG).is_file() or (p / METRICS).is_file() or (p / "train_state").is_dir()))
    return dirs, partial


def _read_spec(grid: Path) -> dict[str, Any] | None:
    """A grid spec (JSON with a 'cells' list) saved in the grid directory, if there is one."""
    for path in sorted(grid.glob("*.json")):
        try:
            spec = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(spec, dict) and isinstance(spec.get("cells"), list):
            return spec
    return None


def _grid_table(grid: Path, name: str) -> pd.DataFrame | None:
    try:
        return load_table(grid, name)
    except DepthToolsError:
        return None


def read_grid(grid_dir: str | Path) -> GridData:
    """Every cell of a grid and its grid-level summaries; what is absent is listed in `missing`."""
    grid = Path(grid_dir)
    dirs, partial = _grid_cell_dirs(grid)
    cells, unreadable = [], []
    for d in dirs:
        try:
            cells.append(read_cell(d, grid=grid))
        except DepthToolsError as exc:  # a corrupt config.json: name the cell, report the rest
            unreadable.append((d.name, CONFIG, str(exc)))
    if not cells:
        raise DepthToolsError(f"no readable checkpoint under {grid}: " + "; ".join(u[2] for u in unreadable))
    data = GridData(name=grid.resolve().name, directory=grid, cells=cells,
                    models_summary=_grid_table(grid, "effective_depth_models"),
                    grid_summary=_grid_table(grid, "effective_depth_grid"), spec=_read_spec(grid))
    data.missing.extend(unreadable)
    for p in partial:
        if (p / EVAL).is_file():  # grid train skips it as finished: resuming will not bring the weights back
            data.missing.append((p.name, WEIGHTS, "weights missing although training finished (eval.json is there): "
                                                  "restore model.safetensors, or retrain it (`depthtools grid train "
                                                  f"SPEC --cells {p.name} --force`)"))
        else:
            data.missing.append((p.name, WEIGHTS, "no finished weights: rerun `depthtools grid train` (it resumes)"))
    for cell in cells:
        data.missing.extend((cell.name, what, how) for what, how in cell.missing)
    summarize = f"run `depthtools summarize --grid {grid}`"
    for table, frame in (("effective_depth_models", data.models_summary), ("effective_depth_grid", data.grid_summary)):
        if frame is None:
            data.missing.append(("grid", f"{ANALYSIS_DIR}/{table}.parquet", summarize))
    if data.models_summary is not None and "model" in data.models_summary:
        absent = sorted({c.name for c in cells} - set(data.models_summary["model"].astype(str)))
        if absent:
            data.missing.append(("grid", "effective-depth summary rows for " + ", ".join(absent),
                                 f"the summary is older than these cells: {summarize}"))
    if data.spec is not None:
        present = {c.name for c in cells} | {p.name for p in partial}
        for planned in data.spec["cells"]:
            name = str(planned.get("name", "?")) if isinstance(planned, dict) else "?"
            if name not in present:
                data.missing.append((name, "cell directory", "planned in the grid spec but not trained: "
                                                             "run `depthtools grid train SPEC`"))
    return data


def weights_warnings(cells: list[CellData], missing: list[tuple[str, str, str]] = ()) -> list[str]:
    """One line per checkpoint whose weights are missing or damaged: cells read with damaged weights,
    and grid rows for cell folders whose model.safetensors is absent."""
    lines = [f"{c.name}: {c.weights_problem}" for c in cells if c.weights_problem is not None]
    lines += [f"{where}: {how}" for where, what, how in missing if what == WEIGHTS and "missing although" in how]
    return lines


def weights_warnings_of(grid: str | Path | None = None, ckpts: list[str | Path] | None = None) -> list[str]:
    """`weights_warnings` for a grid folder or checkpoint names, from the weights files' headers alone
    (no table is read): what the CLI prints after writing a report."""
    if grid is not None:
        dirs, partial = _grid_cell_dirs(Path(grid))
        finished_without = [p for p in partial if (p / EVAL).is_file()]
        return ([f"{d.name}: {problem}" for d in dirs if (problem := weights_problem(d / WEIGHTS)) is not None]
                + [f"{p.name}: weights missing although training finished (eval.json is there)" for p in finished_without])
    return [f"{label}: {problem}" for d, label in resolve_checkpoints(list(ckpts or []))
            if (problem := weights_problem(d / WEIGHTS)) is not None]


def finite(value: Any) -> bool:
    """A real number that is not NaN/inf (table cells may be None, NA or NaN)."""
    try:
        return value is not None and not pd.isna(value) and math.isfinite(float(value))
    except (TypeError, ValueError):
        return False
