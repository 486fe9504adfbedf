"""Exact-resume training state in `<cell>/train_state/`, without pickle.

    step_<N>.safetensors  model/<param>, optim/<param>/<key>, rng/torch_cpu, rng/cuda
    step_<N>.json         step, tokens, run fingerprint, optimizer groups, data position
    latest.json           {"step": N, ...}: written last (atomically), so it only ever names a
                          complete pair; older pairs are removed after it moves on.

A crash at any moment leaves the previous `latest.json` and its files intact: the last good
checkpoint is never overwritten in place.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from depthtools.checkpoint import atomic_save_tensors, atomic_write_json, model_state, read_json, read_tensors
from depthtools.errors import CheckpointError
from depthtools.train.optim import load_optimizer_tensors, optimizer_tensors

STATE_DIR = "train_state"
LATEST = "latest.json"


def _stem(step: int) -> str:
    return f"step_{step:08d}"


def save_train_state(directory: Path, step: int, model, optimizer, names: list[str], info: dict[str, Any]) -> Path:
    """Write the state after `step` optimizer updates, then point latest.json at it."""
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
    for old in directory.glob("step_*"):
        if not old.name.startswith(stem):
            old.unlink(missing_ok=True)
    return directory


def latest_step(directory: Path) -> int | None:
    """The step of the last complete train state in `directory`, or None if there is none."""
    path = Path(directory) / LATEST
    if not path.is_file():
        return None
    try:
        return int(json.loads(path.read_text())["step"])
    except (json.JSONDecodeError, KeyError, ValueError):
        return None


def load_train_state(directory: Path, model, optimizer, names: list[str], fingerprint: str) -> dict[str, Any] | None:
    """Restore model, optimizer and RNG from the latest state; returns its JSON (None if no state).

    Refuses (CheckpointError) a state written by a different run (model, recipe or data).
    """
    directory = Path(directory)
    if latest_step(directory) is None:
        return None
    latest = read_json(directory / LATEST)
    info = read_json(directory / latest["state"])
    if info.get("fingerprint") != fingerprint:
        raise CheckpointError(
            f"{directory} belongs to a run with a different model, recipe or data; "
            "pass force=True (--force) to discard it and start over"
        )
    tensors = read_tensors(directory / latest["tensors"])
    weights = {k[len("model/"):]: v for k, v in tensors.items() if k.startswith("model/")}
    missing = sorted(set(model_state(model)) - set(weights))
    if missing:
        raise CheckpointError(f"{directory}: train state lacks model tensors {missing[:3]}")
    with torch.no_grad():
        model.load_state_dict(weights, strict=False)
    load_optimizer_tensors(optimizer, names, tensors, info["optimizer"])
    torch.set_rng_state(tensors["rng/torch_cpu"])
    if "rng/cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng/cuda"])
    return info
