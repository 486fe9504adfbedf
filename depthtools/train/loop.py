"""Train one cell: `train_cell(model_cfg, train_cfg, data_dir, out_dir)`.

Read top to bottom: `prepare_run` builds everything a run needs (model, optimizer, batches, eval
windows) and restores `train_state/` if a previous run was interrupted; `run_steps` is the step
loop (LR from the step, forward/backward with optional gradient accumulation, clip, AdamW, logs,
evals, checkpoints); `finish` writes the finished cell. The step loop makes no host syncs except
on log/eval/checkpoint steps, and a non-finite loss or gradient, or a logged train loss more than
`divergence_margin` nats above its running minimum, is detected at the next of those
and stops the run (`TrainingDivergedError`) before any checkpoint could store it; a checkpoint saved
just before, whose weights produced those losses, is dropped (train_state rolls back to the one
before it, see `run_steps`). Such a run can
resume from its last good checkpoint with a lower LR: `train_cell(..., allow_lr_change=True)`
(`depthtools train --resume-with-changed-lr`), which records the change in config.json
(train_resolved.lr_changes) and on the first metrics record after it (lr_changed_from).

Under `torchrun` the same code runs data-parallel (`depthtools.train.distributed`): each rank trains
on its share of the step's global batch through a DDP/FSDP2 wrapper that reduces gradients on the
last micro-step only; rank 0 alone writes files. One process is the unchanged single-process path.

Outputs in out_dir (docs/design.md §5): model.safetensors + config.json (via depthtools.checkpoint.save),
metrics.jsonl (one JSON record per log step), eval.json (written last: its presence means
"finished"), and train_state/ while training (removed at the end unless keep_train_state).
heartbeat.json (host, pid, step; or the error that stopped the run) exists only until the cell is
finished; `depthtools grid status` reads it to tell running from failed cells. train.lock is held
(flock) by the one process training the cell: a second one is refused, naming the holder.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from depthtools import profiles
from depthtools.analysis.tasks import answer_accuracy
from depthtools.arch import DepthModel, compiled
from depthtools.checkpoint import (
    CONFIG,
    WEIGHTS,
    atomic_write_bytes,
    atomic_write_json,
    imported_from,
    read_json,
    read_metrics,
    save,
    weights_problem,
)
from depthtools.config import ModelConfig, TrainConfig
from depthtools.data import load_split, read_meta
from depthtools.data.budget import check_epochs, check_vocab, text_tokens_read
from depthtools.data.prepare import check_data_files
from depthtools.errors import CheckpointError, DepthToolsError
from depthtools.fsutil import (
    LockHeldError,
    acquire_lock,
    atomic_write_text,
    check_dir_target,
    json_section,
    write_error,
)
from depthtools.grid import count_params
from depthtools.train import distributed
from depthtools.train.batches import TrainBatches, eval_windows
from depthtools.train.distributed import Dist
from depthtools.train.flops import flops_per_token, peak_flops
from depthtools.train.optim import build_optimizer, depth_scaling
from depthtools.train.precision import NAMES, bf16_weights_supported, cast_params, resolve_param_dtype
from depthtools.train.probe import DepthProbe
from depthtools.train.schedule import lr_multiplier
from depthtools.train.state import (
    STATE_DIR,
    load_train_state,
    older_states,
    prune_train_state,
    remove_partial_writes,
    roll_back_train_state,
    save_train_state,
)

EVAL = "eval.json"
METRICS = "metrics.jsonl"
HEARTBEAT = "heartbeat.json"
LOCK = "train.lock"  # flock'ed while a process trains the cell (pid, host, since); see fsutil.acquire_lock
HEARTBEAT_EVERY_S = 30.0  # at most this often from the step loop (`grid status` waits 900 s on other hosts)
# Fields that change when things are logged/evaluated/saved but not the trained weights.
CADENCE_FIELDS = ("eval_every", "eval_tokens", "log_every", "depth_stats_every", "checkpoint_every",
                  "keep_train_state", "threads", "compile", "peak_flops", "parallel", "divergence_margin",
                  "max_epochs")
LR_FIELDS = ("lr", "lr_overrides")  # what --resume-with-changed-lr may change

Progress = Callable[[dict[str, Any]], None]
logger = logging.getLogger(__name__)


class TrainingDivergedError(DepthToolsError):
    """The loss or gradient became NaN/inf, or the loss rose far above its running minimum; the last
    good train_state is kept. `details` (step, loss, last good step, ...) goes into heartbeat.json."""

    def __init__(self, message: str, details: dict[str, Any] | None = None):
        super().__init__(message)
        self.details = details or {}


class CellFinishedError(DepthToolsError):
    """The cell already holds a finished run; retraining needs force=True."""


class CellLockedError(LockHeldError):
    """Another live process trains this cell (its pid, host and start time are in the message)."""


def data_location(data_dir: str | Path, out_dir: str | Path) -> dict[str, str]:
    """Where config.json says the training data is, so that probes find it from any working directory
    and after the checkpoint and data tree moves together: "path" is absolute, "path_from_checkpoint"
    is relative to the checkpoint folder (`analysis.tokens.recorded_data_dir` tries both)."""
    data_dir, out_dir = Path(data_dir).absolute(), Path(out_dir).absolute()
    location = {"path": str(data_dir)}
    try:
        location["path_from_checkpoint"] = os.path.relpath(data_dir, out_dir)
    except ValueError:  # another drive (Windows): no relative path exists
        pass
    return location


def is_finished(out_dir: str | Path) -> bool:
    """A cell is finished when eval.json exists (written after the final weights and config)."""
    return (Path(out_dir) / EVAL).is_file()


def held_checkpoint(out_dir: str | Path) -> dict[str, str] | None:
    """What a training run into `out_dir` would replace: None, or {"state": finished | imported | damaged,
    "detail": one line}. The one rule of `train`, `grid train` (every launcher) and `grid status`:

    finished: eval.json, a readable config.json, and weights whose header matches it (`weights_problem`);
    imported: config.json records a "source" (`import-hf`; no eval.json), weights matching it;
    damaged: eval.json (or an import's config.json) but weights that are missing, cut short, of a
    non-float dtype or of other names or shapes than the config, or an eval.json or config.json that
    cannot be read. None of them is trained over without force."""
    out_dir = Path(out_dir)
    config_path = out_dir / CONFIG
    config, config_problem = None, None
    if config_path.is_file():
        try:
            config = read_json(config_path)
            model = json_section(config, "model", config_path, dict, CheckpointError)
        except DepthToolsError as exc:
            config_problem = str(exc)
    provenance = imported_from(config) if config is not None else None
    if not is_finished(out_dir) and provenance is None:
        return None
    kind = "finished" if is_finished(out_dir) else "imported"
    problem = (eval_problem(out_dir / EVAL) if kind == "finished" else None) or config_problem
    if problem is None and config is None:
        problem = f"{CONFIG} is missing in {out_dir}"
    if problem is None:
        problem = weights_problem(out_dir / WEIGHTS, model)
    if problem is not None:
        return {"state": "damaged", "detail": problem}
    return {"state": kind, "detail": provenance or "finished run"}


def eval_problem(path: Path) -> str | None:
    """Why a cell's eval.json is not one `finish` wrote (None: it is): an object whose "step" is an
    integer and whose "val_loss" is a finite number or null (no validation split)."""
    try:
        evals = read_json(path)
    except DepthToolsError as exc:
        return str(exc)
    step, loss = evals.get("step"), evals.get("val_loss")
    if isinstance(step, bool) or not isinstance(step, int):
        return f"{path}: 'step' is {step!r}, not an integer (not written by the trainer)"[:300]
    if loss is not None and (isinstance(loss, bool) or not isinstance(loss, (int, float)) or not math.isfinite(loss)):
        return f"{path}: 'val_loss' is {loss!r}, not a finite number (not written by the trainer)"[:300]
    return None


# -- small pieces --------------------------------------------------------------------------------
def resolve_device(train_cfg: TrainConfig) -> torch.device:
    """'auto' = CUDA if available, else CPU; asking for CUDA without one is an error."""
    if train_cfg.device == "cuda" and not torch.cuda.is_available():
        raise DepthToolsError("device 'cuda' requested but torch sees no CUDA device; use device 'cpu' or 'auto'")
    if train_cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(train_cfg.device)


def resolve_dtype(train_cfg: TrainConfig, device: torch.device) -> torch.dtype:
    """Autocast dtype: bf16 on CUDA and float32 on CPU unless the recipe names one."""
    if train_cfg.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return torch.bfloat16 if train_cfg.dtype == "bfloat16" else torch.float32


def run_fingerprint(model_cfg: ModelConfig, train_cfg: TrainConfig, data_fingerprint: str,
                    without_lr: bool = False) -> str:
    """Hash of everything that determines the trained weights (resume refuses a different run).

    without_lr: the same hash leaving out the learning rates, so a resume with a changed LR can
    check that nothing else changed."""
    text = json.dumps(run_record(model_cfg, train_cfg, data_fingerprint, without_lr), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def run_record(model_cfg: ModelConfig, train_cfg: TrainConfig, data_fingerprint: str,
               without_lr: bool = False) -> dict[str, Any]:
    """What `run_fingerprint` hashes, as JSON: the model config, the recipe without its cadence fields
    (and learning rates, `without_lr`) and the data fingerprint. Saved with each train state, so a
    refused resume names the fields that differ (`depthtools.train.state.run_differences`)."""
    skip = CADENCE_FIELDS + (LR_FIELDS if without_lr else ())
    recipe = {k: v for k, v in train_cfg.to_dict().items() if k not in skip}
    return json.loads(json.dumps({"model": model_cfg.to_dict(), "train": recipe, "data": data_fingerprint}))


def forward_loss(model, inputs: torch.Tensor, targets: torch.Tensor, probe: DepthProbe | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy; with a probe, runs state by state so it can watch each depth."""
    if probe is None:
        logits = model(inputs)
    else:
        states = model.run_states(inputs)
        probe.watch(model, states)
        logits = model.head(states[-1])
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


class LossModule(nn.Module):
    """model + loss as one module, so DDP/FSDP see every forward (also the probe's state-by-state one)."""

    def __init__(self, model: DepthModel):
        super().__init__()
        self.model = model

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor, probe: DepthProbe | None = None) -> torch.Tensor:
        return forward_loss(self.model, inputs, targets, probe)


def _every(step: int, period: int) -> bool:
    return period > 0 and step % period == 0


@contextlib.contextmanager
def _threads(n: int | None):
    """Set torch's intra-op thread count for the run and restore it afterwards."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# -- the run -------------------------------------------------------------------------------------
@dataclass
class Run:
    """Everything one training run needs, built once by `prepare_run`."""

    model_cfg: ModelConfig
    train_cfg: TrainConfig
    out_dir: Path
    data_dir: Path
    meta: dict[str, Any]
    device: torch.device
    dtype: torch.dtype  # autocast dtype
    model: DepthModel  # compiled regions, when on, live in it (depthtools.arch.compiled)
    optimizer: torch.optim.AdamW
    param_names: list[str]
    batches: TrainBatches
    eval_sets: dict[str, torch.Tensor]  # "val" and "val_<domain>" -> windows [k, T+1]
    domains: dict[str, str]  # split key -> domain name
    total_steps: int
    peak_lr: float
    fingerprint: str
    flops_per_token: float
    peak_flops: float | None
    start_step: int = 0
    progress: Progress | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    lr_free_fingerprint: str = ""
    record: dict[str, Any] = field(default_factory=dict)  # run_record: saved with each train state
    min_train_loss: float = math.inf  # lowest logged train loss so far (carried through resumes)
    lr_changes: list[dict[str, Any]] = field(default_factory=list)  # resumes with a changed LR
    dist: Dist = field(default_factory=Dist)
    parallel: Any = None  # under torchrun: the DDP/FSDP-wrapped LossModule
    compile: dict[str, Any] = field(default_factory=dict)  # TrainConfig.compile resolved (config.json)
    profile_notes: list[str] = field(default_factory=list)  # what TrainConfig.profile does not reproduce (config.json)
    param_dtype: torch.dtype = torch.float32  # weights + AdamW state (TrainConfig.param_dtype resolved)
    param_dtype_note: str | None = None  # the line an explicit "bfloat16" without bf16 printed (config.json)

    @property
    def tokens_per_step(self) -> int:
        return self.train_cfg.batch_size * self.train_cfg.seq_len

    @property
    def name(self) -> str:
        return self.out_dir.name

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor, probe: DepthProbe | None = None) -> torch.Tensor:
        """Mean loss of one micro-batch through what runs the step: the DDP/FSDP wrapper under torchrun
        (so gradients are reduced), else the model (whose compiled regions, if any, skip hooked blocks)."""
        if self.parallel is not None:
            return self.parallel(inputs, targets, probe)
        return forward_loss(self.model, inputs, targets, probe)

    def autocast(self):
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def emit(self, event: str, **fields: Any) -> None:
        if self.progress is not None:
            self.progress({"event": event, "cell": self.name, "step": fields.pop("step", self.start_step),
                           "total_steps": self.total_steps, **fields})


def check_inputs(model_cfg: ModelConfig, train_cfg: TrainConfig, meta: dict[str, Any], data_dir: Path,
                 cell: str | None = None, warn: bool = True) -> None:
    """One-line errors for a model that cannot read this data or this sequence length (a vocabulary
    planned for another tokenizer included), and for a token budget above max_epochs of the data
    (a logged warning above one epoch when max_epochs is unset and `warn`); see depthtools.data.budget."""

    check_vocab(model_cfg.vocab_size, meta["tokenizer"], str(data_dir), cell)
    if train_cfg.seq_len > model_cfg.max_seq_len:
        raise DepthToolsError(f"seq_len={train_cfg.seq_len} exceeds the model's max_seq_len={model_cfg.max_seq_len}")

    budget = train_cfg.total_tokens(count_params(model_cfg)["total"])
    step_tokens = train_cfg.batch_size * train_cfg.seq_len
    if step_tokens > budget:  # total_steps would round up to one step far larger than the whole budget
        raise DepthToolsError(f"one step (batch_size {train_cfg.batch_size} x seq_len {train_cfg.seq_len} = "
                              f"{step_tokens:,} tokens) exceeds the whole token budget ({budget:,}); lower --seq-len "
                              "or --batch-size, or raise --tokens")
    check_epochs(text_tokens_read(train_cfg, count_params(model_cfg)["total"]), int(meta["splits"]["train"]["tokens"]),
                 train_cfg.max_epochs, str(data_dir), cell, warn=warn)


def prepare_run(model_cfg, train_cfg, data_dir, out_dir, progress, dist: Dist = Dist(),
                allow_lr_change: bool = False) -> Run:
    """Build model, optimizer, batches and eval windows; restore train_state if there is one
    (with allow_lr_change also one saved with another learning rate: the change is recorded)."""
    data_dir, out_dir = Path(data_dir), Path(out_dir)
    meta = read_meta(data_dir)
    check_inputs(model_cfg, train_cfg, meta, data_dir, out_dir.name)
    distributed.rows_per_rank(train_cfg.batch_size, train_cfg.micro_batch_size, dist)  # fail early
    device = distributed.local_device(resolve_device(train_cfg), dist)
    model = DepthModel(model_cfg, seed=train_cfg.seed).to(device)
    param_dtype, dtype_note = resolve_param_dtype(train_cfg, device)
    cast_params(model, param_dtype)  # before the optimizer: AdamW's state is created like the weights
    optimizer, names = build_optimizer(model, train_cfg, device)
    params_total = model.param_counts()["total"]
    fingerprint = run_fingerprint(model_cfg, train_cfg, meta["data_fingerprint"])
    lr_free = run_fingerprint(model_cfg, train_cfg, meta["data_fingerprint"], without_lr=True)
    record = run_record(model_cfg, train_cfg, meta["data_fingerprint"])
    info = load_train_state(out_dir / STATE_DIR, model, optimizer, names, fingerprint, lr_free, allow_lr_change,
                            record={**record, "param_dtype": NAMES[param_dtype]})
    saved_dtype = info.get("param_dtype", "float32") if info else None  # states before param_dtype: float32
    if saved_dtype is not None and saved_dtype != NAMES[param_dtype]:  # "auto" on another device
        raise CheckpointError(f"{out_dir / STATE_DIR} holds {saved_dtype} weights, but this run's param_dtype="
                              f"{train_cfg.param_dtype!r} trains {NAMES[param_dtype]} on {device.type}; resume it "
                              "where it trained that dtype, or pass force=True (--force) to start over")
    start = int(info["step"]) if info else 0
    lr_changes = list(info.get("lr_changes") or []) if info else []
    peak_lr = train_cfg.lr_for(model_cfg.arch)
    if info and info.get("fingerprint") != fingerprint:  # accepted by allow_lr_change
        lr_changes.append({"step": start, "from_lr": info.get("peak_lr"), "to_lr": peak_lr,
                           "from_lr_overrides": info.get("lr_overrides"), "to_lr_overrides": dict(train_cfg.lr_overrides)})
        logger.warning("%s: resuming from step %d with peak lr %g instead of %s (--resume-with-changed-lr)",
                       out_dir, start, peak_lr, info.get("peak_lr"))
    min_loss = info.get("min_train_loss") if info else None
    eval_sets, domains = {}, {}
    for key, split in meta["splits"].items():
        if key == "val" or "domain" in split:
            windows = eval_windows(load_split(data_dir, key), train_cfg.seq_len, train_cfg.eval_tokens)
            if windows is not None:
                eval_sets[key] = windows
                domains[key] = split.get("domain", "all")
    distributed.check_same(dist, start, "the step to resume from", device)
    total_steps = train_cfg.total_steps(params_total)
    compile_on, compile_why = compiled.decide(train_cfg.compile, model.scheme.compile_region, total_steps,
                                              train_cfg.batch_size * train_cfg.seq_len, model_cfg.n_layer,
                                              model_cfg.d_model, device)
    if compile_on == "on":  # regional: training steps of unhooked blocks compile, the rest stays eager
        compile_on = "on" if compiled.enable(model, device) else "off"
    parallel = None
    if dist.enabled:
        torch.manual_seed(distributed.rank_seed(train_cfg.seed, dist.rank, start))
        parallel = distributed.wrap(LossModule(model), dist, device)
        if dist.fsdp:  # sharding replaced the parameters: a new optimizer, holding the restored state
            full_optimizer, optimizer = optimizer, build_optimizer(model, train_cfg, device)[0]
            distributed.move_optimizer_state(full_optimizer, names, model, optimizer)
    batches = TrainBatches(load_split(data_dir, "train"), train_cfg.batch_size, train_cfg.seq_len, train_cfg.seed,
                           device, dist.rank, dist.world_size, task_mix=train_cfg.task_mix,
                           tokenizer=meta["tokenizer"]["name"])
    if batches.mixer is not None and batches.mixer.mix.curriculum is not None:
        if dist.fsdp:
            raise DepthToolsError("a task curriculum scores the model on every rank, which FSDP's sharded weights "
                                  "do not allow; train curriculum cells with DDP or on one device")
        batches.mixer.set_levels(info.get("task_levels") if info else None)
    peak = train_cfg.peak_flops or (peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None)
    notes = profile_notes(model_cfg, train_cfg, device)  # under a profile, its weights line covers dtype_note
    if train_cfg.profile not in (None, "depthtools"):
        dtype_note = None
    if dist.is_main:
        for line in notes + ([dtype_note] if dtype_note else []):
            logger.warning("%s: %s", out_dir.name, line)
    return Run(
        model_cfg=model_cfg, train_cfg=train_cfg, out_dir=out_dir, data_dir=data_dir, meta=meta, device=device,
        dtype=resolve_dtype(train_cfg, device), model=model, optimizer=optimizer,
        param_names=names, batches=batches,
        eval_sets=eval_sets, domains=domains, total_steps=total_steps,
        peak_lr=peak_lr, fingerprint=fingerprint, lr_free_fingerprint=lr_free, lr_changes=lr_changes, record=record,
        min_train_loss=float(min_loss) if isinstance(min_loss, (int, float)) else math.inf,
        flops_per_token=flops_per_token(model_cfg, params_total, train_cfg.seq_len),
        peak_flops=peak and peak * dist.world_size,  # tokens/s are the whole world's
        start_step=start, progress=progress if dist.is_main else None, dist=dist, parallel=parallel,
        compile={"setting": train_cfg.compile, "resolved": compile_on, "why": compile_why,
                 "region": model.scheme.compile_region if compile_on == "on" else None},
        profile_notes=notes, param_dtype=param_dtype, param_dtype_note=dtype_note,
    )


def profile_notes(model_cfg: ModelConfig, train_cfg: TrainConfig, device: torch.device) -> list[str]:
    """The lines a run under a recipe profile prints (and records in config.json): what the profile
    does not reproduce for this architecture, and which weights dtype it trains on this device."""

    param_dtype = NAMES[resolve_param_dtype(train_cfg, device)[0]]
    compute = "bfloat16" if param_dtype == "bfloat16" else str(resolve_dtype(train_cfg, device)).replace("torch.", "")
    weights = profiles.weights_note(train_cfg.profile, device.type, compute, bf16_weights_supported(device),
                                    param_dtype)
    return profiles.notes(train_cfg.profile, model_cfg.arch) + ([weights] if weights else [])


def set_lr(run: Run, step: int) -> float:
    """Set every group's LR for the update made at `step`; returns the peak-relative LR."""
    lr = run.peak_lr * lr_multiplier(step, run.total_steps, run.train_cfg)
    for group in run.optimizer.param_groups:
        group["lr"] = lr * group["lr_scale"]
    return lr


def train_step(run: Run, step: int, probe: DepthProbe | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer update on the batch of `step` (this rank's rows of it); returns this rank's
    (loss, grad norm) as device tensors. Gradients are reduced across ranks on the last micro-step."""
    inputs, targets = run.batches.batch(step)
    rows, micro = distributed.rows_per_rank(run.train_cfg.batch_size, run.train_cfg.micro_batch_size, run.dist)
    n_micro = rows // micro
    total = torch.zeros((), device=run.device)
    for i in range(n_micro):
        chunk = slice(i * micro, (i + 1) * micro)
        watch = probe if i == 0 else None  # depth norms from the first micro-batch
        with distributed.grad_sync(run.parallel, sync=i == n_micro - 1):
            with run.autocast():
                loss = run.loss(inputs[chunk], targets[chunk], watch)
            (loss / n_micro).backward()
        total += loss.detach() / n_micro
    distributed.reduce_replicated_grads(run.parallel, run.dist)
    params = [p for group in run.optimizer.param_groups for p in group["params"]]
    grad_norm = distributed.clip_grads(params, run.train_cfg.grad_clip, run.dist)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    return total, grad_norm


@torch.no_grad()
def evaluate(run: Run) -> dict[str, float]:
    """Mean loss on every eval split's fixed windows: {"val": ..., "<domain>": ...}."""
    out = {}
    chunk = max(1, run.train_cfg.micro_batch_size or run.train_cfg.batch_size)
    for key, windows in run.eval_sets.items():
        total, count = torch.zeros((), device=run.device, dtype=torch.float64), 0
        for start in range(0, len(windows), chunk):
            data = windows[start:start + chunk].to(run.device)
            with run.autocast():
                loss = run.loss(data[:, :-1], data[:, 1:])
            total += loss.double() * data[:, 1:].numel()
            count += data[:, 1:].numel()
        out["val" if key == "val" else run.domains[key]] = float(total / count)
    return out


def _append_metrics(run: Run, record: dict[str, Any]) -> None:
    if not run.dist.is_main:
        return
    path = run.out_dir / METRICS
    try:
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
    except OSError as exc:  # a full disk raises from write() without naming the file
        raise write_error(exc, path) from None


def _truncate_metrics(run: Run) -> None:
    """Keep only records up to the resumed step (a killed run may have logged past its checkpoint)."""
    path = run.out_dir / METRICS
    if not run.dist.is_main:
        return
    if run.start_step == 0:
        path.unlink(missing_ok=True)
        return
    kept = [r for r in read_metrics(run.out_dir) if r.get("step", 0) <= run.start_step]
    atomic_write_bytes(path, "".join(json.dumps(r) + "\n" for r in kept).encode())


def _check_finite(run: Run, bad: torch.Tensor, step: int, last_good: int) -> None:
    """Raise TrainingDivergedError if any update up to `step` saw a NaN/inf loss or gradient."""
    if bool(bad):
        where = f"{run.out_dir / STATE_DIR} (step {last_good})" if last_good else "none (no checkpoint yet)"
        raise TrainingDivergedError(
            f"{run.name}: non-finite loss or gradient by step {step} (lr {run.peak_lr:g}); training stopped, "
            f"last good checkpoint: {where}; lower the LR (lr_overrides) or check the data "
            "(resume with a lower --lr and --resume-with-changed-lr)",
            details={"reason": "non_finite", "step": step, "lr": run.peak_lr, "last_good_step": last_good or None},
        )


def _check_divergence(run: Run, mean_loss: float, step: int, last_good: int) -> None:
    """Raise TrainingDivergedError if the logged train loss is more than divergence_margin nats above
    the lowest logged train loss so far (TrainConfig documents the rule). Runs before the step's
    checkpoint; the same decision on every rank (the loss is all-reduced)."""
    margin = run.train_cfg.divergence_margin
    if not margin or not math.isfinite(run.min_train_loss):
        return
    if mean_loss > run.min_train_loss + margin:
        where = f"{run.out_dir / STATE_DIR} (step {last_good})" if last_good else "none (no checkpoint yet)"
        raise TrainingDivergedError(
            f"{run.name}: diverged: train loss {mean_loss:.4g} at step {step} is more than divergence_margin="
            f"{margin:g} nats above its lowest {run.min_train_loss:.4g} (lr {run.peak_lr:g}); training stopped, "
            f"last good checkpoint: {where}; resume it with a lower --lr and --resume-with-changed-lr",
            details={"reason": "loss_above_min", "step": step, "train_loss": mean_loss,
                     "min_train_loss": run.min_train_loss, "divergence_margin": margin, "lr": run.peak_lr,
                     "last_good_step": last_good or None},
        )


def _checkpoint(run: Run, step: int, keep: int | None = None) -> None:
    """Rank 0 writes train_state, keeping step `keep`'s pair too (under FSDP every rank first helps
    gather the full state)."""
    info = {"tokens": step * run.tokens_per_step, "total_steps": run.total_steps, "fingerprint": run.fingerprint,
            "fingerprint_without_lr": run.lr_free_fingerprint, "run": run.record, "peak_lr": run.peak_lr,
            "lr_overrides": dict(run.train_cfg.lr_overrides), "lr_changes": run.lr_changes,
            "min_train_loss": run.min_train_loss if math.isfinite(run.min_train_loss) else None,
            **({"param_dtype": NAMES[run.param_dtype]} if run.param_dtype != torch.float32 else {}),
            "data": {"seed": run.train_cfg.seed, "next_step": step, "rule": "offsets = default_rng([seed, step])"}}
    if _has_curriculum(run):
        info["task_levels"] = dict(run.batches.mixer.levels)
    model, optimizer = run.model, run.optimizer
    if run.dist.fsdp:
        model, optimizer = distributed.full_state(run.model, run.optimizer, run.param_names)
    if run.dist.is_main:
        save_train_state(run.out_dir / STATE_DIR, step, model, optimizer, run.param_names, info, keep=keep)


def write_heartbeat(out_dir: Path, **fields: Any) -> None:
    """heartbeat.json: who trains this cell (host, pid) and how far; or, with state "failed", why it stopped.

    Replaced by rename (never half a file) but not fsynced: it is a liveness hint, not a checkpoint.
    """
    record = {"state": "running", "host": socket.gethostname(), "pid": os.getpid(), "time": time.time(), **fields}
    path = Path(out_dir) / HEARTBEAT
    atomic_write_text(path, json.dumps(record) + "\n", fsync=False)


def _probe_for(cfg: TrainConfig, step: int, world_size: int = 1) -> DepthProbe | None:
    """A depth probe on every depth_stats_every-th step (and the first), else None (no overhead).

    grad_scale undoes the loss scaling of this rank's micro-batches, so gradient norms read as those
    of one micro_batch_size-row mean loss whatever the world size.
    """
    if not (_every(step, cfg.depth_stats_every) or (cfg.depth_stats_every and step == 1)):
        return None
    return DepthProbe(grad_scale=cfg.batch_size / world_size / (cfg.micro_batch_size or cfg.batch_size))


def _has_curriculum(run: Run) -> bool:
    return run.batches.mixer is not None and run.batches.mixer.mix.curriculum is not None


def _curriculum_due(run: Run, step: int) -> bool:
    return _has_curriculum(run) and _every(step, run.batches.mixer.mix.curriculum.every)


def _curriculum_step(run: Run) -> dict[str, Any]:
    """Score each task at its current level on the curriculum's held-out samples and advance the levels;
    returns the metrics fields (the levels the accuracies were measured at, and the accuracies).

    Every rank scores the same samples with the same (replicated) weights, so all ranks advance alike.
    """

    mixer = run.batches.mixer
    curriculum = mixer.mix.curriculum
    with run.autocast():
        accuracy = {t: answer_accuracy(run.model, curriculum.held_out(t, k, run.train_cfg.seed))
                    for t, k in mixer.levels.items()}
    fields = {**{f"task_level_{t}": k for t, k in mixer.levels.items()},
              **{f"task_acc_{t}": a for t, a in accuracy.items()}}
    mixer.levels = curriculum.advance(mixer.levels, accuracy, mixer.mix.k_max)
    return fields


def _record(run: Run, step: int, lr: float, mean_loss: float, grad_norm: torch.Tensor, tokens_per_s: float | None,
            probe: DepthProbe | None, do_eval: bool) -> dict[str, Any]:
    """One metrics.jsonl record (evaluates on every val split when do_eval)."""
    record = {"step": step, "tokens": step * run.tokens_per_step, "lr": lr, "train_loss": mean_loss,
              "grad_norm": float(grad_norm), "tokens_per_s": tokens_per_s}
    if run.peak_flops and tokens_per_s:
        record["mfu"] = run.flops_per_token * tokens_per_s / run.peak_flops
    if probe is not None:
        record.update(probe.record())
    if do_eval:
        losses = evaluate(run)
        record["val_loss"] = losses.pop("val", None)
        record.update({f"val_loss_{domain}": value for domain, value in losses.items()})
    return record


def run_steps(run: Run) -> dict[str, Any]:
    """The step loop from run.start_step to total_steps; returns the last metrics record.

    `step` counts updates done (1..total); the update at `step` uses the batch and LR of step-1.
    Host syncs happen only on log/eval/probe/checkpoint steps; the step 1 is always logged.

    A checkpoint holds the weights after its step's update, which no logged loss has seen yet; it is
    vouched for by the next logged window (its losses are computed with those weights). Until then
    the previous vouched-for state is kept beside it, and a run stopped for divergence at that next
    log step rolls train_state back to it. A resumed state counts as vouched for unless an older
    pair is still there (it was saved while that one was the good one).
    """
    cfg = run.train_cfg
    bad = torch.zeros((), dtype=torch.bool, device=run.device)
    loss_sum, loss_count, record = torch.zeros((), device=run.device), 0, {}
    lr_noted = False
    state_dir = run.out_dir / STATE_DIR
    older = older_states(state_dir, run.start_step) if run.start_step else []
    good, pending = (older[0], run.start_step) if older else (run.start_step or None, None)
    clock, clock_tokens, beat = time.perf_counter(), 0, time.monotonic()
    for step in range(run.start_step + 1, run.total_steps + 1):
        lr = set_lr(run, step - 1)
        probe = _probe_for(cfg, step, run.dist.world_size)
        loss, grad_norm = train_step(run, step - 1, probe)
        bad |= ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
        loss_sum += loss
        loss_count += 1
        clock_tokens += run.tokens_per_step
        last, save_now = step == run.total_steps, _every(step, cfg.checkpoint_every)
        do_eval = _every(step, cfg.eval_every) or last
        curriculum_now = _curriculum_due(run, step)
        if not (_every(step, cfg.log_every) or last or step == 1 or do_eval or probe or save_now or curriculum_now):
            continue
        loss_all, bad_all = distributed.reduce_log(run.dist, loss_sum, bad)  # identity in one process
        mean_loss = float(loss_all) / loss_count
        try:
            _check_finite(run, bad_all, step, good or 0)
            _check_divergence(run, mean_loss, step, good or 0)
        except TrainingDivergedError:
            if pending is not None and run.dist.is_main:  # its weights produced these losses: not good
                roll_back_train_state(state_dir, good, pending)
            raise
        if pending is not None:  # the window after checkpoint `pending` passed: its weights are good
            if run.dist.is_main:
                prune_train_state(state_dir, pending)
            good, pending = pending, None
        run.min_train_loss = min(run.min_train_loss, mean_loss)
        elapsed = time.perf_counter() - clock
        record = _record(run, step, lr, mean_loss, grad_norm,
                         clock_tokens / elapsed if elapsed > 0 else None, probe, do_eval)
        if curriculum_now:  # after the record's losses, before the checkpoint (which saves the new levels)
            record.update(_curriculum_step(run))
        if run.lr_changes and run.lr_changes[-1]["step"] == run.start_step and not lr_noted:
            record["lr_changed_from"] = run.lr_changes[-1]["from_lr"]  # the first record after the change
            lr_noted = True
        _append_metrics(run, record)
        if run.dist.is_main and time.monotonic() - beat >= HEARTBEAT_EVERY_S:
            write_heartbeat(run.out_dir, step=step, total_steps=run.total_steps, world_size=run.dist.world_size)
            beat = time.monotonic()
        run.emit("step", step=step, tokens=record["tokens"], train_loss=record["train_loss"],
                 val_loss=record.get("val_loss"), tokens_per_s=record["tokens_per_s"])
        if save_now and not last:
            _checkpoint(run, step, keep=good)
            pending = step
        loss_sum, loss_count = torch.zeros((), device=run.device), 0
        clock, clock_tokens = time.perf_counter(), 0
    return record


def _carry_tokenizer(run: Run) -> None:
    """Copy a trained tokenizer's file (BPE tokenizer.json) from the data folder into the cell, so
    the cell still decodes and exports after the data folder is moved or deleted (the byte
    tokenizer needs no file: its name defines it). The checkpoint's fingerprint still vouches for it."""
    record = run.meta["tokenizer"]
    name = record.get("file")
    if record.get("name") == "byte" or not name:
        return
    source = run.data_dir / name
    if source.is_file():
        atomic_write_bytes(run.out_dir / name, source.read_bytes())


def finish(run: Run, last: dict[str, Any], elapsed: float) -> dict[str, Any]:
    """Write model.safetensors + config.json, then eval.json (the "finished" marker); drop train_state."""
    cfg, meta = run.train_cfg, run.meta
    scaling = depth_scaling(run.model_cfg)
    extra = {
        "train": cfg.to_dict(),
        "train_resolved": {
            "lr": run.peak_lr, "lr_overridden": run.model_cfg.arch in cfg.lr_overrides,
            "total_steps": run.total_steps, "total_tokens": run.total_steps * run.tokens_per_step,
            "device": run.device.type, "dtype": str(run.dtype).replace("torch.", ""),
            "depth_scaling": None if scaling is None else {"block_lr_factor": scaling[0], "block_eps_factor": scaling[1]},
            "flops_per_token": run.flops_per_token, "elapsed_s": elapsed, "world_size": run.dist.world_size,
            "compile": run.compile,
            **({"lr_changes": run.lr_changes} if run.lr_changes else {}),
            **({"profile_notes": run.profile_notes} if run.profile_notes else {}),
            **({"param_dtype": NAMES[run.param_dtype]} if cfg.param_dtype != "float32" else {}),
            **({"param_dtype_note": run.param_dtype_note} if run.param_dtype_note else {}),
            **({"task_levels": dict(run.batches.mixer.levels)} if _has_curriculum(run) else {}),
        },
        "tokenizer": meta["tokenizer"],
        "data": {"name": meta.get("name"), **data_location(run.data_dir, run.out_dir),
                 "data_fingerprint": meta["data_fingerprint"], "settings": meta.get("settings"),
                 "domains": meta.get("domains")},
    }
    model = _plain_model(run)
    domains = {k: v for k, v in last.items() if k.startswith("val_loss_")}
    result = {"step": last["step"], "tokens": last["tokens"], "val_loss": last.get("val_loss"),
              "domains": {k[len("val_loss_"):]: v for k, v in domains.items()}, "train_loss": last["train_loss"],
              "eval_tokens_per_split": {k: int(w[:, 1:].numel()) for k, w in run.eval_sets.items()}}
    if _has_curriculum(run):  # the levels reached (a level is solved when its accuracy passed the threshold)
        result["task_levels"] = dict(run.batches.mixer.levels)
    if not run.dist.is_main:
        return result
    _carry_tokenizer(run)
    save(model, run.out_dir, extra=extra)
    atomic_write_json(run.out_dir / EVAL, result)
    if not cfg.keep_train_state:
        shutil.rmtree(run.out_dir / STATE_DIR, ignore_errors=True)
    (run.out_dir / HEARTBEAT).unlink(missing_ok=True)
    return result


def _plain_model(run: Run) -> DepthModel | None:
    """The trained model as a plain module to save: itself, or under FSDP one rebuilt from the gathered
    weights (collective; rank 0 gets the model, other ranks None)."""
    if not run.dist.fsdp:
        return run.model
    weights = distributed.full_weights(run.model)
    if not run.dist.is_main:
        return None
    with torch.device("meta"):
        model = DepthModel(run.model_cfg)
    model.load_state_dict(weights, assign=True)
    return model


def tidy_finished(out_dir: str | Path) -> list[str]:
    """Remove what only an unfinished run needs from a finished cell: train_state/ (unless its recipe
    asked to keep it) and heartbeat.json. `finish` removes both after writing eval.json, so they are
    left only by a kill between those writes; every later run that finds the cell finished calls this.
    Skipped while another process holds the cell's lock (a --force retrain). Returns what it removed."""
    out_dir = Path(out_dir)
    if not is_finished(out_dir):
        return []
    leftovers = [p for p in (out_dir / STATE_DIR, out_dir / HEARTBEAT) if p.exists()]
    if not leftovers:
        return []
    try:
        lock = acquire_lock(out_dir / LOCK, f"cell {out_dir}")
    except (LockHeldError, OSError):
        return []
    try:
        if not is_finished(out_dir):
            return []
        try:
            config = json.loads((out_dir / CONFIG).read_text())
            keep = bool(config["train"]["keep_train_state"])
        except (OSError, ValueError, KeyError, TypeError, RecursionError):
            keep = False
        removed = []
        for path in leftovers:
            if path.name == STATE_DIR and keep:
                continue
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
            removed.append(path.name)
        if removed:
            logger.info("%s: finished; removed leftover %s", out_dir, ", ".join(removed))
        return removed
    finally:
        lock.release()


def refuse_held(out_dir: Path) -> None:
    """CellFinishedError, in one line, when `out_dir` holds a checkpoint a run would replace
    (`held_checkpoint`: a finished run, an imported model, or a damaged one of them); a finished cell
    first loses what a kill in its final writes left (`tidy_finished`)."""
    held = held_checkpoint(out_dir)
    if held is None:
        return
    if held["state"] == "finished":
        tidy_finished(out_dir)
        raise CellFinishedError(f"{out_dir} already holds a finished run; pass force=True (--force) to retrain it")
    if held["state"] == "imported":
        raise CellFinishedError(f"{out_dir} holds a model {held['detail']}; training would replace it: choose another "
                                "--out, or pass force=True (--force) to replace it")
    raise CellFinishedError(f"{out_dir} holds a damaged checkpoint ({held['detail']}); pass force=True (--force) "
                            "to retrain it")


def clear_cell(out_dir: Path) -> None:
    """Remove a previous run's outputs (for force=True), and an imported model's tokenizer and generation
    files (a trained model must not sit beside another model's tokenizer); other files are left alone."""
    try:
        imported = imported_from(read_json(out_dir / CONFIG)) is not None
    except DepthToolsError:
        imported = False
    if imported:
        from depthtools.interop.tokenizer import HF_CARRIED_FILES  # lazy: only a forced run over an import needs it

        for name in HF_CARRIED_FILES:
            (out_dir / name).unlink(missing_ok=True)
    for name in (EVAL, WEIGHTS, CONFIG, METRICS, HEARTBEAT):
        (out_dir / name).unlink(missing_ok=True)
    shutil.rmtree(out_dir / STATE_DIR, ignore_errors=True)


def train_cell(model_cfg: ModelConfig, train_cfg: TrainConfig, data_dir: str | Path, out_dir: str | Path,
               force: bool = False, progress: Progress | None = None, allow_lr_change: bool = False) -> dict[str, Any]:
    """Train one model to its token budget and write a finished cell into `out_dir`; returns a summary.

    Resumes from `out_dir/train_state` when an earlier run was interrupted (bit-identical on CPU).
    A finished cell raises CellFinishedError unless force=True, which retrains from scratch (and
    also discards an interrupted run's state). NaN/inf, or a loss far above its running minimum
    (TrainConfig.divergence_margin), stops the run with TrainingDivergedError; allow_lr_change lets such
    a run (any interrupted run) resume from its train_state with another learning rate, recorded in
    config.json (train_resolved.lr_changes); anything else changed is still refused.
    Under torchrun (WORLD_SIZE > 1) every rank calls this: it joins the process group, trains its
    share of each batch, and leaves the group after a final barrier; only rank 0 writes.
    """
    out_dir = Path(out_dir)
    check_dir_target(out_dir, "cell folder (--out)")
    if not force:
        refuse_held(out_dir)
    # refuse unusable inputs before the cell folder, its lock or a heartbeat exist: a refused start writes nothing
    meta = read_meta(Path(data_dir))
    check_inputs(model_cfg, train_cfg, meta, Path(data_dir), out_dir.name, warn=False)
    check_data_files(data_dir, meta)  # what the run reads is what the data fingerprint vouches for (files unchanged
    # since their last match, by stat key, are not re-read: depthtools.data.digest_cache)
    dist = distributed.setup(resolve_device(train_cfg).type, train_cfg.parallel)  # torchrun: join the group
    ok, lock = False, None
    try:
        if dist.is_main:
            out_dir.mkdir(parents=True, exist_ok=True)
            lock = acquire_lock(out_dir / LOCK, f"cell {out_dir}", error=CellLockedError, log=logger.warning)
            if not force:  # finished by the process that held the lock a moment ago
                refuse_held(out_dir)
            if force:
                clear_cell(out_dir)
            remove_partial_writes(out_dir / STATE_DIR)  # a kill inside a checkpoint write left them
        distributed.barrier(dist)
        summary = _train(model_cfg, train_cfg, data_dir, out_dir, progress, dist, allow_lr_change)
        ok = True
        return summary
    except BaseException as exc:
        # a refused start leaves the cell (and the heartbeat of the process training it) alone
        if dist.is_main and lock is not None and not isinstance(exc, CellFinishedError):
            details = getattr(exc, "details", None) if isinstance(exc, TrainingDivergedError) else None
            try:  # best effort: a full or read-only disk must not hide the error that stopped the run
                write_heartbeat(out_dir, state="failed", error=f"{type(exc).__name__}: {exc}"[:2000],
                                **({"diverged": details} if details else {}))
            except OSError:
                pass
        raise
    finally:
        if lock is not None:
            lock.release()
        distributed.teardown(dist, ok)


def _train(model_cfg: ModelConfig, train_cfg: TrainConfig, data_dir, out_dir: Path, progress: Progress | None,
           dist: Dist, allow_lr_change: bool = False) -> dict[str, Any]:
    """The body of `train_cell` once the folder is ready: prepare, step loop, finish, summary."""
    t0 = time.perf_counter()
    with _threads(train_cfg.threads):
        run = prepare_run(model_cfg, train_cfg, data_dir, out_dir, progress, dist, allow_lr_change)
        _truncate_metrics(run)
        if dist.is_main:
            write_heartbeat(out_dir, step=run.start_step, total_steps=run.total_steps, world_size=dist.world_size)
        run.emit("start", tokens=run.start_step * run.tokens_per_step)
        last = run_steps(run)
        result = finish(run, last, time.perf_counter() - t0)
    elapsed = time.perf_counter() - t0
    summary = {"name": run.name, "out_dir": str(out_dir), "arch": model_cfg.arch, "n_layer": model_cfg.n_layer,
               "d_model": model_cfg.d_model, "params": run.model.param_counts()["total"], "steps": run.total_steps,
               "tokens": run.total_steps * run.tokens_per_step, "resumed_from": run.start_step,
               "train_loss": result["train_loss"], "val_loss": result["val_loss"], "domains": result["domains"],
               "elapsed_s": elapsed, "skipped": False}
    run.emit("done", step=run.total_steps, tokens=summary["tokens"], val_loss=summary["val_loss"])
    return summary


__all__ = ["CellFinishedError", "CellLockedError", "TrainingDivergedError", "held_checkpoint", "is_finished",
           "tidy_finished", "train_cell", "write_heartbeat"]
