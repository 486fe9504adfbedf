"""Exact-resume training state in `<cell>/train_state/`, without pickle.

    step_<N>.safetensors  model/<param>, optim/<param>/<key>, rng/torch_cpu, rng/cuda
    step_<N>.json         step, tokens, run fingerprint, optimizer groups, data position
    latest.json           {"step": N, ...}: written last (atomically), so it only ever names a
                          complete pair; older pairs are removed after it moves on. Should it be
                          unreadable anyway (disk trouble, a hand edit), resume falls back to the
                          newest intact pair and says so; with none intact it refuses.

A crash at any moment leaves the previous `latest.json` and its files intact: the last good
checkpoint is never overwritten in place.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from depthtools.checkpoint import atomic_save_tensors, atomic_write_json, model_state, read_json, read_tensors
from depthtools.errors import CheckpointError
from depthtools.fsutil import read_json_object
from depthtools.train.optim import load_optimizer_tensors, optimizer_tensors

STATE_DIR = "train_state"
LATEST = "latest.json"
logger = logging.getLogger(__name__)


def _stem(step: int) -> str:
    return f"step_{step:08d}"


def save_train_state(directory: Path, step: int, model, optimizer, names: list[str], info: dict[str, Any],
                     keep: int | None = None) -> Path:
    """Write the state after `step` optimizer updates, then point latest.json at it; every other pair
    is removed except `keep`'s (the trainer keeps the last state a later loss has vouched for until
    this one is vouched for too, see `prune_train_state` / `roll_back_train_state`)."""
    directory = Path(directory)
    tensors = {f"model/{k}": v for k, v in model_state(model).items()}
    optim_tensors, optim_meta = optimizer_tensors(optimizer, names)
    tensors.update(optim_tensors)
    tensors["rng/torch_cpu"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["rng/cuda"] = torch.cuda.get_rng_state()
    stem = _stem(step)
    atomic_save_tensors(directory / f"{stem}.safetensors", tensors, metadata={"step": str(step)})
    atomic_write_json(directory / f"{stem}.json", {"step": step, "optimizer": optim_meta, **info})
    atomic_write_json(directory / LATEST, {"step": step, "tensors": f"{stem}.safetensors", "state": f"{stem}.json"})
    prune_train_state(directory, step, keep)
    return directory


def remove_partial_writes(directory: Path) -> list[str]:
    """Remove the hidden temporary files (`.<name>.<random>.tmp`) that atomic writes leave when the process
    is killed inside one: a kill inside a checkpoint write left them in train_state/ until the run
    finished. Called by the one process holding the cell's lock, when a run starts or resumes."""
    removed = []
    for path in sorted(Path(directory).glob(".*.tmp")) if Path(directory).is_dir() else []:
        if path.is_file():
            path.unlink(missing_ok=True)
            removed.append(path.name)
    if removed:
        logger.info("%s: removed %d temporary file(s) of an interrupted write", directory, len(removed))
    return removed


def prune_train_state(directory: Path, step: int, keep: int | None = None) -> None:
    """Remove every step pair but `step`'s (and `keep`'s)."""
    kept = {_stem(step)} | ({_stem(keep)} if keep is not None else set())
    for old in Path(directory).glob("step_*"):
        if old.name.split(".", 1)[0] not in kept:
            old.unlink(missing_ok=True)


def roll_back_train_state(directory: Path, to: int | None, drop: int) -> None:
    """Make step `to` the latest state again (None: no state at all) and delete step `drop`'s pair:
    a run that diverged right after saving `drop` resumes from the last state known to be good."""
    directory = Path(directory)
    if to is not None:
        atomic_write_json(directory / LATEST, {"step": to, "tensors": f"{_stem(to)}.safetensors",
                                               "state": f"{_stem(to)}.json"})
    else:
        (directory / LATEST).unlink(missing_ok=True)
    for old in directory.glob(f"{_stem(drop)}.*"):
        old.unlink(missing_ok=True)


def older_states(directory: Path, step: int) -> list[int]:
    """Steps of the saved pairs older than `step` (newest first)."""
    return [s for s in _saved_steps(directory) if s < step]


def latest_step(directory: Path) -> int | None:
    """The step latest.json names in `directory`, or None if there is none (or it cannot be read)."""
    path = Path(directory) / LATEST
    if not path.is_file():
        return None
    try:
        step = read_json_object(path, "the train state pointer", CheckpointError)["step"]
    except (CheckpointError, KeyError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None


def _saved_steps(directory: Path) -> list[int]:
    """Steps that have a step_<N>.json or step_<N>.safetensors file, newest first."""
    steps = set()
    for path in Path(directory).glob("step_*"):
        digits = path.name[len("step_"):].split(".", 1)[0]
        if digits.isdigit() and path.suffix in (".json", ".safetensors"):
            steps.add(int(digits))
    return sorted(steps, reverse=True)


def _read_pair(directory: Path, step: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The JSON and tensors of one saved step; CheckpointError if either is missing or corrupt."""
    stem = _stem(step)
    info = read_json(directory / f"{stem}.json")
    if not isinstance(info, dict) or info.get("step") != step or not isinstance(info.get("optimizer"), dict):
        raise CheckpointError(f"{directory / (stem + '.json')} is not a complete train state")
    tensors = read_tensors(directory / f"{stem}.safetensors")
    if "rng/torch_cpu" not in tensors:
        raise CheckpointError(f"{directory / (stem + '.safetensors')} lacks the RNG state")
    return info, tensors


def _latest_pair(directory: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]] | None:
    """The pair latest.json names; if latest.json or that pair cannot be read, the newest intact
    step_<N> pair (saying so in a log line), so an unreadable pointer never restarts a run from step 0.

    None when no state was ever completed (no latest.json and no intact pair: latest.json is written
    last, so a run killed inside its first checkpoint starts over, as before); CheckpointError when
    latest.json exists but neither it nor any step pair is intact.
    """
    steps = _saved_steps(directory)
    named = latest_step(directory)
    exists = (directory / LATEST).is_file()
    if not exists and not steps:
        return None
    problem, named_pair_bad = None, False
    if named is not None:
        latest = read_json_object(directory / LATEST, "the train state pointer", CheckpointError)
        if latest.get("tensors") != f"{_stem(named)}.safetensors" or latest.get("state") != f"{_stem(named)}.json":
            problem = f"names unexpected files ({latest.get('tensors')!r}, {latest.get('state')!r})"
        else:
            try:
                return _read_pair(directory, named)
            except CheckpointError as exc:
                problem, named_pair_bad = f"names a state that is unusable ({exc})", True
    else:
        problem = "is missing" if not (directory / LATEST).is_file() else "cannot be read"
    for step in steps:
        if step == named and named_pair_bad:
            continue
        try:
            pair = _read_pair(directory, step)
        except CheckpointError:
            continue
        logger.warning("%s: %s %s; resuming from the newest intact train state instead, step %d",
                       directory, LATEST, problem, step)
        return pair
    if not exists:
        return None
    raise CheckpointError(f"{directory}: {LATEST} {problem} and no intact step_*.json/.safetensors pair is left "
                          "to resume from; pass force=True (--force) to discard it and start over")


def run_differences(saved: dict[str, Any], info: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """The fields in which the run that saved a train state (`info`, its "run" record: model config,
    recipe, data fingerprint) differs from `current` (the same record of this run, plus the weights'
    param_dtype), as "train.param_dtype 'float32' -> 'bfloat16'" lines. States saved before the record
    existed name only the weights dtype (their "param_dtype", float32 when absent) and peak lr."""
    missing = object()

    def show(value: Any) -> str:
        if value is missing:
            return "(default)"
        return repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."

    if isinstance(saved, dict) and saved:
        out = []
        for section in ("model", "train"):
            old, new = saved.get(section) or {}, current.get(section) or {}
            out += [f"{section}.{k} {show(old.get(k, missing))} -> {show(new.get(k, missing))}"
                    for k in sorted(set(old) | set(new)) if old.get(k, missing) != new.get(k, missing)]
        if saved.get("data") != current.get("data"):
            out.append(f"data fingerprint {str(saved.get('data'))[:12]} -> {str(current.get('data'))[:12]}")
        return out
    dtype = info.get("param_dtype", "float32")
    return [f"train.param_dtype (the weights) {dtype!r} -> {current['param_dtype']!r}"] \
        if "param_dtype" in current and dtype != current["param_dtype"] else []


def load_train_state(directory: Path, model, optimizer, names: list[str], fingerprint: str,
                     lr_free_fingerprint: str | None = None, allow_lr_change: bool = False,
                     record: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Restore model, optimizer and RNG from the latest state; returns its JSON (None if no state).

    An unreadable latest.json falls back to the newest intact step pair (logged), or is refused
    (CheckpointError) when none is intact. Refuses a state written by a different run (model, recipe or
    data) — except, with allow_lr_change, one whose run differs only in its learning rate (the saved
    `fingerprint_without_lr` equals `lr_free_fingerprint`): the caller records that change. `record`
    (this run's `run_record` and param_dtype) lets the refusal name the fields that differ.
    """
    directory = Path(directory)
    pair = _latest_pair(directory)
    if pair is None:
        return None
    info, tensors = pair
    if info.get("fingerprint") != fingerprint:
        only_lr = lr_free_fingerprint is not None and info.get("fingerprint_without_lr") == lr_free_fingerprint
        if only_lr and not allow_lr_change:
            raise CheckpointError(
                f"{directory} (step {info['step']}) was trained with another learning rate (peak lr "
                f"{info.get('peak_lr')}); pass allow_lr_change=True (--resume-with-changed-lr) to continue it with "
                "the new one, or force=True (--force) to discard it and start over"
            )
        if allow_lr_change and "fingerprint_without_lr" not in info:
            raise CheckpointError(
                f"{directory} (step {info['step']}) was saved by an older depthtools that did not record what a "
                "learning-rate change must leave unchanged; it cannot resume with another run fingerprint: pass "
                "force=True (--force) to start over"
            )
        if not only_lr:
            changed = run_differences(info.get("run"), info, record) if record is not None else []
            what = f": {'; '.join(changed[:4])}{' ...' if len(changed) > 4 else ''}" if changed else ""
            raise CheckpointError(
                f"{directory} belongs to a run with a different model, recipe or data{what}"
                + (" (more than the learning rate changed)" if allow_lr_change else "")
                + "; rerun with the saved settings to resume, or pass force=True (--force) to discard it and start over"
            )
    weights = {k[len("model/"):]: v for k, v in tensors.items() if k.startswith("model/")}
    missing = sorted(set(model_state(model)) - set(weights))
    if missing:
        raise CheckpointError(f"{directory}: train state lacks model tensors {missing[:3]}")
    try:  # a pair that reads but does not fit (edited or foreign contents) is refused, naming it
        with torch.no_grad():
            model.load_state_dict(weights, strict=False)
        load_optimizer_tensors(optimizer, names, tensors, info["optimizer"])
        torch.set_rng_state(tensors["rng/torch_cpu"])
        if "rng/cuda" in tensors and torch.cuda.is_available():
            torch.cuda.set_rng_state(tensors["rng/cuda"])
    except (CheckpointError, KeyError, TypeError, ValueError, AttributeError, RuntimeError) as exc:
        detail = str(exc).splitlines()[0] if str(exc) else ""
        raise CheckpointError(
            f"{directory / (_stem(info['step']) + '.*')}: the saved state cannot be restored "
            f"({type(exc).__name__}: {detail}); pass force=True (--force) to discard it and start over") from None
    return info
