"""Seaborn plot helpers: each takes a tidy table and returns a matplotlib Axes (docs/design.md §6).

The x axis is relative depth l/L so models of different depth in an iso-parameter grid overlay;
one line per model (hue) and, where a table has several skip rules or lenses, one dash style each.
"""

from __future__ import annotations

import pandas as pd

from depthtools.errors import DepthToolsError


def _axes(ax):
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt  # heavy, one path: a figure

    return plt.subplots(figsize=(6, 4))[1]


def _require(df: pd.DataFrame, columns: list[str]) -> None:
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise DepthToolsError(f"table lacks column(s) {missing}; has {list(df.columns)}")


def _style(df: pd.DataFrame, column: str) -> str | None:
    return column if column in df.columns and df[column].nunique() > 1 else None


def plot_lens(df: pd.DataFrame, metric: str = "kl_final_lens", ax=None):
    """Lens metric against relative depth l/L, one line per model (dashes: logit vs tuned lens)."""
    import seaborn as sns  # heavy, one path: a figure

    _require(df, ["rel_depth", metric, "model"])
    ax = _axes(ax)
    sns.lineplot(data=df, x="rel_depth", y=metric, hue="model", style=_style(df, "lens"), marker="o", ax=ax)
    ax.set_xlabel("relative depth l/L")
    ax.set_ylabel(metric)
    return ax


def plot_ablation(df: pd.DataFrame, metric: str = "delta_ce", ax=None):
    """Ablation metric per block at relative depth l/L, one line per model (dashes: skip rule)."""
    import seaborn as sns  # heavy, one path: a figure

    _require(df, ["rel_depth", metric, "model"])
    data = df[df["method"] != "gromov"] if "method" in df.columns else df
    ax = _axes(ax)
    sns.lineplot(data=data, x="rel_depth", y=metric, hue="model", style=_style(data, "rule"), marker="o", ax=ax)
    ax.set_xlabel("relative depth l/L (block l)")
    ax.set_ylabel(metric)
    return ax


def plot_prune_curve(df: pd.DataFrame, metric: str = "delta_ce", ax=None):
    """Pruning curve: metric against the fraction of blocks removed, per model and method."""
    import seaborn as sns  # heavy, one path: a figure

    _require(df, ["n_removed", "n_layer", metric, "model"])
    data = df.assign(fraction_removed=df["n_removed"].astype(float) / df["n_layer"])
    ax = _axes(ax)
    sns.lineplot(data=data, x="fraction_removed", y=metric, hue="model", style=_style(data, "method"),
                 marker="o", ax=ax)
    if "tau" in data.columns:
        ax.axhline(float(data["tau"].iloc[0]), color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("fraction of blocks removed")
    ax.set_ylabel(metric)
    return ax
