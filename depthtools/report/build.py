"""Assemble and write the HTML reports: `grid_report` for a trained grid, `model_report` for one or
more checkpoints (two or more: side-by-side comparison).

A report reads saved tables only (docs/design.md §6), renders one self-contained HTML file (inline CSS and
script, figures as PNG data URIs, no network access: a Content-Security-Policy forbids any) with a
table of contents, a caption under each figure saying how to read it, and tables that sort by a
click on a header and download as CSV. Jinja2 autoescaping is on, so every string taken from a
config, a table or a directory name is escaped (docs/design.md §8). Missing inputs become a "Missing data"
section naming the cell, the file and the command that produces it.
"""

from __future__ import annotations

import base64
import datetime as _dt
import hashlib
import re
from importlib import resources
from pathlib import Path
from typing import Callable, Sequence

import jinja2
import pandas as pd
from markupsafe import Markup

from depthtools import __version__
from depthtools.analysis.seeds import depth_effects, seed_means
from depthtools.fsutil import atomic_write_bytes, check_file_target
from depthtools.report import figures, findings, frames
from depthtools.report.blocks import ListBlock, NoteBlock, Section, figure_block, table_block
from depthtools.report.data import CellData, GridData, read_cell, read_grid, resolve_checkpoints, weights_warnings

ANALYZE = "depthtools analyze --grid {grid}"
TEMPLATE = "report.html.j2"

SUMMARY_COLUMNS = ["model", "arch", "n_layer", "d_model", "seed", "n_skip_over_L", "f_tau", "n_lens_over_L", "kl_depth_over_L",
                   "pd_mean_over_L", "n_rep_over_L1", "cka_block_fraction", "causal_pair_fraction",
                   "perm_pair_fraction", "lens", "notes"]
SLOPE_COLUMNS = ["arch", "n_models", "n_seeds", "n_layers", "slope_n_skip", "slope_n_skip_lo", "slope_n_skip_hi",
                 "slope_n_skip_boot_lo", "slope_n_skip_boot_hi", "slope_loss_log_L", "slope_loss_log_L_lo",
                 "slope_loss_log_L_hi", "slope_loss_log_L_boot_lo", "slope_loss_log_L_boot_hi", "interval", "n_boot",
                 "ci", "paired_bootstrap", "notes"]

PROBE_FIGURES = {  # profile kind -> (title, y label, caption, log y)
    "lens-kl": ("Logit lens: KL to the final output", "KL(p_L ‖ p_l) (nats)",
                "How far the logit-lens prediction at depth l is from the model's output, per architecture "
                "(panel) and depth (colour). A curve that drops early means the answer is formed early and later "
                "layers only refine it; a curve that stays high until l/L≈1 means the last layers still change "
                "the prediction.", True),
    "skip-dce": ("Single-block skip: ΔCE", "ΔCE when block is skipped (nats)",
                 "Loss increase when one block is bypassed (identity), at the block's relative depth. Many blocks "
                 "well above 0 = computation spread over depth; a few spikes = a few blocks do the work and the "
                 "rest are redundant.", True),
    "causal-profile": ("Causal score per skipped block", "mean C(s, l) over later l",
                       "DepthBench causal score: how much skipping block s changes the updates of every later "
                       "block (relative change, averaged over later blocks). Higher = later blocks depend on "
                       "block s, i.e. the layers compose sequentially.", False),
    "permutation-profile": ("Permutation score per block", "mean P(i, j) over pairs with i",
                            "|L_swap − L|/L when block i swaps places with another block, averaged over the swap "
                            "pairs that include i. Near 0 = order does not matter (ensemble-like layers); "
                            "large = blocks depend on their position.", True),
    "cka-profile": ("Adjacent-state CKA", "CKA(z_{l−1}, z_l)",
                    "Debiased linear CKA between consecutive depth states. Close to 1 = the block barely "
                    "changes the representation; dips mark where the representation is transformed.", False),
}


# -- rendering ------------------------------------------------------------------------------------

def _environment():
    return jinja2.Environment(loader=jinja2.PackageLoader("depthtools.report", "templates"), autoescape=True,
                              undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)


def _asset(name: str) -> str:
    return resources.files("depthtools.report").joinpath("templates", name).read_text(encoding="utf-8")


def _csp_hash(text: str) -> str:
    return "sha256-" + base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode("ascii")


def render(title: str, subtitle: str, sections: Sequence[Section], meta: dict[str, str]) -> str:
    """The HTML page: inline style and script (allowed by hash in the CSP), sections, TOC."""
    css, js = _asset("report.css"), _asset("report.js")
    return _environment().get_template(TEMPLATE).render(
        title=title, subtitle=subtitle, sections=list(sections), meta=meta, version=__version__,
        generated=_dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        css=Markup(css), js=Markup(js), css_hash=_csp_hash(css), js_hash=_csp_hash(js))


def write(html: str, out_path: str | Path) -> Path:
    """Write the page atomically (a crash never leaves half a report), readable by others like any page."""
    out_path = Path(out_path)
    check_file_target(out_path, "report file (--out)")
    atomic_write_bytes(out_path, html.encode("utf-8"))  # mode 0666 less the umask, like any new file
    return out_path


# -- shared sections --------------------------------------------------------------------------------

def _missing_section(rows: list[tuple[str, str, str]], scope: str) -> Section:
    section = Section("missing", "Missing data",
                      f"What this report could not show, per {scope} and file, and the command that produces it.")
    if not rows:
        return section.add(NoteBlock("Nothing is missing: every expected file and analysis table was found."))
    df = pd.DataFrame(rows, columns=["where", "missing", "how to get it"])
    section.add(NoteBlock(f"{len(df)} missing input(s) in {df['where'].nunique()} place(s).", level="missing"))
    return section.add(table_block("table-missing", "Missing inputs", df, "One row per missing file or table."))


def _left_out(names: list[str], what: str) -> NoteBlock | None:
    if not names:
        return None
    return NoteBlock(f"Not shown (no {what}): {', '.join(names)}.", level="missing")


def _table_figures(section: Section, cells: list[CellData], table: str, names: list[str],
                   figure_specs: Sequence[tuple[str, str, str, Callable]]) -> Section:
    """The shape every per-probe section shares: draw each (id, title, caption, plot function)
    from analysis table `table` when any checkpoint has it, then name the checkpoints without it."""
    df, absent = frames.table_of(cells, table)
    if len(df):
        for fig_id, title, caption, plot in figure_specs:
            section.add(figure_block(fig_id, title, caption, plot, df, names))
    return section.add(_left_out(absent, f"{table} table"))


# -- grid report ------------------------------------------------------------------------------------

ISO_TOLERANCE = 1.10  # the grids depthtools plans stay within a few percent of their budget


def parameter_spread(cells_df: pd.DataFrame) -> float:
    """The largest max/min parameter count within one architecture (1.0: iso-parameter; a set of real
    models such as the Pythia sizes gives far more)."""
    params = pd.to_numeric(cells_df.get("params"), errors="coerce") if "params" in cells_df else None
    if params is None:
        return 1.0
    spread = 1.0
    for _arch, group in params.groupby(cells_df["arch"].astype(str)):
        group = group.dropna()
        if len(group) > 1 and group.min() > 0:
            spread = max(spread, float(group.max() / group.min()))
    return spread


def _overview(grid: GridData, cells_df: pd.DataFrame) -> Section:
    archs = sorted(cells_df["arch"].astype(str).unique())
    depths = sorted({int(n) for n in cells_df["n_layer"]})
    params = pd.to_numeric(cells_df["params"], errors="coerce").dropna()
    span = f"{int(params.min()):,}–{int(params.max()):,} parameters" if len(params) else "parameter counts unknown"
    seeds = sorted({int(s) for s in cells_df["seed"]}) if "seed" in cells_df else [0]
    seeding = (f"training seeds {', '.join(map(str, seeds))}" if len(seeds) > 1 else
               f"one training seed ({seeds[0]}), so no seed-noise estimate exists")
    ratio = parameter_spread(cells_df)
    sizes = ("Every model of one architecture has about the same parameter count, so moving along depth trades "
             "width for layers." if ratio <= ISO_TOLERANCE else
             f"These models are not iso-parameter: within one architecture parameter counts differ by up to "
             f"{ratio:.1f}x, so this is not a grid of equal size and a change with depth mixes depth with size.")
    intro = (f"{len(cells_df)} checkpoint(s) in {grid.directory}: architectures {', '.join(archs)}; depths "
             f"{', '.join(f'L{d}' for d in depths)}; {seeding}; {span}. {sizes}")
    section = Section("overview", "Overview", intro)
    section.add(_weights_note(grid.cells, grid.missing))
    return section.add(table_block(
        "table-cells", "Cells", cells_df, "One row per trained checkpoint: shape (d_model/n_layer = width per layer), "
        "parameters, training tokens and final losses (val_<domain>: per-domain validation loss, nats/token)."))


def _loss_sections(cells_df: pd.DataFrame, cells: list[CellData]) -> list[Section]:
    iso = parameter_spread(cells_df) <= ISO_TOLERANCE
    headline = Section("loss-vs-shape", "Final loss vs shape",
                       "The headline: does trading width for depth at a fixed parameter count help?" if iso else
                       "Final loss against shape. The models are not iso-parameter, so this compares models of "
                       "different sizes, not width against depth at a fixed budget.")
    finished = cells_df.dropna(subset=["val_loss"])
    if finished.empty:
        headline.add(NoteBlock("No cell has an eval.json yet (training unfinished).", level="missing"))
    else:
        headline.add(figure_block(
            "fig-loss-vs-shape", "Final val loss vs d_model/n_layer", "Each line is one architecture "
            + ("at a fixed parameter budget" if iso else "(NOT at a fixed parameter budget: sizes differ)")
            + "; points are labelled with their depth. Left = deep and narrow, right = shallow and "
            "wide (log x). Lower is better: a line that falls to the left means extra depth pays for its lost "
            "width. " + _seed_caption(finished), figures.plot_loss_vs_shape, finished))
        headline.add(_left_out(sorted(set(cells_df["model"]) - set(finished["model"])), "eval.json"))
        headline.add(table_block(
            "table-seed-means", "Final val loss per architecture and depth, over training seeds",
            seed_means(finished), "Mean final val loss over the seeds listed, with the 95% Student-t interval "
            "across seeds (_lo, _hi; empty with one seed) and the seed standard deviation (_sd)."))
        effects = depth_effects(finished)
        if len(effects):
            headline.add(table_block(
                "table-depth-effects", "Loss change from shallowest to deepest, per architecture",
                effects.assign(per_seed=[", ".join(f"{v:+.4f}" for v in p) for p in effects["per_seed"]]),
                "effect = loss(deep) − loss(shallow) of the same seed, averaged over seeds, with the 95% t-interval "
                "across seeds (negative: going deep-narrow helps). An interval that covers 0 is a tie."))

    domains = Section("domain-losses", "Per-domain loss vs depth",
                      "Final loss on each evaluation domain: whether depth helps some kinds of text more than others.")
    dom = frames.domain_frame(cells)
    if dom.empty:
        domains.add(NoteBlock("No per-domain losses were saved (eval.json missing).", level="missing"))
    else:
        domains.add(figure_block(
            "fig-domain-losses", "Per-domain final loss vs depth", "One panel per evaluation domain ('all (val)' = "
            "the pooled validation set), depth on a log2 axis, one line per architecture. Compare slopes across "
            "panels: a domain whose lines fall with depth benefits from depth.", figures.plot_domain_losses, dom))

    training = Section("training-curves", "Training curves", "Loss during training, per architecture.")
    curves = _training_curves(
        cells, "Training loss vs tokens", "Solid: training loss at each log step; dashed with dots: validation loss at "
        "each evaluation. Colour = depth (dark shallow → yellow deep). Curves that are still falling at the end mean "
        "the budget, not the architecture, limits the final loss.")
    training.add(curves)
    if not isinstance(curves, NoteBlock):
        training.add(_left_out([c.name for c in cells if c.metrics.empty], "metrics.jsonl"))
    return [headline, domains, training]


def _training_curves(cells: list[CellData], title: str, caption: str, train_only: bool = False):
    """The grid's training-curve figure (colour = depth), or a note that no metrics.jsonl was found."""
    curves = frames.curves_frame(cells)
    if train_only and "split" in curves:
        curves = curves[curves["split"] == "train"]
    if curves.empty:
        return NoteBlock("No training curves (metrics.jsonl) were found.", level="missing")
    return figure_block("fig-training-curves", title, caption, figures.plot_training_curves, curves)


def _seed_caption(cells_df: pd.DataFrame) -> str:
    """What the headline's points and bars are, given how many training seeds each cell has."""
    per_cell = cells_df.groupby(["arch", "n_layer"])["seed"].nunique() if "seed" in cells_df else pd.Series([1])
    if per_cell.max() <= 1:
        return "One training seed per cell: no error bars, because no seed-noise estimate exists."
    return (f"Points: mean over {per_cell.min()}–{per_cell.max()} training seeds; bars: 95% Student-t interval "
            "across seeds; small dots: the single seeds. Lines whose bars overlap are tied within seed noise.")


def _effective_depth_section(grid: GridData) -> Section:
    section = Section("effective-depth", "Effective depth",
                      "How many layers each model actually uses, and how that grows with depth (marginal effective "
                      "depth, docs/reference/metrics.md §9.12).")
    command = f"depthtools summarize --grid {grid.directory}"
    if grid.models_summary is None:
        section.add(NoteBlock(f"No effective-depth summary: run `{command}`.", level="missing"))
    else:
        section.add(table_block(
            "table-effective-depth", "Effective-depth summary per model", grid.models_summary,
            "N_skip/L: entropy-effective number of blocks whose skip matters, over L; f_tau: prunable fraction at "
            "τ; N_lens/L: effective number of layers that reduce lens CE; kl_depth_over_L: first depth from which "
            "the lens is within 0.1 nats of the output; pd_mean_over_L: mean prediction depth; N_rep/(L+1): "
            "distinct representations by CKA; causal/perm pair fractions: DepthBench late-pair thresholds. "
            "Higher N/L = more of the depth is used.", columns=SUMMARY_COLUMNS))
    if grid.grid_summary is None:
        section.add(NoteBlock(f"No marginal effective depth: run `{command}`.", level="missing"))
    else:
        section.add(figure_block(
            "fig-slopes", "Marginal effective depth and loss slope per architecture", "Left: dN_skip/dL, the "
            "least-squares slope of the effective number of layers against n_layer (dotted line at 1 = every "
            "added layer is fully used; 0 = added layers are wasted). Right: slope of final loss against log "
            "n_layer (negative = deeper is better). Slopes are fitted per training seed and averaged; bars: 95% "
            "t-interval across seeds (none with one seed). The bootstrap over evaluation sequences, a smaller "
            "noise source, is in the table's _boot_lo/_boot_hi columns.", figures.plot_slopes, grid.grid_summary))
        section.add(table_block(
            "table-slopes", "Marginal effective depth (slopes with CIs)", grid.grid_summary,
            "One row per architecture: slopes over its depth sweep, mean over training seeds, with the interval "
            "across seeds (_lo, _hi; `interval` says which) and the evaluation-sequence bootstrap (_boot_lo, "
            "_boot_hi), both at level ci.", columns=SLOPE_COLUMNS))
    return section


def _probe_section(grid: GridData) -> Section:
    section = Section("probes", "Depth probes on the relative-depth axis",
                      "Small multiples: one panel per architecture, one line per depth, x = relative depth l/L so "
                      "models of different depth overlay.")
    command = ANALYZE.format(grid=grid.directory)
    for kind, (title, ylabel, caption, logy) in PROBE_FIGURES.items():
        df, left_out = frames.profile_frame(grid.cells, kind)
        if df.empty:
            section.add(NoteBlock(f"{title}: no cell has the table; run `{command}`.", level="missing"))
            continue
        section.add(figure_block(f"fig-{kind}", title, caption, figures.plot_depth_profiles, df, ylabel, logy))
        section.add(_left_out(left_out, frames.PROFILES[kind][0] + " table"))
    return section


def _tasks_section(grid: GridData) -> tuple[Section, pd.DataFrame]:
    section = Section("depth-tasks", "Depth tasks",
                      "Synthetic tasks whose difficulty k needs about k sequential steps: does depth buy accuracy, "
                      "and does it extrapolate beyond the trained k?")
    tasks = frames.task_frame(grid.cells)
    if tasks.empty:
        section.add(NoteBlock("Depth tasks were not run for this grid. Run "
                              f"`depthtools tasks eval --grid {grid.directory}` and rebuild the report."))
        return section, pd.DataFrame()
    acc = tasks[tasks["metric"] == "accuracy"] if "metric" in tasks else tasks
    section.add(figure_block(
        "fig-depth-tasks", "Accuracy vs task depth k", "Rows: architectures; columns: tasks; one line per model "
        "depth (dark shallow → yellow deep). Hollow dots: k outside the training range (extrapolation). A deeper "
        "model whose line stays high for larger k is using its extra layers for extra sequential steps.",
        figures.plot_task_accuracy, acc))
    summary = frames.task_summary(tasks)
    if len(summary):
        section.add(table_block("table-depth-tasks", "Depth-task accuracy per model", summary,
                                "Mean accuracy over the k inside and outside the training range, per model and task."))
    for block in _task_lens_blocks(tasks):
        section.add(block)
    section.add(_depth_reached_table(grid.cells))
    section.add(_left_out([c.name for c in grid.cells if c.table("tasks_eval") is None], "tasks_eval table"))
    return section, summary


def _task_lens_blocks(tasks: pd.DataFrame) -> list:
    """Where in depth each k is resolved: the logit lens' first correct depth / L against k (figure), and
    per task × arch × depth × k the seed-mean accuracy with its interval beside the lens depths (table)."""
    blocks = []
    lens = tasks[tasks["metric"] == "lens_first_rel_depth"] if "metric" in tasks else tasks.iloc[:0]
    if len(lens.dropna(subset=["value"])):
        blocks.append(figure_block(
            "fig-task-lens-depth", "First lens depth vs task depth k",
            "The first layer (over L) whose logit lens already gives the right answer, averaged over the samples "
            "the model answers correctly; one line per model depth (band: range over seeds). A line that rises "
            "with k means harder instances are resolved later in depth; hollow dots: k outside the training range.",
            figures.plot_task_accuracy, lens, "lens first depth / L"))
    table = frames.task_depth_table(tasks)
    if len(table):
        blocks.append(table_block(
            "table-task-lens", "Depth tasks per k: accuracy over seeds and first lens depth", table,
            "Accuracy: mean over training seeds with its t-interval (n_seeds = 1: no interval). lens_first_depth: "
            "the first layer whose logit lens answers correctly (of the samples answered at the last layer); "
            "_rel: the same over L. NaN: no sample of that k answered."))
    return blocks


def _depth_reached_table(cells: list[CellData]):
    reached, _ = frames.table_of(cells, "tasks_depth_reached")
    if reached.empty:
        return None
    return table_block("table-depth-reached", "Computational depth reached", reached,
                       "Per model and task: the largest k solved with accuracy ≥ threshold at every k' ≤ k "
                       "(0: the smallest k already fails), and the largest k evaluated.")


def task_only(cells: list[CellData]) -> bool:
    """Whether every cell trained on the synthetic task stream alone (task_mix fraction 1): such models never
    saw text, so their text validation loss and the text probes measure nothing they were trained for."""
    def fraction(cell: CellData):
        mix = (cell.config.get("train") or {}).get("task_mix")
        return mix.get("fraction") if isinstance(mix, dict) else None

    return bool(cells) and all(fraction(c) == 1 for c in cells)


TASK_ONLY_NOTE = ("Every model here was trained on the synthetic task stream alone (task_mix fraction 1, loss on the "
                  "answers), so this report shows the depth tasks only: the text validation loss in the cells table "
                  "is out of distribution for these models, and the text probes (lens, ablations, effective depth) "
                  "were not run.")


def grid_sections(grid: GridData) -> list[Section]:
    """Every section of a grid report, in page order."""
    cells_df = frames.cells_frame(grid.cells)
    tasks_section, task_summary = _tasks_section(grid)
    only_tasks = task_only(grid.cells)
    missing = [] if only_tasks else list(grid.missing)  # text-probe tables are not expected of task-only cells
    if not task_summary.empty or only_tasks:
        missing += [(c.name, "analysis/tasks_eval.parquet", f"run `depthtools tasks eval --grid {grid.directory}`")
                    for c in grid.cells if c.table("tasks_eval") is None]
    found = Section("findings", "Findings", "Computed from the tables below; each sentence quotes the numbers.")
    task_items = (findings.depth_separation(frames.task_frame(grid.cells)) + findings.tasks(task_summary)
                  + findings.depth_reached(frames.table_of(grid.cells, "tasks_depth_reached")[0]))
    if only_tasks:
        items = [TASK_ONLY_NOTE] + task_items
    else:
        items = (findings.seed_noise(cells_df) + findings.loss_vs_depth(cells_df) + findings.lowest_loss(cells_df)
                 + findings.marginal_depth(grid.grid_summary) + findings.deepest_usage(grid.models_summary)
                 + task_items)
    items += findings.missing(len(missing), len({m[0] for m in missing}))
    found.add(ListBlock(items) if items else NoteBlock("Not enough finished cells for findings yet.", level="missing"))
    if only_tasks:
        return [_overview(grid, cells_df), found, tasks_section, _task_training_section(grid.cells),
                _missing_section(missing, "cell")]
    return [_overview(grid, cells_df), found, *_loss_sections(cells_df, grid.cells),
            _effective_depth_section(grid), _probe_section(grid), tasks_section, _missing_section(missing, "cell")]


def _weights_note(cells: list[CellData], missing=()) -> NoteBlock | None:
    """A warning at the top of a report when a checkpoint's weights are missing or damaged."""
    lines = weights_warnings(cells, missing)
    if not lines:
        return None
    return NoteBlock("Weights missing or damaged — these checkpoints cannot be loaded or probed again, and what "
                     "the report shows of them predates the damage: " + "; ".join(lines), level="missing")


def _task_training_section(cells: list[CellData]) -> Section:
    """Training of task-only cells: the answer loss, and the curriculum level each run reached over time."""
    section = Section("training-curves", "Training", "The answer loss during training and the curriculum: a level "
                      "rises by one when the model answers the threshold share of held-out samples at that level.")
    curves = _training_curves(cells, "Answer loss vs tokens", "Training loss on the answer tokens and end markers "
                              "at each log step; colour = depth (dark shallow → yellow deep).", train_only=True)
    section.add(curves)
    if isinstance(curves, NoteBlock):
        return section
    levels = frames.curriculum_frame(cells)
    if len(levels):
        section.add(figure_block(
            "fig-curriculum", "Curriculum level vs tokens", "The k level each run trains up to (rows: tasks). A "
            "line that climbs higher reached larger k within the same budget; lines of one depth are its seeds.",
            figures.plot_curriculum, levels))
    return section


def grid_report(grid_dir: str | Path, out_path: str | Path, title: str | None = None) -> Path:
    """Write the HTML report of a trained (and analysed) grid to `out_path`; returns the path.

    Reads `<grid>/<cell>/{config.json, metrics.jsonl, eval.json, analysis/*.parquet}` and the grid's
    `analysis/effective_depth_{models,grid}.parquet`; anything missing is listed, not fatal. Raises
    DepthToolsError when the directory does not exist or holds no checkpoint.
    """
    grid = read_grid(grid_dir)
    sections = grid_sections(grid)
    meta = {"grid": str(grid.directory), "cells": str(len(grid.cells))}
    html = render(title or f"Depth report — {grid.name}", "Iso-parameter grid report", sections, meta)
    return write(html, out_path)


# -- model / compare report ---------------------------------------------------------------------------

def _model_overview(cells: list[CellData]) -> Section:
    """Who the models are: shape and losses of trained cells, family and provenance of imported ones (an
    imported model has no training run here, so it gets no recipe row and no loss columns)."""
    cells_df = frames.cells_frame(cells)
    imported = [c for c in cells if c.provenance]
    section = Section("overview", "Overview", f"{len(cells)} checkpoint(s): " +
                      ", ".join(f"{c.name} ({c.family + ', ' if c.family else ''}{c.provenance or c.directory})"
                                for c in cells) + ".")
    section.add(_weights_note(cells))
    if imported:
        cells_df.insert(1, "family", [c.family or "–" for c in cells])
    if len(imported) == len(cells):  # nothing trained here: no training tokens, losses, seed or recipe
        cells_df = cells_df.drop(columns=[k for k in ("arch", "seed", "tokens", "train_loss", "val_loss")
                                          if k in cells_df.columns])
        section.add(table_block("table-models", "Models", cells_df, "One row per checkpoint: the family it was "
                                "imported from, its shape and parameter count."))
    else:
        section.add(table_block("table-models", "Models", cells_df, "One row per checkpoint: shape, parameters, "
                                "training tokens and final losses (nats/token)."))
        trained = [c for c in cells if not c.provenance]
        train = {c.name: (c.config.get("train") or {}) for c in trained}
        keys = ["tokens", "batch_size", "seq_len", "lr", "schedule", "warmup_fraction", "weight_decay", "seed"]
        recipe = pd.DataFrame([{"model": n, **{k: t.get(k) for k in keys}} for n, t in train.items()])
        section.add(table_block("table-recipe", "Training recipe", recipe, "The recorded TrainConfig fields that "
                                "matter most when comparing runs."))
    if imported:
        section.add(table_block("table-provenance", "Provenance", frames.provenance_frame(imported),
                                "Where each imported model came from: its format and file or folder, the family "
                                "its block options express, the weights it was read from, and the tokenizer (and "
                                "document separator) it carries. It was not trained here: no training curve or "
                                "recipe applies."))
    return section


def _model_training(cells: list[CellData]) -> Section | None:
    """The training curves of the cells trained here; None when every cell was imported (nothing to show)."""
    trained = [c for c in cells if not c.provenance]
    if not trained:
        return None
    section = Section("training", "Training curve", "Loss during training.")
    curves = frames.curves_frame(trained)
    if curves.empty:
        return section.add(NoteBlock("No training curve (metrics.jsonl) was found.", level="missing"))
    names = [c.name for c in trained]
    return section.add(figure_block(
        "fig-training", "Loss vs training tokens", "Train loss (per log step) and validation loss (per evaluation), "
        "one colour per model.", figures.plot_model_training, curves, names))


def _lens_section(cells: list[CellData], names: list[str]) -> Section:
    section = Section("lens", "Lens", "What the model would predict if it stopped at depth l (logit lens; tuned "
                      "lens when fitted).")
    lens = frames.lens_depths(cells)
    if lens.empty:
        return section.add(NoteBlock("No lens table; run `depthtools analyze` (or `depthtools lens`).",
                                     level="missing"))
    section.add(figure_block(
        "fig-lens", "Lens curves", "Left: KL from the final output to the lens prediction at depth l (0 at l=L by "
        "construction); middle: the lens cross-entropy; right: how often the lens top-1 equals the final top-1. "
        "Early convergence = late layers refine; late convergence = the last layers still decide.",
        figures.plot_lens_curves, lens, names))
    summary = frames.lens_summaries(cells)
    if len(summary):
        section.add(table_block("table-lens-summary", "Lens summary", summary, "pd_mean: mean prediction depth "
                                "(first depth after which the lens top-1 stays equal to the final top-1); n_lens: "
                                "entropy-effective number of layers that reduce lens CE; progress_com: centre of "
                                "mass of the CE progress over l/L."))
    pd_tokens = frames.concat([c.table("prediction_depth") for c in cells])
    pd_table = pd_tokens if len(pd_tokens) else summary
    if len(pd_table):
        section.add(figure_block(
            "fig-prediction-depth", "Prediction depth", "Per-token histogram of the logit lens' prediction depth / L "
            "(tables saved by `depthtools analyze`); for older tables the mean prediction depth / L per lens. Low = "
            "tokens are decided early.",
            figures.plot_prediction_depth, pd_table, names))
        if not len(pd_tokens):
            section.add(NoteBlock("These analysis tables predate the per-token prediction-depth table, so the "
                                  "figure shows the mean only; re-run `depthtools analyze` for the histogram."))
    return section


def _ablation_section(cells: list[CellData], names: list[str]) -> Section:
    section = Section("ablation", "Ablations", "Skip one block, prune blocks one by one, swap two blocks.")
    skip, no_skip = frames.table_of(cells, "ablate_skip")
    if len(skip):
        skip = skip[skip["mode"] == "skip"] if "mode" in skip else skip
        default_rule = frames.concat(frames.first_rule(g) for _, g in skip.groupby("model", sort=False))
        section.add(figure_block(
            "fig-skip", "Single-block skip", "Bars: loss increase (left) and KL from the intact output (right) when "
            "block l is bypassed (each architecture's default skip rule; the table lists every rule). Tall bars = "
            "the blocks the model cannot do without.", figures.plot_skip_bars, default_rule, names))
        cols = ["model", "rule", "layer", "rel_depth", "delta_ce", "kl_intact_ablated", "top1_agree", "n_skip_over_L"]
        section.add(table_block("table-skip", "Skip ablation per block", skip, "One row per model × skipped block.",
                                columns=cols))
    section.add(_left_out(no_skip, "ablate_skip table"))
    _table_figures(section, cells, "ablate_prune", names, [(
        "fig-prune", "Pruning curve", "Loss increase as blocks are removed one by one; the figure's title names "
        "the curve: single-skip order (the default: blocks removed in ascending order of their single-skip loss "
        "increase) or greedy re-measured (`--prune greedy`: each time the least harmful remaining block). Dotted "
        "line: tolerance τ. The fraction removed before the curve crosses τ is f_τ.",
        figures.plot_prune_curves)])
    return _table_figures(section, cells, "ablate_swap", names, [(
        "fig-swap", "Block swaps (permutation score)", "Cell (i, j): relative loss change when blocks i and j "
        "swap places. Dark everywhere = layer order barely matters; bright cells = blocks that depend on "
        "their position.", figures.plot_swap_heatmaps)])


def _causal_section(cells: list[CellData], names: list[str]) -> Section:
    section = Section("causal", "Causal scores", "DepthBench's causal score between layer pairs.")
    return _table_figures(section, cells, "causal", names, [(
        "fig-causal", "Causal score C(s, l)", "Row s: the skipped block; column l: a later block whose update "
        "‖Δu_l‖/‖u_l‖ changes. Bright cells far right of the diagonal = long-range dependencies between "
        "layers (sequential computation).", figures.plot_causal_heatmaps)])


def _similarity_section(cells: list[CellData], names: list[str]) -> Section:
    section = Section("similarity", "Representation similarity", "How the depth states relate to each other.")
    return _table_figures(section, cells, "similarity", names, [
        ("fig-cka", "CKA between depth states", "Debiased minibatch CKA between depth states i and j (1 = same "
         "representation up to rotation and scale). Large bright blocks = runs of layers that do not change the "
         "representation.", figures.plot_cka_heatmaps),
        ("fig-geometry", "Geometry per depth", "Adjacent CKA and angular distance (how much each block moves the "
         "state), effective rank (how many directions the tokens spread over) and mean token cosine (token "
         "collapse when it approaches 1).", figures.plot_geometry)])


def _contrib_section(cells: list[CellData], names: list[str]) -> Section:
    section = Section("contributions", "Block contributions", "How large each block's update is relative to the "
                      "state it writes into.")
    return _table_figures(section, cells, "contrib", names, [(
        "fig-contrib", "Contribution norms", "Left: ‖Δ_l‖/‖z_{l−1}‖ (a block that writes little is a candidate "
        "for removal); middle: cosine of the update with the incoming state (negative = the block erases what "
        "is there); right: how far the block's Jacobian is from the identity.", figures.plot_contributions)])


def _routing_section(cells: list[CellData], names: list[str]) -> Section | None:
    section = Section("routing", "Native depth routing", "Learned depth-mixing weights of architectures that "
                      "route between layers (HC/mHC, AttnRes, DenseFormer).")
    routing, absent = frames.table_of(cells, "routing")
    weights = routing[routing["metric"] == "routing_weight"] if len(routing) else routing
    native = [n for n in names if len(weights) and (weights["model"] == n).any()]
    if not native and all(c.provenance for c in cells):
        return None  # imported models are Pre-LN blocks: a plain residual stream, no routing to show
    if native:
        section.add(figure_block(
            "fig-routing", "Routing maps", "Row: a consumer (sublayer input, in sublayer depth); column: a source "
            "state. Weight far from the diagonal = the model reads old states directly (long-range depth routing).",
            figures.plot_routing_maps, routing, native))
    plain = [n for n in names if n not in native and n not in absent]
    if plain:
        section.add(NoteBlock(f"No native routing weights (a plain residual stream): {', '.join(plain)}."))
    section.add(_left_out(absent, "routing table"))
    return section


def _model_tasks_section(cells: list[CellData], names: list[str]) -> Section | None:
    section = Section("depth-tasks", "Depth tasks", "Accuracy on synthetic tasks that need about k sequential steps.")
    tasks, absent = frames.table_of(cells, "tasks_eval")
    if tasks.empty and all(c.provenance for c in cells):
        return None  # depth tasks are trained into a grid's models; an imported model has none to evaluate
    if tasks.empty:
        return section.add(NoteBlock("Depth tasks were not run for these checkpoints. Run `depthtools tasks eval "
                                     "--grid DIR` on their grid and rebuild the report."))
    section.add(figure_block(
        "fig-tasks", "Accuracy vs task depth k", "One panel per task, one line per model; hollow dots: k outside "
        "the training range. The k where a line falls off is the depth of serial computation the model manages.",
        figures.plot_model_tasks, tasks[tasks["metric"] == "accuracy"], names))
    summary = frames.task_summary(tasks)
    if len(summary):
        section.add(table_block("table-depth-tasks", "Depth-task accuracy per model", summary,
                                "Mean accuracy over the k inside and outside the training range."))
    for block in _task_lens_blocks(tasks):
        section.add(block)
    section.add(_depth_reached_table(cells))
    return section.add(_left_out(absent, "tasks_eval table"))


def _summary_section(cells: list[CellData]) -> Section:
    section = Section("summary-metrics", "Model-level metrics", "Scalar summaries saved by the probes.")
    wide = frames.summary_metrics(cells)
    if wide.empty:
        return section.add(NoteBlock("No model-level metrics (no causal, similarity, contrib or routing table).",
                                     level="missing"))
    return section.add(table_block("table-summary-metrics", "Model-level metrics", wide,
                                   "One row per metric, one column per model."))


def model_sections(cells: list[CellData]) -> list[Section]:
    """Every section of a model (one checkpoint) or compare (several) report, in page order."""
    names = [c.name for c in cells]
    found = Section("findings", "Findings", "Computed from the saved tables.")
    items = []
    for c in cells:
        items += findings.model_findings(c.name, c.table("ablate_skip"), c.table("lens_logit"),
                                         c.table("lens_logit_summary"), frames.val_loss(c.eval))
    if len(cells) > 1:
        items = findings.lowest_loss(frames.cells_frame(cells))[:1] + items
    found.add(ListBlock(items) if items else NoteBlock("No saved results to summarise yet.", level="missing"))
    missing = [(c.name, what, how) for c in cells for what, how in c.missing]
    sections = [_model_overview(cells), found, _model_training(cells), _lens_section(cells, names),
                _ablation_section(cells, names), _causal_section(cells, names), _similarity_section(cells, names),
                _contrib_section(cells, names), _routing_section(cells, names), _model_tasks_section(cells, names),
                _depthbench_section(cells), _summary_section(cells),
                _missing_section(missing, "checkpoint")]
    return [s for s in sections if s is not None]  # sections that do not apply to these checkpoints are left out


def _depthbench_section(cells: list[CellData]) -> Section | None:
    """DepthBench's metrics (`--protocol depthbench`, analysis/depthbench.parquet) when any checkpoint has them:
    its scalar summaries and its per-layer values, one column per model. None when none was computed."""
    table, absent = frames.table_of(cells, "depthbench")
    if table.empty:
        return None
    section = Section("depthbench", "DepthBench metrics", "DepthBench's metrics as its analysis scripts compute "
                      "them (`--protocol depthbench`: its skip rules, windows and every position).")
    scalars, per_layer = frames.depthbench_frames(table, [c.name for c in cells])
    if len(scalars):
        section.add(table_block("table-depthbench", "DepthBench summaries", scalars,
                                "One row per metric, one column per model (means, maxima, fractions)."))
    if len(per_layer):
        section.add(table_block("table-depthbench-layers", "DepthBench per layer", per_layer,
                                "One row per layer, one column per per-layer metric (pairwise values: --json or the "
                                "parquet file)."))
    return section.add(_left_out(absent, "depthbench table"))


def model_report(ckpts: list[str | Path], out_path: str | Path, title: str | None = None) -> Path:
    """Write the report of one checkpoint, or a side-by-side comparison of several, to `out_path`.

    `ckpts` are paths or cell names (resolved like `depthtools ablate --ckpt`). Every probe table saved
    beside each checkpoint is shown; missing ones are listed.
    """
    if isinstance(ckpts, (str, Path)):
        ckpts = [ckpts]
    cells = [read_cell(directory, name=label) for directory, label in resolve_checkpoints(list(ckpts))]
    names = [c.name for c in cells]
    if len(cells) == 1:
        default, subtitle = f"Model report — {names[0]}", "Every depth probe of one checkpoint"
        if cells[0].provenance:  # an imported model: say what it is before any number
            subtitle = f"{cells[0].family or 'pretrained'} model {cells[0].provenance}; every depth probe of it"
    else:
        default, subtitle = "Compare — " + " vs ".join(names), "Depth probes side by side"
        sizes = [((c.config.get("params") or {}).get("total")) for c in cells]
        sizes = [float(n) for n in sizes if isinstance(n, (int, float)) and n > 0]
        if len(sizes) > 1 and max(sizes) / min(sizes) > ISO_TOLERANCE:  # e.g. the Pythia sizes
            subtitle += (f"; not iso-parameter ({int(min(sizes)):,}–{int(max(sizes)):,} parameters), so depth "
                         "differences mix with size")
    meta = {"checkpoints": ", ".join(str(c.directory) for c in cells)}
    return write(render(title or default, subtitle, model_sections(cells), meta), out_path)


def file_stem(text: str) -> str:
    """A file-name-safe stem: letters, digits, '.', '_' and '-' kept, anything else becomes '-'."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", str(text)).strip("-.") or "report"


def default_name(grid_dir: str | Path | None = None, ckpts: Sequence[str | Path] = ()) -> str:
    """The report's default file name under reports/ (a slug of the grid or checkpoint names)."""
    if grid_dir is not None:
        return f"{file_stem(Path(grid_dir).resolve().name)}.html"
    stems = [file_stem(Path(str(c)).name) for c in ckpts]
    if len(stems) == 1:
        return f"{stems[0]}.html"
    return ("compare_" + "_vs_".join(stems))[:120] + ".html"
