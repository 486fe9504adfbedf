"""Serial-computation probes: accuracy, answer loss and logit-lens depth per task and k (issue 9).

    df = task_eval(model, tasks=("chase", "s5", "add"), ks=range(1, 9), n=200)   # tidy long table
    reached = depth_reached(df, threshold=0.9)                                  # largest k solved
    df, reached = evaluate_grid("checkpoints/tiny")                             # every cell, saved

Per (task, k), on `n` fresh samples (`depthtools.data.tasks.generate`, seed `seed`), each read as
``[sep] + prompt + answer + "\\n"`` (the separator, id 0, is how a sample sits in the training stream):

    accuracy              exact match, teacher-forced: the argmax at every answer position and at the
                          "\\n" after it equals the target. With the prefix always correct this is exactly
                          what greedy decoding would emit (answer, then stop) — same number, one forward pass
                          instead of one per answer token.
    answer_loss           mean next-token cross-entropy over the answer tokens (nats; the end marker excluded).
    lens_first_depth      logit lens (`model.head` on z_l: unembed(final_hidden(z_l))):
                          per sample the first depth l in 0..L whose argmax matches all answer tokens,
                          averaged over the samples the model answers correctly at l = L (NaN if none).
    lens_first_rel_depth  the same over L (comparable across the depths of an iso-parameter grid).
    n_samples             samples evaluated (for binomial confidence intervals).

`in_train_range` is True where the checkpoint's `train.task_mix` covered (task, k); k beyond it measures
length generalisation. A k whose samples do not fit the model's context is left out with a note
(`df.attrs["notes"]`). `depth_reached` gives, per model and task, the largest k such that every evaluated
k' <= k has accuracy >= threshold ("computational depth reached"; 0 if the smallest k already fails).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

from depthtools.analysis.lens import model_fingerprint
from depthtools.analysis.tables import checkpoint_dirs, load_table, model_columns, save_table
from depthtools.checkpoint import CONFIG, load, read_json
from depthtools.data.tasks import TASKS, TaskMix, TaskSample, check_k, generate, parse_k, parse_tasks
from depthtools.errors import DepthToolsError

EVAL_TABLE = "tasks_eval"
DEPTH_TABLE = "tasks_depth_reached"
COLUMNS = ("model", "arch", "n_layer", "d_model", "task", "k", "metric", "value", "in_train_range")
DEPTH_COLUMNS = ("model", "arch", "n_layer", "d_model", "task", "threshold", "depth_reached", "k_max_evaluated")
METRICS = ("accuracy", "answer_loss", "lens_first_depth", "lens_first_rel_depth", "n_samples")
SEPARATOR = 0
DEFAULT_KS = tuple(range(1, 9))


# -- the evaluation pass -------------------------------------------------------------------------
def _encode(samples: Sequence[TaskSample]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Right-padded ids [N, T] (``sep + text``) and each sample's answer span in those ids."""
    ids = [np.concatenate([[SEPARATOR], s.tokens()]) for s in samples]
    out = torch.full((len(ids), max(len(x) for x in ids)), SEPARATOR, dtype=torch.long)
    for i, x in enumerate(ids):
        out[i, :len(x)] = torch.from_numpy(x.astype(np.int64))
    return out, [(s.answer_start + 1, s.answer_end + 1) for s in samples]


@torch.no_grad()
def _score_batch(model, ids: torch.Tensor, spans: list[tuple[int, int]]) -> dict[str, np.ndarray]:
    """Per sample: exact match (answer + end), answer CE sum and count, and the lens' first matching depth.

    Runs one depth at a time (run_states one step from the cached state), so only the current state and
    the gathered answer rows are held, never [L, B, T, V].
    """
    device = next(model.parameters()).device
    ids = ids.to(device)
    n = len(spans)
    sample = torch.tensor([i for i, (a, b) in enumerate(spans) for _ in range(a, b)], device=device)
    target_pos = torch.tensor([p for a, b in spans for p in range(a, b)], device=device)
    end_sample = torch.arange(n, device=device)
    end_pos = torch.tensor([b for _, b in spans], device=device)  # the "\n" after the answer
    n_answer = torch.bincount(sample, minlength=n)
    first = torch.full((n,), -1, dtype=torch.long, device=device)

    def head_rows(state, rows, positions) -> torch.Tensor:
        """model.head(state) at (rows, positions) only: final_hidden (the lens of every scheme, HC/mHC
        readout "normed_sum" included), gathered, then unembedded (and soft-capped where the model is)."""
        hidden = model.scheme.final_hidden(state, model.ln_final)[rows, positions]
        return model.hidden_logits(hidden)

    def answer_logits(state) -> torch.Tensor:
        logits = head_rows(state, sample, target_pos - 1)  # logits at t predict token t+1
        return logits.to(torch.promote_types(logits.dtype, torch.float32))  # at least fp32 (bf16 models)

    state = model.embed(ids[:, :-1])  # the last token is only ever a target: a sample fits a row of seq_len+1
    for depth in range(model.n_layer + 1):
        if depth:
            state = model.run_states(from_state=state, start=depth - 1, stop=depth)[-1]
        logits = answer_logits(state)
        hits = torch.zeros(n, dtype=torch.long, device=device).index_add_(
            0, sample, (logits.argmax(-1) == ids[sample, target_pos]).long())
        first = torch.where((first < 0) & (hits == n_answer), torch.full_like(first, depth), first)
    ce = F.cross_entropy(logits, ids[sample, target_pos], reduction="none")
    ce_sum = torch.zeros(n, dtype=torch.float64, device=device).index_add_(0, sample, ce.double())
    end_ok = head_rows(state, end_sample, end_pos - 1).argmax(-1) == ids[end_sample, end_pos]
    answer_ok = hits == n_answer  # at depth L
    return {"correct": (answer_ok & end_ok).cpu().numpy(), "answer_ok": answer_ok.cpu().numpy(),
            "ce_sum": ce_sum.cpu().numpy(), "n_answer": n_answer.cpu().numpy(), "first": first.cpu().numpy()}


@torch.no_grad()
def answer_accuracy(model, samples: Sequence[TaskSample], batch_size: int = 64) -> float:
    """Exact-match accuracy (answer + end marker, teacher-forced argmax) of the full model on `samples`.

    The same criterion as task_eval's "accuracy", without the per-depth lens pass: one forward per
    batch. The trainer's curriculum uses it; the model's train/eval mode is restored.
    """
    if not samples:
        raise DepthToolsError("answer_accuracy needs at least one sample")
    was_training = model.training
    model.eval()
    correct = 0
    try:
        device = next(model.parameters()).device
        for start in range(0, len(samples), batch_size):
            ids, spans = _encode(samples[start:start + batch_size])
            ids = ids.to(device)
            predicted = model(ids[:, :-1]).argmax(-1)  # [N, T-1]: predicted[:, t] is the guess for ids[:, t+1]
            for i, (a, b) in enumerate(spans):
                correct += bool((predicted[i, a - 1:b] == ids[i, a:b + 1]).all())
    finally:
        model.train(was_training)
    return correct / len(samples)


def _check_byte_model(model) -> None:
    if model.config.vocab_size < 256:
        raise DepthToolsError(f"task probes are byte-level: the model's vocab_size {model.config.vocab_size} < 256")
    tokenizer = _recorded(model, "tokenizer")
    name = tokenizer.get("name") if isinstance(tokenizer, dict) else None
    if name not in (None, "byte"):
        raise DepthToolsError(f"task probes are byte-level, but {Path(model.checkpoint_dir).name} was trained with "
                              f"the {name!r} tokenizer")


def _recorded(model, key: str) -> Any:
    """A section of the checkpoint's config.json (None for an in-memory model)."""
    directory = getattr(model, "checkpoint_dir", None)
    if directory is None or not (Path(directory) / CONFIG).is_file():
        return None
    return read_json(Path(directory) / CONFIG).get(key)


def recorded_task_mix(model) -> TaskMix | None:
    """The task mix the checkpoint was trained with (config.json train.task_mix), or None."""
    train = _recorded(model, "train")
    value = train.get("task_mix") if isinstance(train, dict) else None
    return None if value is None else TaskMix.from_value(value)


def task_eval(
    model,
    tasks: str | Iterable[str] | None = None,
    ks: str | int | Iterable[int] = DEFAULT_KS,
    n: int = 200,
    seed: int = 0,
    batch_size: int = 64,
    train_mix: TaskMix | dict | None | str = "recorded",
) -> pd.DataFrame:
    """Tidy table (COLUMNS) of accuracy, answer loss and lens depth per task and k for one model.

    `train_mix` decides `in_train_range`: "recorded" reads the checkpoint's train.task_mix; None means the
    model saw no tasks (every k out of range).
    """
    tasks, ks = parse_tasks(tasks), parse_k(ks)
    if n < 1 or batch_size < 1:
        raise DepthToolsError(f"n and batch_size must be >= 1, got n={n}, batch_size={batch_size}")
    for task in tasks:
        for k in ks:
            check_k(task, k)
    _check_byte_model(model)
    mix = recorded_task_mix(model) if isinstance(train_mix, str) and train_mix == "recorded" else (
        None if train_mix is None else TaskMix.from_value(train_mix))
    ids_cols, L = model_columns(model), model.n_layer
    rows, notes = [], []
    was_training = model.training
    model.eval()
    try:
        for task in tasks:
            for k in ks:
                samples = generate(task, k, n, seed)
                longest = max(len(s.text) for s in samples)  # separator + text, less the last token (a target only)
                if longest > model.config.max_seq_len:
                    notes.append(f"{task} k={k} left out: samples need {longest} tokens, the context is "
                                 f"{model.config.max_seq_len}")
                    continue
                parts = []
                for start in range(0, n, batch_size):
                    chunk = samples[start:start + batch_size]
                    parts.append(_score_batch(model, *_encode(chunk)))
                got = {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}
                solved = got["answer_ok"]
                first = got["first"][solved].astype(float)
                values = {
                    "accuracy": float(got["correct"].mean()),
                    "answer_loss": float(got["ce_sum"].sum() / got["n_answer"].sum()),
                    "lens_first_depth": float(first.mean()) if len(first) else math.nan,
                    "lens_first_rel_depth": float(first.mean() / L) if len(first) else math.nan,
                    "n_samples": float(n),
                }
                inside = bool(mix is not None and mix.covers(task, k))
                rows += [{**ids_cols, "task": task, "k": k, "metric": m, "value": values[m], "in_train_range": inside}
                         for m in METRICS]
    finally:
        model.train(was_training)
    df = pd.DataFrame(rows, columns=list(COLUMNS)).astype({"k": "int64", "value": "float64", "in_train_range": bool})
    df.attrs["notes"] = notes
    return df


def depth_reached(df: pd.DataFrame, threshold: float = 0.9) -> pd.DataFrame:
    """Per model and task: the largest k with accuracy >= threshold at every evaluated k' <= k (0: none)."""
    if not 0 < threshold <= 1:
        raise DepthToolsError(f"threshold must lie in (0, 1], got {threshold}")
    acc = df[df["metric"] == "accuracy"].sort_values("k")
    rows = []
    for (model, arch, n_layer, d_model, task), group in acc.groupby(["model", "arch", "n_layer", "d_model", "task"],
                                                                     sort=False):
        reached = 0
        for k, value in zip(group["k"], group["value"]):
            if value < threshold:
                break
            reached = int(k)
        rows.append({"model": model, "arch": arch, "n_layer": n_layer, "d_model": d_model, "task": task,
                     "threshold": float(threshold), "depth_reached": reached,
                     "k_max_evaluated": int(group["k"].max())})
    return pd.DataFrame(rows, columns=list(DEPTH_COLUMNS))


# -- checkpoints and grids -----------------------------------------------------------------------
def eval_settings(model, tasks, ks, n: int, seed: int) -> dict[str, Any]:
    """What a saved tasks_eval table depends on: the probe set and the weights (not the batch size)."""
    return {"analysis": EVAL_TABLE, "tasks": list(parse_tasks(tasks)), "ks": parse_k(ks), "n": n, "seed": seed,
            "exact_match": "teacher-forced argmax over answer + end marker", "model": model_fingerprint(model)}


def evaluate_checkpoint(
    model, tasks=None, ks=DEFAULT_KS, n: int = 200, seed: int = 0, threshold: float = 0.9, batch_size: int = 64,
    save: bool = True, force: bool = False,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(tasks_eval, tasks_depth_reached) for one loaded checkpoint; saved beside it when `save`.

    A tasks_eval table already saved with the same settings (incl. the weight hash) is reused unless `force`.
    """
    directory = getattr(model, "checkpoint_dir", None)
    settings = eval_settings(model, tasks, ks, n, seed)
    df = None if (force or directory is None) else load_table(directory, EVAL_TABLE, settings)
    if df is not None:  # reused: restate which k did not fit the context
        have = set(zip(df["task"], df["k"]))
        df.attrs["notes"] = [f"{t} k={k} left out: samples exceed the context {model.config.max_seq_len}"
                             for t in settings["tasks"] for k in settings["ks"] if (t, k) not in have]
    else:
        df = task_eval(model, tasks, ks, n=n, seed=seed, batch_size=batch_size)
        if save and directory is not None:
            save_table(df, directory, EVAL_TABLE, settings)
    reached = depth_reached(df, threshold)
    reached_settings = {**settings, "threshold": threshold}
    if save and directory is not None and (force or load_table(directory, DEPTH_TABLE, reached_settings) is None):
        save_table(reached, directory, DEPTH_TABLE, reached_settings)
    return df, reached


def evaluate_grid(
    grid: str | Path, tasks=None, ks=DEFAULT_KS, n: int = 200, seed: int = 0, threshold: float = 0.9,
    batch_size: int = 64, save: bool = True, force: bool = False,
    progress: Callable[[str, int, int], None] | None = None,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Every checkpoint of a grid: per-cell tables beside each cell and the concatenation under <grid>/analysis/."""
    tasks, ks = parse_tasks(tasks), parse_k(ks)
    dirs = checkpoint_dirs(grid)
    frames, summaries, notes = [], [], []
    for i, ckpt_dir in enumerate(dirs):
        if progress is not None:
            progress(ckpt_dir.name, i, len(dirs))
        df, reached = evaluate_checkpoint(load(ckpt_dir), tasks, ks, n=n, seed=seed, threshold=threshold,
                                          batch_size=batch_size, save=save, force=force)
        frames.append(df)
        summaries.append(reached)
        notes += [f"{ckpt_dir.name}: {note}" for note in df.attrs.get("notes", [])]
    if progress is not None:
        progress("done", len(dirs), len(dirs))
    df = pd.concat(frames, ignore_index=True)
    reached = pd.concat(summaries, ignore_index=True)
    df.attrs["notes"] = notes
    if save:
        settings = {"analysis": EVAL_TABLE, "tasks": list(tasks), "ks": ks, "n": n, "seed": seed,
                    "checkpoints": [d.name for d in dirs]}
        save_table(df, grid, EVAL_TABLE, settings)
        save_table(reached, grid, DEPTH_TABLE, {**settings, "threshold": threshold})
    return df, reached


def wide(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (model, task, k) with a column per metric (for printing)."""
    keys = ["model", "arch", "n_layer", "d_model", "task", "k", "in_train_range"]
    out = df.pivot(index=keys, columns="metric", values="value").reset_index()
    out.columns.name = None
    order = {t: i for i, t in enumerate(TASKS)}
    return out.sort_values(["n_layer", "model", "task", "k"], key=lambda c: c.map(order) if c.name == "task" else c)


__all__ = [
    "COLUMNS", "DEPTH_COLUMNS", "DEPTH_TABLE", "EVAL_TABLE", "METRICS", "answer_accuracy", "depth_reached", "eval_settings",
    "evaluate_checkpoint", "evaluate_grid", "recorded_task_mix", "task_eval", "wide",
]
