"""Import a native OLMo-core checkpoint (DepthBench's training runs) as a depthtools checkpoint.

An OLMo-core run folder holds one `stepN/` folder per saved step: `config.json` (the experiment's config,
written after the save), `model_and_optim/` (torch.distributed.checkpoint, sharded over the ranks that
trained it) and `train/` (trainer state, never read here). OLMo-core saves into `stepN-tmp/` and renames it,
and the config is written after that, so a step is complete when `config.json` and
`model_and_optim/.metadata` (which DCP writes last) are both present. Without `--step` the latest complete
step is imported and the incomplete ones passed over are named in a note.

The weights are read by `depthtools.interop.dcp` (no pickled code runs); the config mapping and parameter
names are `depthtools.interop.olmo_core.build_from_olmo_core` (docs/olmo-core-mapping.md). Everything is read and checked before
anything is written, and the checkpoint is written into a hidden staging folder beside the target and then
renamed into place (`fsutil.replace_dir`), so a refusal or a crash never leaves a half-written checkpoint
and a forced re-import keeps the old one until the new one is whole.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from depthtools.arch import DepthModel
from depthtools.checkpoint import CONFIG, check_shapes, check_weights, checkpoints_root, save
from depthtools.data.tokenizer import tokenizer_file_fingerprint
from depthtools.errors import CheckpointError, DepthToolsError
from depthtools.fsutil import StagingFolder, check_dir_target, check_name, file_sha256, read_json_object
from depthtools.interop.checks import _tokenizer_json
from depthtools.interop.dcp import check_files, read_model_tensors
from depthtools.interop.llama import IMPORT_STAGING, _load_state, _tokenizer_size, import_target
from depthtools.interop.olmo_core import build_from_olmo_core, olmo_core_mapping

MODEL_DIR = "model_and_optim"
STEP_NAME = re.compile(r"^step(\d+)$")
UNFINISHED_NAME = re.compile(r"^step(\d+)-tmp$")  # OLMo-core's staging folder of a save in progress
TOKENIZER_FILE = "tokenizer.json"
FORMAT = "olmo-core"


# -- which step --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Step:
    """One `stepN/` folder and, when it cannot be imported, why."""

    number: int
    path: Path
    problem: str | None

    @property
    def complete(self) -> bool:
        return self.problem is None


def step_problem(path: Path) -> str | None:
    """Why a step folder is not a complete save (None when it is): its config or DCP metadata is missing."""
    missing = [f for f in (CONFIG, f"{MODEL_DIR}/.metadata") if not (path / f).is_file()]
    if not missing:
        return None
    return f"{' and '.join(missing)} missing: the run was stopped while saving it, or it was not copied whole"


def is_step_dir(path: Path) -> bool:
    """A folder named stepN (or OLMo-core's stepN-tmp), or one holding a model_and_optim/ folder."""
    return path.is_dir() and (bool(STEP_NAME.match(path.name) or UNFINISHED_NAME.match(path.name))
                              or (path / MODEL_DIR).is_dir())


def find_steps(run_dir: Path) -> list[Step]:
    """The `stepN/` folders of a run folder, by step number."""
    steps = []
    for child in run_dir.iterdir() if run_dir.is_dir() else ():
        match = STEP_NAME.match(child.name)
        if match and child.is_dir():
            steps.append(Step(int(match.group(1)), child, step_problem(child)))
    return sorted(steps, key=lambda s: s.number)


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and any(STEP_NAME.match(c.name) or UNFINISHED_NAME.match(c.name) for c in path.iterdir())


def _step_number(path: Path) -> int | None:
    match = STEP_NAME.match(path.name)
    return int(match.group(1)) if match else None


def choose_step(path: str | Path, step: int | None = None) -> tuple[Step, list[str]]:
    """The step folder to import from a run folder or a step folder, and notes on what was passed over.

    A run folder without `step`: the latest complete step. With `step`: that step, which must exist and be
    complete. A step folder: itself (`step`, if given, must be its number). Refusals are one line."""
    path = Path(path)
    if not is_run_dir(path) or (path / MODEL_DIR).is_dir():
        return _step_folder(path, step), []
    steps = find_steps(path)
    if step is not None:
        return _named_step(path, steps, step), [f"imported step{step}"]
    return _latest_complete(path, steps)


def _step_folder(path: Path, step: int | None) -> Step:
    """A step folder given as PATH: complete, and of number `step` when that is given."""
    number = _step_number(path)
    if step is not None and number is not None and step != number:
        raise DepthToolsError(f"--step {step} does not match the step folder {path} (step {number}); give the "
                              "run folder to choose a step")
    problem = ("a stepN-tmp folder is a save OLMo-core had not finished" if UNFINISHED_NAME.match(path.name)
               else step_problem(path))
    if problem is not None:
        raise CheckpointError(f"cannot import step folder {path}: {problem}")
    return Step(number if number is not None else -1, path, None)


def _named_step(run: Path, steps: list[Step], step: int) -> Step:
    """`--step N` of a run folder: it must exist and be complete."""
    match = [s for s in steps if s.number == step]
    if not match:
        known = ", ".join(str(s.number) for s in steps) or "none"
        raise DepthToolsError(f"--step {step}: {run} has no step{step}/ folder (steps: {known})")
    if not match[0].complete:
        raise CheckpointError(f"cannot import {match[0].path}: {match[0].problem}")
    return match[0]


def _latest_complete(run: Path, steps: list[Step]) -> tuple[Step, list[str]]:
    """The newest complete step of a run folder, and a note for every newer or unfinished one passed over."""
    complete = [s for s in steps if s.complete]
    if not complete:
        why = "; ".join(f"{s.path.name}: {s.problem}" for s in steps) or "no stepN/ folder"
        raise CheckpointError(f"{run} has no complete step to import ({why})")
    chosen = complete[-1]
    notes = [f"passed over {s.path.name} (newer than {chosen.path.name}): {s.problem}"
             for s in steps if s.number > chosen.number]
    notes += [f"passed over {c.name}: a save OLMo-core had not finished"
              for c in sorted(run.iterdir()) if UNFINISHED_NAME.match(c.name)]
    notes.append(f"imported {chosen.path.name}, the latest complete step of {len(steps)}")
    return chosen, notes


# -- tokenizer ---------------------------------------------------------------------------------------------
def named_tokenizer(config: dict[str, Any]) -> str | None:
    """The tokenizer an OLMo-core experiment config names (`dataset.tokenizer.identifier`), if any."""
    for section in ("dataset", "data"):
        tokenizer = (config.get(section) or {}).get("tokenizer") if isinstance(config.get(section), dict) else None
        if isinstance(tokenizer, dict) and isinstance(tokenizer.get("identifier"), str):
            return tokenizer["identifier"]
    return None


def _tokenizer_file(candidate: Path) -> Path | None:
    if candidate.is_file():
        return candidate
    if candidate.is_dir() and (candidate / TOKENIZER_FILE).is_file():
        return candidate / TOKENIZER_FILE
    return None


def find_tokenizer(config: dict[str, Any], step_dir: Path, given: str | Path | None) -> tuple[Path | None, str | None]:
    """(tokenizer.json to carry, or None; a note when none is carried).

    `--tokenizer FILE` (a tokenizer.json, or a folder holding one) wins and must exist. Otherwise the
    identifier the step's config names is carried when it is a local file or folder (absolute, or relative to
    the step or run folder); a hub name is not downloaded, so nothing is carried and the note says so."""
    if given is not None:
        found = _tokenizer_file(Path(given))
        if found is None:
            raise DepthToolsError(f"--tokenizer {given}: no such tokenizer file (give a tokenizer.json or a folder "
                                  "holding one)")
        return found, None
    named = named_tokenizer(config)
    if named:
        for base in (Path(), step_dir, step_dir.parent):
            found = _tokenizer_file(base / named)
            if found is not None:
                return found, None
        return None, (f"no tokenizer was carried: config.json names {named!r}, which is not a local file (nothing "
                      "is downloaded); pass --tokenizer FILE to carry one")
    return None, "no tokenizer was carried: config.json names none; pass --tokenizer FILE to carry one"


def tokenizer_record(file: Path, vocab_size: int, config: dict[str, Any]) -> dict[str, Any]:
    """The config.json "tokenizer" record of a carried tokenizer.json, as `import-hf` writes it."""
    _tokenizer_json(file, vocab_size)  # loads, and every id it can produce indexes the embedding
    section = (config.get("dataset") or {}).get("tokenizer") if isinstance(config.get("dataset"), dict) else None
    eos = section.get("eos_token_id") if isinstance(section, dict) else None
    return {"name": "huggingface", "format": "huggingface", "file": TOKENIZER_FILE, "files": [TOKENIZER_FILE],
            "fingerprint": tokenizer_file_fingerprint(file) or file_sha256(file), "vocab_size": _tokenizer_size(file), "sep_id": eos,
            "from": str(file.resolve())}


# -- the import --------------------------------------------------------------------------------------------
def target_folder(name: str | None, out: str | Path | None, force: bool) -> Path:
    """Where the checkpoint goes: the one rule every import uses (`llama.import_target`), so a folder that holds
    no depthtools checkpoint (a Hugging Face folder included) is never replaced, even with `force`."""
    return import_target(name, out, force)


def read_step(step: Step) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json, model tensors under OLMo-core's names) of a complete step folder."""
    config = read_json_object(step.path / CONFIG, "OLMo-core experiment config", DepthToolsError)
    if not isinstance(config.get("model"), dict):
        raise DepthToolsError(f"{step.path / CONFIG} has no \"model\" section (not an OLMo-core experiment config)")
    return config, read_model_tensors(step.path / MODEL_DIR)


def build_model(config: dict[str, Any], tensors: dict[str, Any], step: Step, max_seq_len: int | None = None):
    """(DepthModel in eval mode, provenance) from a step's config and tensors, every check made first."""
    cfg, state, provenance = build_from_olmo_core(config, tensors, str(step.path))
    if max_seq_len is not None:
        cfg = dataclasses.replace(cfg, max_seq_len=max_seq_len)
    check_shapes(cfg, {k: tuple(v.shape) for k, v in state.items()}, step.path)
    check_weights(state, step.path)
    model = DepthModel(cfg)
    _load_state(model, {k: v.float() for k, v in state.items()}, str(step.path))
    return model.eval(), provenance


def _source(path: Path, step: Step, provenance: dict[str, Any]) -> dict[str, Any]:
    meta = step.path / MODEL_DIR / ".metadata"
    shards = sorted(p.name for p in (step.path / MODEL_DIR).glob("*.distcp"))
    return {"format": FORMAT, "path": str(path.resolve()), "step": step.number if step.number >= 0 else None,
            "step_path": str(step.path.resolve()), "config_sha256": file_sha256(step.path / CONFIG),
            "metadata_sha256": file_sha256(meta), "distcp_files": len(shards), "olmo_core": provenance}


def write_checkpoint(model, target: Path, extra: dict[str, Any], tokenizer: Path | None) -> None:
    """Write the checkpoint into a staging folder beside `target`, then rename it into place (the staging folder
    every import uses, `llama.IMPORT_STAGING`: a killed import's leftover is removed by the next one)."""
    with StagingFolder(target, IMPORT_STAGING) as staging:
        save(model, staging, extra=extra)
        if tokenizer is not None:
            shutil.copyfile(tokenizer, staging / TOKENIZER_FILE)


@dataclass
class Prepared:
    """One OLMo-core checkpoint read, mapped and checked, ready to write: nothing has been written yet."""

    path: Path
    model: Any
    extra: dict[str, Any]
    tokenizer: Path | None
    notes: list[str]

    def summary(self, target: Path) -> dict[str, Any]:
        return {"checkpoint": str(target), "source": str(self.path), "format": FORMAT,
                "step": self.extra["source"]["step"], "model": self.model.config.to_dict(),
                "params": self.model.param_counts(), "tokenizer": self.extra["tokenizer"], "notes": self.notes}


def prepare_olmo_core(path: str | Path, step: int | None = None, tokenizer: str | Path | None = None,
                      max_seq_len: int | None = None) -> Prepared:
    """Read, map and check one OLMo-core run or step folder (`choose_step`, `read_step`, `build_model`, the
    tokenizer rule); every refusal happens here, before anything is written."""
    path = Path(path)
    chosen, notes = choose_step(path, step)
    config, tensors = read_step(chosen)
    model, provenance = build_model(config, tensors, chosen, max_seq_len)
    carried, why = find_tokenizer(config, chosen.path, tokenizer)
    record = tokenizer_record(carried, model.config.vocab_size, config) if carried is not None else None
    notes += list(provenance.get("notes") or []) + ([why] if why else [])
    extra = {"source": _source(path, chosen, provenance), "tokenizer": record, "train": None}
    return Prepared(path, model, extra, carried, notes)


def import_olmo_core(path: str | Path, name: str | None = None, out: str | Path | None = None, force: bool = False,
                     step: int | None = None, tokenizer: str | Path | None = None,
                     max_seq_len: int | None = None) -> dict[str, Any]:
    """Import an OLMo-core run folder (its latest complete step, or `step`) or one step folder; returns a summary.

    The checkpoint lands in `out` or `$DEPTHTOOLS_CHECKPOINTS/<name>`; its config.json records the run, the
    step, the digests of the files read and the mapping's provenance under "source" (`info` shows it)."""
    target = target_folder(name, out, force)
    prepared = prepare_olmo_core(path, step, tokenizer, max_seq_len)
    write_checkpoint(prepared.model, target, prepared.extra, prepared.tokenizer)
    return prepared.summary(target)


def import_sweep(paths: list[str | Path], grid: str | None = None, out: str | Path | None = None,
                 force: bool = False, step: int | None = None, tokenizer: str | Path | None = None,
                 max_seq_len: int | None = None) -> dict[str, Any]:
    """Import the run folders of one sweep (e.g. DepthBench's aspect ratios) as the cells of one grid.

    Each run becomes `<grid folder>/<arch>_L<n_layer>` (the name a trained grid's cell has), so `analyze --grid`,
    `summarize` and `report` read the sweep as they read a grid trained here. The grid folder is `out`, or
    `$DEPTHTOOLS_CHECKPOINTS/<grid>`. Before the first cell is written, every run's step is chosen, its `.distcp`
    files checked and its cell name read from its config (`_cell_names`): two runs of one name (same architecture
    and depth) and an existing cell (without `force`) are refused. Each cell is written whole or not at all
    (staging folder + rename); a run whose weights are refused stops the import there."""
    if out is None and not grid:
        raise DepthToolsError("give a grid name (--grid) or a grid folder (--out) to import several runs as one grid")
    if grid is not None:
        check_name(grid, "grid name (--grid)")
    folder = Path(out) if out is not None else checkpoints_root() / str(grid)
    check_dir_target(folder, "grid folder (--out)")
    names = _cell_names(paths, step, folder, force)  # every refusal before the first cell is written
    cells: dict[str, dict[str, Any]] = {}
    for path, name in zip(paths, names):
        prepared = prepare_olmo_core(path, step, tokenizer, max_seq_len)
        cfg = prepared.model.config
        if name != f"{cfg.arch}_L{cfg.n_layer}":  # the config did not change between the two reads
            raise DepthToolsError(f"{path} changed while it was imported (cell {name} became {cfg.arch}_L{cfg.n_layer})")
        write_checkpoint(prepared.model, folder / name, prepared.extra, prepared.tokenizer)
        cells[name] = prepared.summary(folder / name)
        del prepared
    return {"grid": str(folder), "cells": list(cells.values()),
            "notes": ["one training seed per cell: the report says that no seed noise was measured"]}


def _cell_names(paths: list[str | Path], step: int | None, folder: Path, force: bool) -> list[str]:
    """The cell name `<arch>_L<n_layer>` of every run of a sweep, from its step's config alone, after checking its
    DCP files (no tensor is read): two runs of one name, or a name whose folder holds a checkpoint (without
    `force`) or other files, are refused before anything is written."""
    names: dict[str, Path] = {}
    for path in paths:
        chosen = choose_step(path, step)[0]
        check_files(chosen.path / MODEL_DIR)
        config = read_json_object(chosen.path / CONFIG, "OLMo-core experiment config", DepthToolsError)
        cfg = olmo_core_mapping(config).cfg
        name = f"{cfg.arch}_L{cfg.n_layer}"
        if name in names:
            raise DepthToolsError(f"{path} and {names[name]} both import as cell {name} (same architecture and "
                                  "depth); import them into different grids")
        target_folder(None, folder / name, force)
        names[name] = Path(path)
    return list(names)


__all__ = ["import_olmo_core", "import_sweep", "prepare_olmo_core", "choose_step", "find_steps", "step_problem",
           "is_step_dir", "is_run_dir", "find_tokenizer", "named_tokenizer", "target_folder", "Step", "FORMAT"]
