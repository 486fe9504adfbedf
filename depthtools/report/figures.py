"""Report figures: one function per figure, each taking a tidy DataFrame and returning a Figure.

Figures are built on `matplotlib.figure.Figure` with the Agg canvas (no pyplot figure registry, so
nothing leaks between calls and nothing depends on the interactive backend) and styled inside
seaborn/matplotlib context managers (no global theme is changed). `to_data_uri` encodes a figure as
a small PNG data URI (DPI 80, a few inches wide) so a report stays a few MB at most.

Depth axes are relative depth l/L (models of different depth overlay, docs/reference/metrics.md §0); colours are
one per architecture, or one per depth (viridis, shallow to deep) inside an architecture's panel.
Labels that come from data (model and architecture names) go through `mpl_text` so a `$` in a name
cannot switch matplotlib into mathtext.
"""

from __future__ import annotations

import base64
import functools
import io
import math
from typing import Callable, Sequence

import matplotlib as mpl
import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import NullFormatter

from depthtools.analysis.plots import plot_prune_curve
from depthtools.analysis.seeds import seed_means, with_seed
from depthtools.errors import DepthToolsError

DPI = 96
CURVE_LABELS = {"greedy": "greedy re-measured", "skip_order": "single-skip order"}  # prune methods, as titled
PANEL_W, PANEL_H = 2.9, 2.2  # inches per small multiple
MAX_COLS = 4
RC = {"font.size": 7, "axes.titlesize": 8, "axes.labelsize": 7, "legend.fontsize": 6, "legend.title_fontsize": 6,
      "xtick.labelsize": 6, "ytick.labelsize": 6, "lines.markersize": 3.5, "lines.linewidth": 1.2}


# -- plumbing ------------------------------------------------------------------------------------

def styled(fn: Callable) -> Callable:
    """Run a plot function inside a whitegrid style and small fonts, without touching global rcParams."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with sns.axes_style("whitegrid"), mpl.rc_context(RC):
            return fn(*args, **kwargs)

    return wrapper


def new_figure(n_panels: int = 1, ncols: int | None = None, width: float = PANEL_W, height: float = PANEL_H,
               sharey: bool = False) -> tuple[Figure, list]:
    """A Figure on the Agg canvas with `n_panels` axes in a row-wrapped grid; unused axes are hidden."""
    ncols = max(1, min(ncols or MAX_COLS, n_panels))
    nrows = math.ceil(n_panels / ncols)
    fig = Figure(figsize=(width * ncols, height * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = np.atleast_1d(fig.subplots(nrows, ncols, squeeze=False, sharey=sharey)).ravel().tolist()
    for ax in axes[n_panels:]:
        ax.set_visible(False)
    return fig, axes[:n_panels]


def to_data_uri(fig: Figure, dpi: int = DPI) -> str:
    """The figure as a base64 PNG data URI; the figure is cleared afterwards to free its memory."""
    buffer = io.BytesIO()
    try:
        fig.savefig(buffer, format="png", dpi=dpi)
    finally:
        fig.clear()
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def mpl_text(value) -> str:
    """A data string safe to draw: `$` would start mathtext (and can fail to parse at draw time)."""
    return str(value).replace("\\", "\\\\").replace("$", r"\$")


def _labelled(df: pd.DataFrame, *columns: str) -> pd.DataFrame:
    out = df.copy()
    for column in columns:
        if column in out.columns:
            out[column] = out[column].map(mpl_text)
    return out


def _require(df: pd.DataFrame, columns: Sequence[str], what: str) -> None:
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise DepthToolsError(f"{what}: table lacks column(s) {missing}; has {list(df.columns)}")
    if df.empty:
        raise DepthToolsError(f"{what}: table is empty")


def depth_labels(df: pd.DataFrame) -> tuple[pd.DataFrame, list[str], list]:
    """df with a categorical 'depth' column ("L4") plus its order (shallow to deep) and palette."""
    layers = sorted({int(n) for n in df["n_layer"]})
    order = [f"L{n}" for n in layers]
    return df.assign(depth=[f"L{int(n)}" for n in df["n_layer"]]), order, sns.color_palette("viridis", len(order))


def arch_palette(archs: Sequence[str]) -> dict[str, tuple]:
    """One stable colour per architecture (sorted names over tab10)."""
    names = sorted(set(archs))
    colours = sns.color_palette("tab10", max(len(names), 1))
    return {name: colours[i % len(colours)] for i, name in enumerate(names)}


def model_palette(models: Sequence[str]) -> dict[str, tuple]:
    """One colour per model in the order given (compare reports)."""
    colours = sns.color_palette("tab10", max(len(models), 1))
    return {m: colours[i % len(colours)] for i, m in enumerate(models)}


def _legend_outside(ax) -> None:
    """Move an existing legend to the right of the axes, keeping its handles (seaborn's histogram
    legend has no labelled artists, so a fresh `ax.legend()` would come out empty)."""
    if ax.get_legend() is not None:
        sns.move_legend(ax, "upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)


# -- grid figures --------------------------------------------------------------------------------

@styled
def plot_loss_vs_shape(cells: pd.DataFrame) -> Figure:
    """Headline: final val loss against d_model/n_layer (log x), one line per architecture.

    cells: one row per model with arch, n_layer, d_model, val_loss (and seed). Each point is the mean
    over training seeds of one (arch, depth); error bars are the 95% t-interval across seeds and the
    small dots the single seeds (one seed: no bars). Points are labelled L<n>.
    """
    _require(cells, ["arch", "n_layer", "d_model", "val_loss"], "loss vs shape")
    data = with_seed(_labelled(cells.dropna(subset=["val_loss"]), "arch"))
    data = data.assign(aspect=data["d_model"] / data["n_layer"])
    means = seed_means(data, keys=("arch", "n_layer", "d_model"))  # seeds share a shape, so d_model is a key
    means = means.assign(aspect=means["d_model"] / means["n_layer"]).sort_values("aspect")
    palette = arch_palette(data["arch"])
    fig, (ax,) = new_figure(1, width=6.0, height=3.4)
    archs = sorted(means["arch"].unique())
    for i, (arch, sub) in enumerate(means.groupby("arch", sort=True)):
        dodge = 1 + 0.025 * (i - (len(archs) - 1) / 2)  # archs share a width per depth: shift bars apart (log x)
        x = sub["aspect"] * dodge
        ax.plot(x, sub["val_loss"], marker="o", color=palette[arch], label=arch)
        lo, hi = sub["val_loss_lo"].to_numpy(dtype=float), sub["val_loss_hi"].to_numpy(dtype=float)
        if np.isfinite(lo).any():
            err = np.vstack([sub["val_loss"] - lo, hi - sub["val_loss"]])
            ax.errorbar(x, sub["val_loss"], yerr=np.nan_to_num(err), fmt="none", ecolor=palette[arch],
                        capsize=2, linewidth=0.8)
            seeds = data[data["arch"] == arch]
            ax.scatter(seeds["aspect"] * dodge, seeds["val_loss"], s=5, color=palette[arch], alpha=0.45, linewidths=0)
        for x, y, n in zip(x, sub["val_loss"], sub["n_layer"]):
            ax.annotate(f"L{int(n)}", (x, y), textcoords="offset points", xytext=(3, 3), fontsize=6,
                        color=palette[arch])
    ax.set_xscale("log")
    ticks = sorted(means.groupby("n_layer")["aspect"].mean().round(1))  # one tick per depth
    ax.set_xticks(ticks, [f"{v:g}" for v in ticks])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("d_model / n_layer (log; left = deep-narrow, right = shallow-wide)")
    ax.set_ylabel("final val loss (nats/token), mean over seeds")
    ax.legend(title="arch", loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    return fig


@styled
def plot_domain_losses(losses: pd.DataFrame) -> Figure:
    """Per-domain final loss against depth n_layer (log2 x), one panel per domain, one line per arch.

    losses: long table with arch, n_layer, domain, loss.
    """
    _require(losses, ["arch", "n_layer", "domain", "loss"], "domain losses")
    data = _labelled(losses.dropna(subset=["loss"]), "arch", "domain")
    domains = sorted(data["domain"].unique())
    palette = arch_palette(data["arch"])
    fig, axes = new_figure(len(domains))
    for ax, domain in zip(axes, domains):
        for arch, sub in data[data["domain"] == domain].sort_values("n_layer").groupby("arch", sort=True):
            ax.plot(sub["n_layer"], sub["loss"], marker="o", color=palette[arch], label=arch)
        ax.set_xscale("log", base=2)
        ax.set_title(domain)
        ax.set_xlabel("n_layer (log2)")
        ax.set_ylabel("final loss (nats/token)")
    axes[-1].legend(title="arch", loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    return fig


@styled
def plot_training_curves(curves: pd.DataFrame) -> Figure:
    """Loss against training tokens, one panel per architecture, one colour per depth.

    curves: long table with arch, n_layer, tokens, split ('train' or 'val'), loss. Solid: train
    loss at each log step; dashed with markers: val loss at each evaluation.
    """
    _require(curves, ["arch", "n_layer", "tokens", "split", "loss"], "training curves")
    data, order, palette = depth_labels(_labelled(curves.dropna(subset=["loss"]), "arch"))
    colour = dict(zip(order, palette))
    archs = sorted(data["arch"].unique())
    fig, axes = new_figure(len(archs), sharey=True)
    for ax, arch in zip(axes, archs):
        for (depth, split), sub in data[data["arch"] == arch].groupby(["depth", "split"]):
            sub = sub.sort_values("tokens")
            ax.plot(sub["tokens"], sub["loss"], color=colour[depth], linestyle="-" if split == "train" else "--",
                    marker="" if split == "train" else "o", markersize=2.5, linewidth=1.0)
        ax.set_title(arch)
        ax.set_xlabel("training tokens")
        ax.set_ylabel("loss (nats/token)")
    handles = [Line2D([], [], color=colour[d], label=d) for d in order]
    handles += [Line2D([], [], color="grey", label="train"), Line2D([], [], color="grey", linestyle="--", marker="o",
                                                                      markersize=2.5, label="val")]
    axes[-1].legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    return fig


@styled
def plot_slopes(slopes: pd.DataFrame) -> Figure:
    """Marginal effective depth dN_skip/dL and dLoss/dlog L per architecture, with CI error bars.

    slopes: effective_depth_grid (arch, slope_n_skip[_lo,_hi], slope_loss_log_L[_lo,_hi]).
    """
    _require(slopes, ["arch", "slope_n_skip", "slope_loss_log_L"], "slopes")
    data = _labelled(slopes, "arch").sort_values("arch")
    palette = arch_palette(data["arch"])
    fig, axes = new_figure(2, width=3.2, height=2.4)
    panels = (("slope_n_skip", "dN_skip/dL (effective layers per layer)", 1.0),
              ("slope_loss_log_L", "dLoss/d log L (nats)", 0.0))
    for ax, (column, label, reference) in zip(axes, panels):
        y = np.arange(len(data))
        values = data[column].to_numpy(dtype=float)
        lo = data.get(f"{column}_lo", pd.Series(np.nan, index=data.index)).to_numpy(dtype=float)
        hi = data.get(f"{column}_hi", pd.Series(np.nan, index=data.index)).to_numpy(dtype=float)
        err = np.vstack([np.where(np.isnan(lo), 0, values - lo), np.where(np.isnan(hi), 0, hi - values)])
        ax.errorbar(values, y, xerr=np.clip(err, 0, None), fmt="none", ecolor="grey", capsize=2)
        ax.scatter(values, y, c=[palette[a] for a in data["arch"]], zorder=3)
        ax.axvline(reference, color="black", linestyle=":", linewidth=0.8)
        ax.set_yticks(y, data["arch"].tolist())
        ax.set_xlabel(label)
    return fig


@styled
def plot_depth_profiles(profiles: pd.DataFrame, ylabel: str, logy: bool = False) -> Figure:
    """A per-layer probe on the relative-depth axis: one panel per architecture, one line per depth.

    profiles: long table with arch, n_layer, rel_depth, value (one row per model × layer).
    """
    _require(profiles, ["arch", "n_layer", "rel_depth", "value"], ylabel)
    data, order, palette = depth_labels(_labelled(profiles.dropna(subset=["value", "rel_depth"]), "arch"))
    archs = sorted(data["arch"].unique())
    fig, axes = new_figure(len(archs), sharey=True)
    for i, (ax, arch) in enumerate(zip(axes, archs)):
        sub = data[data["arch"] == arch].sort_values("rel_depth")
        sns.lineplot(data=sub, x="rel_depth", y="value", hue="depth", hue_order=order, palette=palette, marker="o",
                     ax=ax, legend=i == len(archs) - 1, errorbar=None)
        ax.set_title(arch)
        ax.set_xlabel("relative depth l/L")
        ax.set_ylabel(ylabel)
        ax.set_xlim(-0.03, 1.03)
        if logy:
            ax.set_yscale("symlog", linthresh=1e-3)
    _legend_outside(axes[-1])
    return fig


@styled
def plot_task_accuracy(tasks: pd.DataFrame, value_label: str = "accuracy") -> Figure:
    """Depth-task accuracy against k: rows = architectures, columns = tasks, one line per depth.

    tasks: tasks_eval rows of one metric (arch, task, n_layer, k, value, in_train_range), e.g. accuracy,
    or lens_first_rel_depth with value_label "lens first depth / L". Hollow markers: k outside the
    training range (extrapolation). Several seeds of a depth: the line is their mean, the band their range.
    """
    _require(tasks, ["arch", "task", "n_layer", "k", "value"], "depth tasks")
    data, order, palette = depth_labels(_labelled(tasks.dropna(subset=["value"]), "arch", "task"))
    archs, names = sorted(data["arch"].unique()), sorted(data["task"].unique())
    fig, axes = new_figure(len(archs) * len(names), ncols=len(names), width=2.6, height=2.0, sharey=True)
    for r, arch in enumerate(archs):
        for c, task in enumerate(names):
            ax = axes[r * len(names) + c]
            sub = data[(data["arch"] == arch) & (data["task"] == task)].sort_values("k")
            last = r == len(archs) - 1 and c == len(names) - 1
            if len(sub):
                sns.lineplot(data=sub, x="k", y="value", hue="depth", hue_order=order, palette=palette, marker="o",
                             ax=ax, legend=last, errorbar=("pi", 100))
                if "in_train_range" in sub.columns:
                    out = sub[~sub["in_train_range"].astype(bool)]
                    ax.scatter(out["k"], out["value"], facecolors="white", edgecolors="black", s=14, zorder=3,
                               linewidths=0.6)
            ax.set_title(f"{arch} · {task}")
            ax.set_ylim(-0.03, 1.03)
            ax.set_xlabel("k (task depth)")
            ax.set_ylabel(value_label)
    _legend_outside(axes[-1])
    return fig


@styled
def plot_curriculum(levels: pd.DataFrame) -> Figure:
    """Curriculum level against training tokens: rows = tasks, columns = architectures, one line per run
    (colour = depth; the seeds of one depth share its colour)."""
    _require(levels, ["arch", "task", "n_layer", "tokens", "level", "model"], "curriculum")
    data, order, palette = depth_labels(_labelled(levels, "arch", "task"))
    colour = dict(zip(order, palette))
    archs, names = sorted(data["arch"].unique()), sorted(data["task"].unique())
    fig, axes = new_figure(len(archs) * len(names), ncols=len(archs), width=3.2, height=2.2, sharey=True)
    for r, task in enumerate(names):
        for c, arch in enumerate(archs):
            ax = axes[r * len(archs) + c]
            sub = data[(data["arch"] == arch) & (data["task"] == task)]
            for (depth, _model), run in sub.groupby(["depth", "model"], sort=True):
                run = run.sort_values("tokens")
                ax.step(run["tokens"], run["level"], where="post", color=colour[depth], linewidth=1.0, alpha=0.85)
            ax.set_title(f"{arch} · {task}")
            ax.set_xlabel("training tokens")
            ax.set_ylabel("curriculum level k")

    axes[-1].legend(handles=[Line2D([], [], color=colour[d], label=d) for d in order], loc="upper left",
                    bbox_to_anchor=(1.0, 1.0), frameon=False)
    return fig


# -- model / compare figures -----------------------------------------------------------------------

def _model_hue(df: pd.DataFrame, models: Sequence[str], *more_labels: str):
    """(data with printable labels, hue order, palette) for per-model plots: the models in the
    caller's order that have rows, each in its fixed colour (the same model, the same colour in
    every figure)."""
    data = _labelled(df, "model", *more_labels)
    order = [mpl_text(m) for m in models if mpl_text(m) in set(data["model"])]
    palette = {mpl_text(m): c for m, c in model_palette(list(models)).items()}
    return data, order, palette


def _model_lines(data: pd.DataFrame, panels: Sequence[tuple[str, str]], x: str, xlabel: str, models: Sequence[str],
                 style: str | None = None, width: float = PANEL_W, robust: Sequence[str] = (),
                 first: str = "depth 0") -> Figure:
    """Shared layout: one panel per (column, label), one line per model (hue), optional dash style.

    `robust`: columns whose y-range is set by the points after the first x (depth 0 of a lens: the
    embedding read through the unembedding, ~100 nats with tied embeddings, would flatten the rest);
    a first point above that range is clipped and its value written on the panel, named `first`."""
    data, order, palette = _model_hue(data, models)
    fig, axes = new_figure(len(panels), width=width)
    for i, (ax, (column, label)) in enumerate(zip(axes, panels)):
        sub = data.dropna(subset=[column]).sort_values(x)
        sns.lineplot(data=sub, x=x, y=column, hue="model", hue_order=order, palette=palette,
                     style=style if style and sub[style].nunique() > 1 else None, marker="o", ax=ax,
                     legend=i == len(panels) - 1, errorbar=None)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(label)
        if column in robust:
            _clip_first(ax, sub, x, column, first)
    _legend_outside(axes[-1])
    return fig


def _clip_first(ax, sub: pd.DataFrame, x: str, column: str, first_name: str = "depth 0") -> None:
    """Y-range from the points after the smallest x; note the clipped first points' largest value."""
    if sub.empty:
        return
    first = sub[x] == sub[x].min()
    rest, head = sub.loc[~first, column].astype(float), sub.loc[first, column].astype(float)
    if rest.empty or not np.isfinite(rest).any():
        return
    lo, hi = float(np.nanmin(rest)), float(np.nanmax(rest))
    if head.max() <= hi + 0.5 * max(hi - lo, 1e-9):
        return  # the first point does not dominate the range
    pad = 0.08 * max(hi - lo, 1e-6)
    ax.set_ylim(min(lo, float(head.min())) - pad if head.min() < lo else lo - pad, hi + 3 * pad)
    ax.annotate(f"{first_name} off scale: {head.max():.3g}", xy=(0.02, 0.97), xycoords="axes fraction", va="top",
                fontsize=7, color="0.3")


@styled
def plot_model_training(curves: pd.DataFrame, models: Sequence[str]) -> Figure:
    """Train and val loss against training tokens, one line per model (curves: model, tokens, split, loss)."""
    _require(curves, ["model", "tokens", "split", "loss"], "training curves")
    wide = curves.pivot_table(index=["model", "tokens"], columns="split", values="loss", aggfunc="first").reset_index()
    panels = [(c, f"{c} loss (nats/token)") for c in ("train", "val") if c in wide.columns]
    return _model_lines(wide, panels, "tokens", "training tokens", models)


@styled
def plot_lens_curves(lens: pd.DataFrame, models: Sequence[str]) -> Figure:
    """Lens curves per depth state: KL(p_L‖p_l), CE and top-1 agreement, one line per model.

    lens: lens depth table(s) (model, lens, rel_depth, kl_final_lens, ce, top1_agree); dashes
    distinguish logit and tuned lens when both are present.
    """
    _require(lens, ["model", "rel_depth", "kl_final_lens"], "lens curves")
    panels = [(c, l) for c, l in (("kl_final_lens", "KL(p_L ‖ p_l) (nats)"), ("ce", "lens CE (nats)"),
                                  ("top1_agree", "top-1 agreement with p_L")) if c in lens.columns]
    return _model_lines(lens, panels, "rel_depth", "relative depth l/L", models, style="lens",
                        robust=("kl_final_lens", "ce"))


@styled
def plot_prediction_depth(pd_table: pd.DataFrame, models: Sequence[str]) -> Figure:
    """Prediction depth: a histogram of per-token PD/L when saved, else mean PD/L per model and lens.

    pd_table: per-token rows (model, n_layer, prediction_depth) or lens summary rows
    (model, lens, pd_mean_over_L).
    """
    data, order, palette = _model_hue(pd_table, models)
    per_token = "prediction_depth" in data.columns
    fig, (ax,) = new_figure(1, width=4.8 if per_token else min(6.0, 2.4 + 0.7 * len(order)), height=2.6)
    if per_token:
        data = data.assign(pd_over_L=data["prediction_depth"] / data["n_layer"])
        sns.histplot(data=data, x="pd_over_L", hue="model", hue_order=order, palette=palette, stat="probability",
                     common_norm=False, element="step", bins=np.linspace(0, 1, 21), ax=ax)
        ax.set_xlabel("prediction depth / L (per token)")
        ax.set_ylabel("fraction of tokens")
    else:
        _require(data, ["model", "pd_mean_over_L"], "prediction depth")
        sns.barplot(data=data, x="model", y="pd_mean_over_L", order=order, hue="lens" if "lens" in data else None,
                    ax=ax, errorbar=None)
        ax.set_xlabel("")
        ax.set_ylabel("mean prediction depth / L")
        ax.tick_params(axis="x", rotation=20)
    _legend_outside(ax)
    return fig


@styled
def plot_skip_bars(skip: pd.DataFrame, models: Sequence[str]) -> Figure:
    """Single-block skip: ΔCE and KL(intact‖skipped) per block, bars grouped by model."""
    _require(skip, ["model", "layer", "delta_ce"], "skip ablation")
    data, order, palette = _model_hue(skip, models)
    data = data.assign(block=data["layer"].astype(int))
    panels = [(c, l) for c, l in (("delta_ce", "ΔCE when skipped (nats)"),
                                  ("kl_intact_ablated", "KL(intact ‖ skipped) (nats)")) if c in data.columns]
    fig, axes = new_figure(len(panels), width=3.4)
    for i, (ax, (column, label)) in enumerate(zip(axes, panels)):
        sns.barplot(data=data, x="block", y=column, hue="model", hue_order=order, palette=palette, ax=ax,
                    errorbar=None, legend=i == len(panels) - 1)
        ax.set_xlabel("skipped block l")
        ax.set_ylabel(label)
        thin_ticks(ax, sorted(data["block"].unique()))
    _legend_outside(axes[-1])
    return fig


MAX_TICK_LABELS = 10  # a 3.4-inch panel fits about this many block numbers side by side


def thin_ticks(ax, blocks: Sequence[int]) -> None:
    """Label every k-th category of a bar axis (k = ceil(n / MAX_TICK_LABELS)), so a 30-block model's labels
    stay legible instead of running together; bars keep their positions (seaborn's categorical 0..n-1)."""
    step = max(1, -(-len(blocks) // MAX_TICK_LABELS))
    if step == 1:
        return
    positions = list(range(0, len(blocks), step))
    ax.set_xticks(positions)
    ax.set_xticklabels([str(blocks[p]) for p in positions])


@styled
def plot_prune_curves(prune: pd.DataFrame, models: Sequence[str]) -> Figure:
    """Pruning: ΔCE against the fraction of blocks removed, one line per model (τ dotted), each model's
    removal curve (`summary.removal_curve`: greedy where saved, else the single-skip order), named in the title."""
    # lazy: analysis.summary imports the probes (torch); a report reads tables and stays torch-free
    from depthtools.analysis.summary import removal_curve

    _require(prune, ["model", "n_removed", "n_layer", "delta_ce"], "pruning")
    data = _labelled(prune, "model")
    curves = [removal_curve(group) for _, group in data.groupby("model", sort=False)]
    data = pd.concat([rows for rows, _ in curves]) if curves else data
    fig, (ax,) = new_figure(1, width=4.8, height=2.6)
    methods = sorted({CURVE_LABELS.get(m, str(m)) for _, m in curves if m is not None})
    if methods:
        ax.set_title(f"removal curve: {', '.join(methods)}", fontsize=8)
    plot_prune_curve(data, ax=ax)
    _legend_outside(ax)
    return fig


@styled
def plot_model_tasks(tasks: pd.DataFrame, models: Sequence[str]) -> Figure:
    """Depth-task accuracy against k, one panel per task, one line per model (hollow: k beyond training)."""
    _require(tasks, ["model", "task", "k", "value"], "depth tasks")
    data, order, palette = _model_hue(tasks.dropna(subset=["value"]), models, "task")
    names = sorted(data["task"].unique())
    fig, axes = new_figure(len(names), width=2.8, height=2.2, sharey=True)
    for i, (ax, task) in enumerate(zip(axes, names)):
        sub = data[data["task"] == task].sort_values("k")
        sns.lineplot(data=sub, x="k", y="value", hue="model", hue_order=order, palette=palette, marker="o", ax=ax,
                     legend=i == len(names) - 1, errorbar=None)
        if "in_train_range" in sub.columns:
            out = sub[~sub["in_train_range"].astype(bool)]
            ax.scatter(out["k"], out["value"], facecolors="white", edgecolors="black", s=14, zorder=3, linewidths=0.6)
        ax.set_title(task)
        ax.set_ylim(-0.03, 1.03)
        ax.set_xlabel("k (task depth)")
        ax.set_ylabel("accuracy")
    _legend_outside(axes[-1])
    return fig


def _heatmaps(frames: Sequence[tuple[str, pd.DataFrame]], row: str, col: str, value: str, xlabel: str,
              ylabel: str, cbar: str, vmin: float | None = None, vmax: float | None = None,
              cmap: str = "viridis") -> Figure:
    """One heatmap per model side by side (matrix rows `row`, columns `col`), shared colour scale."""
    mats = []
    for name, df in frames:
        mat = df.pivot_table(index=row, columns=col, values=value, aggfunc="mean").sort_index().sort_index(axis=1)
        mats.append((name, mat))
    finite_vals = np.concatenate([m.to_numpy(dtype=float).ravel() for _, m in mats])
    finite_vals = finite_vals[np.isfinite(finite_vals)]
    vmin = vmin if vmin is not None else (float(finite_vals.min()) if len(finite_vals) else 0.0)
    vmax = vmax if vmax is not None else (float(finite_vals.max()) if len(finite_vals) else 1.0)
    fig, axes = new_figure(len(mats), ncols=3, width=3.0, height=2.6)
    for ax, (name, mat) in zip(axes, mats):
        small = max(mat.shape) <= 6
        sns.heatmap(mat, ax=ax, vmin=vmin, vmax=vmax, cmap=cmap, square=True, annot=small, fmt=".2f",
                    annot_kws={"fontsize": 5}, cbar_kws={"label": cbar, "shrink": 0.8})
        ax.set_title(mpl_text(name))
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
    return fig


def _by_model(df: pd.DataFrame, models: Sequence[str]) -> list[tuple[str, pd.DataFrame]]:
    return [(m, df[df["model"] == m]) for m in models if (df["model"] == m).any()]


@styled
def plot_causal_heatmaps(causal: pd.DataFrame, models: Sequence[str]) -> Figure:
    """DepthBench causal score C(s, l): rows = skipped block s, columns = later update l, per model."""
    _require(causal, ["model", "metric", "layer", "layer_j", "value"], "causal")
    data = causal[causal["metric"] == "causal_score"].dropna(subset=["layer_j"])
    return _heatmaps(_by_model(data, models), "layer", "layer_j", "value", "affected update l", "skipped block s",
                     "C(s, l)", vmin=0.0)


@styled
def plot_cka_heatmaps(similarity: pd.DataFrame, models: Sequence[str]) -> Figure:
    """Debiased minibatch CKA between depth states z_i and z_j, per model."""
    _require(similarity, ["model", "metric", "layer", "layer_j", "value"], "CKA")
    data = similarity[similarity["metric"] == "cka_debiased"].dropna(subset=["layer_j"])
    return _heatmaps(_by_model(data, models), "layer", "layer_j", "value", "depth state j", "depth state i",
                     "debiased CKA", vmin=0.0, vmax=1.0, cmap="magma")


@styled
def plot_swap_heatmaps(swap: pd.DataFrame, models: Sequence[str]) -> Figure:
    """Permutation score P(i, j) = |L_swap − L| / L of swapping blocks i and j, per model."""
    _require(swap, ["model", "layer", "layer2"], "swap ablation")
    value = "perm_score" if "perm_score" in swap.columns else "delta_ce"
    data = swap.dropna(subset=["layer2"]).astype({"layer": int, "layer2": int})
    return _heatmaps(_by_model(data, models), "layer", "layer2", value, "block j", "block i",
                     "P(i, j)" if value == "perm_score" else "ΔCE", vmin=0.0)


@styled
def plot_routing_maps(routing: pd.DataFrame, models: Sequence[str]) -> Figure:
    """Native depth routing: weight of each source (sublayer depth) in each consumer's input, per model."""
    _require(routing, ["model", "metric", "layer", "layer_j", "value"], "routing")
    data = routing[routing["metric"] == "routing_weight"].dropna(subset=["layer_j"])
    return _heatmaps(_by_model(data, models), "layer", "layer_j", "value", "source (sublayer depth)",
                     "consumer (sublayer depth)", "weight", cmap="rocket_r")


@styled
def plot_contributions(contrib: pd.DataFrame, models: Sequence[str]) -> Figure:
    """Per block: relative contribution ‖Δ_l‖/‖z_{l−1}‖, residual cosine and Jacobian identity deviation."""
    _require(contrib, ["model", "metric", "rel_depth", "value"], "contributions")
    wanted = (("relative_contribution", "‖Δ_l‖ / ‖z_{l−1}‖"), ("residual_cosine", "cos(Δ_l, z_{l−1})"),
              ("jacobian_deviation", "Jacobian identity deviation"))
    # block 0 often writes an update as large as the embedding itself (Gemma's √d-scaled embedding, a first
    # block that rewrites it): its point would flatten every other block's, so the range comes from the rest
    return _long_lines(contrib, wanted, models, "block", "relative depth l/L (block output)",
                       robust=("relative_contribution", "jacobian_deviation"), first="block 0")


@styled
def plot_geometry(similarity: pd.DataFrame, models: Sequence[str]) -> Figure:
    """Per depth state: adjacent CKA, adjacent angular distance, effective rank and token mean cosine."""
    _require(similarity, ["model", "metric", "rel_depth", "value"], "geometry")
    wanted = (("adjacent_cka_debiased", "CKA(z_{l−1}, z_l)"), ("adjacent_angular_distance", "angle(z_{l−1}, z_l)/π"),
              ("effective_rank", "effective rank"), ("collapse_mean_cosine", "mean token cosine"))
    return _long_lines(similarity, wanted, models, "state", "relative depth l/L")


def _long_lines(df: pd.DataFrame, wanted, models, unit: str, xlabel: str, robust: Sequence[str] = (),
                first: str = "depth 0") -> Figure:
    rows = df[(df["unit"] == unit) if "unit" in df.columns else slice(None)]
    if "layer_j" in rows.columns:
        rows = rows[rows["layer_j"].isna()]
    wide = rows.pivot_table(index=["model", "rel_depth"], columns="metric", values="value", aggfunc="first")
    wide = wide.reset_index()
    panels = [(c, l) for c, l in wanted if c in wide.columns and wide[c].notna().any()]
    if not panels:
        raise DepthToolsError(f"none of {[c for c, _ in wanted]} in the table")
    return _model_lines(wide, panels, "rel_depth", xlabel, models, robust=robust, first=first)
