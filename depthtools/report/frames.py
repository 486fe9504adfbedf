"""Tidy frames the report figures and tables need, assembled from saved tables (never recomputed).

Each function takes the `CellData` read by `depthtools.report.data` and returns a plain DataFrame
with the identity columns (model, arch, n_layer, d_model, seed) first, plus, where a cell lacks the
input, the names of the cells left out (so captions can say what is not shown).
"""

from __future__ import annotations

from typing import Iterable, Sequence

import pandas as pd

from depthtools.analysis.seeds import seed_means, with_seed
from depthtools.report.data import CellData, finite

ID = ["model", "arch", "n_layer", "d_model", "seed"]


def concat(frames: Iterable[pd.DataFrame | None]) -> pd.DataFrame:
    """Row-concatenate the non-empty frames (an empty frame when none)."""
    frames = [f for f in frames if f is not None and len(f)]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def table_of(cells: Sequence[CellData], name: str) -> tuple[pd.DataFrame, list[str]]:
    """One saved table over all cells, and the cells that lack it."""
    present = [c.table(name) for c in cells]
    return concat(present), [c.name for c, t in zip(cells, present) if t is None]


# -- training and evaluation ---------------------------------------------------------------------

def domain_losses(evaluation: dict | None) -> dict[str, float]:
    """Per-domain final losses from eval.json ({'domains': {...}} or flat val_<domain> keys)."""
    if not evaluation:
        return {}
    out = {str(k): float(v) for k, v in (evaluation.get("domains") or {}).items() if finite(v)}
    for key, value in evaluation.items():
        for prefix in ("val_loss_", "val_"):
            if key.startswith(prefix) and key != "val_loss" and finite(value):
                out.setdefault(key[len(prefix):], float(value))
                break
    return out


def val_loss(evaluation: dict | None) -> float:
    """The overall final val loss of eval.json (NaN when absent)."""
    if not evaluation:
        return float("nan")
    value = evaluation.get("val_loss", evaluation.get("val"))
    return float(value) if finite(value) else float("nan")


def cells_frame(cells: Sequence[CellData]) -> pd.DataFrame:
    """One row per cell: shape, parameters, training tokens, final train/val loss, per-domain losses."""
    rows = []
    for c in cells:
        params = c.config.get("params") or {}
        ev = c.eval or {}
        row = {**c.info(), "d_over_L": c.d_model / c.n_layer if c.n_layer else float("nan"),
               "params": params.get("total"), "tokens": ev.get("tokens"),
               "train_loss": ev.get("train_loss"), "val_loss": val_loss(c.eval)}
        row.update({f"val_{d}": v for d, v in sorted(domain_losses(c.eval).items())})
        rows.append(row)
    return pd.DataFrame(rows)


def domain_frame(cells: Sequence[CellData]) -> pd.DataFrame:
    """Long table: one row per cell × domain with the final loss (overall val loss as domain 'all')."""
    rows = []
    for c in cells:
        losses = domain_losses(c.eval)
        overall = val_loss(c.eval)
        if finite(overall) and set(losses) != {"all"}:
            rows.append({**c.info(), "domain": "all (val)", "loss": overall})
        rows += [{**c.info(), "domain": d, "loss": v} for d, v in losses.items()]
    return pd.DataFrame(rows)


def provenance_frame(cells: Sequence[CellData]) -> pd.DataFrame:
    """One row per imported cell: source format and path, the weights' hashes (or GGUF quantization),
    and the tokenizer it carries with its document separator (config.json "source" and "tokenizer")."""
    rows = []
    for c in cells:
        source = c.config.get("source") if isinstance(c.config.get("source"), dict) else {}
        tokenizer = c.config.get("tokenizer") if isinstance(c.config.get("tokenizer"), dict) else {}
        weights = source.get("gguf_sha256") or ", ".join(
            f"{name} {str(digest)[:12]}" for name, digest in (source.get("weights_sha256") or {}).items())
        sep = tokenizer.get("sep_token") or tokenizer.get("sep_id")
        carried = (tokenizer.get("file") or "vocabulary only (no tokenizer file)") if tokenizer else "none"
        rows.append({"model": c.name, "format": source.get("format"), "source": source.get("path"),
                     "weights": weights or None, "quantization": ", ".join(source.get("quantization") or []) or None,
                     "tokenizer": carried, "separator": None if sep is None else str(sep),
                     "imported by": c.config.get("depthtools_version")})
    df = pd.DataFrame(rows)
    return df.dropna(axis=1, how="all") if len(df) else df


def depthbench_frames(table: pd.DataFrame, models: Sequence[str]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """DepthBench's long table (model, metric, layer, layer_j, value) as (scalars: metric × model, per layer:
    layer × metric, "metric · model" with several models); pairwise rows (layer_j set) stay in the parquet file."""
    rows = table[table["layer_j"].isna()] if "layer_j" in table.columns else table
    order = [m for m in models if m in set(rows["model"])]

    def wide(part: pd.DataFrame, index: list[str]) -> pd.DataFrame:
        if part.empty:
            return pd.DataFrame()
        out = part.pivot_table(index=index, columns="model", values="value", aggfunc="first", sort=False)
        return out[[m for m in order if m in out.columns]].reset_index()

    scalars = wide(rows[rows["layer"].isna()], ["metric"])
    layered = rows[rows["layer"].notna()]
    if layered.empty:
        return scalars, pd.DataFrame()
    layered = layered.assign(layer=layered["layer"].astype(int),  # one column per metric (and model, when several)
                             column=layered["metric"] if len(order) < 2 else layered["metric"] + " · " + layered["model"])
    per_layer = layered.pivot_table(index="layer", columns="column", values="value", aggfunc="first", sort=False)
    return scalars, per_layer.reset_index().rename_axis(columns=None)


def curves_frame(cells: Sequence[CellData]) -> pd.DataFrame:
    """Long training curves: tokens, split (train/val), loss per logged record of every cell."""
    frames = []
    for c in cells:
        m = c.metrics
        if m.empty:
            continue
        x = m["tokens"] if "tokens" in m else m.get("step")
        if x is None:
            continue
        for split, column in (("train", "train_loss"), ("val", "val_loss")):
            if column in m:
                part = pd.DataFrame({"tokens": x, "loss": pd.to_numeric(m[column], errors="coerce")}).dropna()
                frames.append(part.assign(split=split, **c.info()))
    return concat(frames)


def curriculum_frame(cells: Sequence[CellData]) -> pd.DataFrame:
    """Long curriculum records: tokens, task and level (the k a run trains up to), from the task_level_<task>
    fields of metrics.jsonl (empty without a curriculum)."""
    frames = []
    for c in cells:
        m = c.metrics
        x = m["tokens"] if "tokens" in m else m.get("step")
        if m.empty or x is None:
            continue
        for column in (col for col in m.columns if col.startswith("task_level_")):
            part = pd.DataFrame({"tokens": x, "level": pd.to_numeric(m[column], errors="coerce")})
            frames.append(part.dropna(subset=["level"]).assign(task=column[len("task_level_"):], **c.info()))
    return concat(frames)


# -- per-layer probe profiles on the relative-depth axis -----------------------------------------

def first_rule(df: pd.DataFrame) -> pd.DataFrame:
    """Rows of the first skip rule listed (`ablate` runs the architecture's default rule first)."""
    return df[df["rule"] == df["rule"].iloc[0]] if "rule" in df.columns and len(df) else df


def lens_profile(df: pd.DataFrame) -> pd.DataFrame:
    """KL(p_L‖p_l) of the logit lens per depth state."""
    return df.assign(value=df["kl_final_lens"])[[*ID, "rel_depth", "value"]]


def skip_profile(df: pd.DataFrame) -> pd.DataFrame:
    """ΔCE of skipping each block (the architecture's default skip rule)."""
    frames = [first_rule(g) for _, g in df[df["mode"] == "skip"].groupby("model")] if "mode" in df else [df]
    df = concat(frames)
    return df.assign(value=df["delta_ce"])[[*ID, "rel_depth", "value"]]


def causal_profile(df: pd.DataFrame) -> pd.DataFrame:
    """Per skipped block s: mean causal score C(s, l) over the later updates l (DepthBench)."""
    sub = df[(df["metric"] == "causal_score") & df["layer_j"].notna()]
    return sub.groupby(ID + ["layer"], as_index=False).agg(rel_depth=("rel_depth", "first"), value=("value", "mean"))


def permutation_profile(df: pd.DataFrame) -> pd.DataFrame:
    """Per block i: mean permutation score P(i, j) over the swap pairs that include i (at l/L = i/L)."""
    sub = df.dropna(subset=["layer2"]) if "layer2" in df else df.iloc[0:0]
    value = "perm_score" if "perm_score" in sub.columns else "delta_ce"
    both = pd.concat([sub.assign(block=sub["layer"]), sub.assign(block=sub["layer2"])], ignore_index=True)
    out = both.groupby(ID + ["block"], as_index=False)[value].mean().rename(columns={value: "value"})
    return out.assign(rel_depth=out["block"].astype(float) / out["n_layer"])


def cka_profile(df: pd.DataFrame) -> pd.DataFrame:
    """Debiased CKA between adjacent depth states z_{l−1}, z_l."""
    sub = df[(df["metric"] == "adjacent_cka_debiased") & df["layer_j"].isna()]
    return sub[[*ID, "rel_depth", "value"]]


PROFILES = {  # figure id -> (saved table, profile function)
    "lens-kl": ("lens_logit", lens_profile),
    "skip-dce": ("ablate_skip", skip_profile),
    "causal-profile": ("causal", causal_profile),
    "permutation-profile": ("ablate_swap", permutation_profile),
    "cka-profile": ("similarity", cka_profile),
}


def profile_frame(cells: Sequence[CellData], kind: str) -> tuple[pd.DataFrame, list[str]]:
    """The `kind` profile (a key of PROFILES) over all cells, and the cells left out."""
    table, fn = PROFILES[kind]
    frames, left_out = [], []
    for c in cells:
        df = c.table(table)
        try:
            frames.append(fn(df) if df is not None and len(df) else None)
        except (KeyError, ValueError, IndexError):
            frames.append(None)
        if frames[-1] is None or not len(frames[-1]):
            left_out.append(c.name)
    return concat(frames), left_out


# -- model-level summaries -----------------------------------------------------------------------

SUMMARY_TABLES = ("causal", "similarity", "contrib", "routing")


def summary_metrics(cells: Sequence[CellData]) -> pd.DataFrame:
    """Model-level scalars of the long probe tables: one row per (table, metric), one column per model."""
    rows = []
    for c in cells:
        for table in SUMMARY_TABLES:
            df = c.table(table)
            if df is None or "unit" not in df.columns:
                continue
            for metric, value in df.loc[df["unit"] == "model", ["metric", "value"]].itertuples(index=False):
                rows.append({"table": table, "metric": metric, "model": c.name, "value": value})
    if not rows:
        return pd.DataFrame()
    long = pd.DataFrame(rows)
    wide = long.pivot_table(index=["table", "metric"], columns="model", values="value", aggfunc="first", sort=False)
    return wide[[c.name for c in cells if c.name in wide.columns]].reset_index()


def lens_summaries(cells: Sequence[CellData]) -> pd.DataFrame:
    """Lens summaries (logit and tuned) of every cell: prediction depth, N_lens, progress centre."""
    return concat([c.table(n) for c in cells for n in ("lens_logit_summary", "lens_tuned_summary")])


def lens_depths(cells: Sequence[CellData]) -> pd.DataFrame:
    return concat([c.table(n) for c in cells for n in ("lens_logit", "lens_tuned")])


def task_frame(cells: Sequence[CellData]) -> pd.DataFrame:
    """tasks_eval rows of every cell (long: task, k, metric, value, in_train_range), with the cell's seed."""
    return concat([t.assign(seed=c.seed) for c in cells if (t := c.table("tasks_eval")) is not None])


def task_summary(tasks: pd.DataFrame) -> pd.DataFrame:
    """Per model × task: mean accuracy inside and outside the training range of k, and the k tested."""
    if not {"metric", "task", "k", "value"} <= set(tasks.columns):
        return pd.DataFrame()
    acc = tasks[tasks["metric"] == "accuracy"]
    if acc.empty:
        return pd.DataFrame()
    in_range = acc["in_train_range"].astype(bool) if "in_train_range" in acc else pd.Series(True, index=acc.index)
    keys = ["model", "arch", "n_layer", *(["seed"] if "seed" in acc else []), "task"]
    out = acc.groupby(keys, as_index=False).agg(k_min=("k", "min"), k_max=("k", "max"))
    inside = acc[in_range].groupby(keys)["value"].mean().rename("accuracy_in_range")
    outside = acc[~in_range].groupby(keys)["value"].mean().rename("accuracy_out_of_range")
    out = out.join(inside, on=keys).join(outside, on=keys)
    return out.sort_values(["task", "arch", "n_layer"]).reset_index(drop=True)


def task_depth_table(tasks: pd.DataFrame) -> pd.DataFrame:
    """Per task × arch × depth × k: accuracy (mean over training seeds with its seed interval) and the
    logit lens' first depth (absolute and over L) at which correctly answered samples are already right.

    The lens columns answer "are harder instances resolved later in depth?": a first depth that climbs
    with k means the extra steps use extra layers. NaN where no sample of that k was answered.
    """
    needed = {"metric", "task", "k", "value", "arch", "n_layer", "model"}
    if not needed <= set(tasks.columns) or tasks.empty:
        return pd.DataFrame()
    wide = tasks.pivot_table(index=["model", "arch", "n_layer", "task", "k"], columns="metric", values="value",
                             aggfunc="first").reset_index()
    wide.columns.name = None
    if "accuracy" not in wide:
        return pd.DataFrame()
    wide = with_seed(wide)
    keys = ("task", "arch", "n_layer", "k")
    out = seed_means(wide, value="accuracy", keys=keys)
    for lens in ("lens_first_depth", "lens_first_rel_depth"):
        if lens in wide:
            out = out.merge(wide.groupby(list(keys), as_index=False)[lens].mean(), on=list(keys), how="left")
    return out.sort_values(list(keys)).reset_index(drop=True)


def deepest(df: pd.DataFrame) -> pd.DataFrame:
    """The rows of each architecture's deepest model."""
    return df[df["n_layer"] == df.groupby("arch")["n_layer"].transform("max")]
