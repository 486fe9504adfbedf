"""Depth-probe commands II: `causal`, `similarity`, `contrib`, `routing`, `summarize`, `analyze`.

Each single-checkpoint command samples the fixed evaluation token set (`analysis.tokens.sample_windows`
from the checkpoint's recorded data directory, or --data), runs one library analysis, prints a table
(or --json), and saves the tidy table beside the checkpoint as `analysis/<name>.parquet` with the
settings it ran with (--out also writes a copy to a chosen .parquet/.csv path). `analyze --grid`
runs the whole suite over every checkpoint of a grid and skips tables already saved with the same
settings (token-set hash and weight hash included), so an interrupted run resumes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable, Optional

import typer
from rich.markup import escape
from rich.console import Console

from cli.main import app, console, print_json, table
from depthtools.analysis.suite import (eval_tokens, run_causal, run_contrib, run_routing, run_similarity,
                                      table_settings as _settings)
from depthtools.errors import DepthToolsError

DATA_HELP = "Prepared data directory (default: the one recorded in the checkpoint's config.json)."


# -- shared plumbing -------------------------------------------------------------------------------

def _load(ckpt: str, data, n_tokens, seq_len, split, seed):
    from depthtools.analysis.tokens import check_tokens
    from depthtools.checkpoint import load

    model = load(ckpt)
    tokens = check_tokens(model, eval_tokens(Path(model.checkpoint_dir), data, n_tokens, seq_len, split, seed))
    return model, tokens


def _records(df) -> list[dict[str, Any]]:
    """JSON-safe rows (NaN -> null)."""
    return json.loads(df.to_json(orient="records"))


def _fmt(value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _emit(df, name: str, model, settings: dict, as_json: bool, out: Optional[Path], save: bool, show: Callable) -> None:
    from depthtools.analysis.tables import save_table, write_frame

    if save:
        save_table(df, model.checkpoint_dir, name, settings)
    if out is not None:
        write_frame(df, out)
    if as_json:
        print_json({"table": _records(df), "notes": list(df.attrs.get("notes", [])), "settings": settings})
        return
    show(df)
    for note in df.attrs.get("notes", []):
        console.print(f"[yellow]note:[/] {escape(str(note))}", highlight=False)
    if save:
        console.print(f"saved {Path(model.checkpoint_dir) / 'analysis' / (name + '.parquet')}", markup=False, highlight=False)


def _model_rows(df) -> list[list[str]]:
    sub = df[df["unit"] == "model"]
    return [[m, _fmt(v)] for m, v in zip(sub["metric"], sub["value"])]


def _per_layer_table(df, title: str, metrics: list[str]):
    sub = df[(df["unit"] != "model") & df["layer_j"].isna() & df["metric"].isin(metrics)]
    wide = sub.pivot_table(index="layer", columns="metric", values="value", aggfunc="first")
    cols = [m for m in metrics if m in wide.columns]
    return table(title, ["layer", *cols], [[str(l), *(_fmt(float(wide.loc[l, c])) for c in cols)] for l in wide.index])


# options shared by the single-checkpoint commands
def _common(ckpt, data, n_tokens, seq_len, split, seed):
    return _load(ckpt, data, n_tokens, seq_len, split, seed)


CKPT = typer.Option(..., "--ckpt", help="Checkpoint path or cell name (e.g. preln_L8).")
DATA = typer.Option(None, "--data", help=DATA_HELP)
TOKENS = typer.Option(4096, "--tokens", help="Evaluation tokens (ceil(tokens/seq_len) windows).")
SEQ_LEN = typer.Option(128, "--seq-len", help="Window length the model reads.")
SPLIT = typer.Option("val", "--split", help="Data split to sample windows from.")
SEED = typer.Option(0, "--seed", help="Seed of the window offsets.")
BATCH = typer.Option(8, "--batch-size", help="Sequences per forward batch.")
EXCLUDE = typer.Option(1, "--exclude-first", help="Leading positions excluded from every statistic (>= 1: the sink).")
JSON = typer.Option(False, "--json", help="Print JSON (table rows, notes, settings).")
OUT = typer.Option(None, "--out", help="Also write the table to this .parquet or .csv file.")
SAVE = typer.Option(True, "--save/--no-save", help="Save the table beside the checkpoint (analysis/<name>.parquet).")


# -- single-checkpoint commands ----------------------------------------------------------------------

@app.command("causal")
def causal_command(
    ckpt: str = CKPT, data: Optional[Path] = DATA, n_tokens: int = TOKENS, seq_len: int = SEQ_LEN,
    split: str = SPLIT, seed: int = SEED, batch_size: int = BATCH, exclude_first: int = EXCLUDE,
    rule: Optional[str] = typer.Option(None, "--rule", help="Skip rule (default: the architecture's first)."),
    future: bool = typer.Option(True, "--future/--no-future", help="Also the Csordás future-effect matrix."),
    cuts: Optional[str] = typer.Option(None, "--cuts", help="Future cut points, e.g. 8,16 (default: up to 4 of 8,16,…)."),
    as_json: bool = JSON, out: Optional[Path] = OUT, save: bool = SAVE,
):
    """Causal score C(s,l) of skipping block s on every later update (DepthBench), + future effect.

    Example: depthtools causal --ckpt preln_L8 --tokens 2048 --seq-len 64
    """
    model, tokens = _common(ckpt, data, n_tokens, seq_len, split, seed)
    cut_list = [int(c) for c in cuts.split(",") if c] if cuts else None
    args = dict(batch_size=batch_size, exclude_first=exclude_first, rule=rule, future=future, cuts=cut_list)
    df = run_causal(model, tokens, **args)

    def show(df):
        L = model.n_layer
        sub = df[df["metric"] == "causal_score"]
        M = {(int(s), int(l)): v for s, l, v in zip(sub["layer"], sub["layer_j"], sub["value"])}
        console.print(table(f"causal score C(s,l) — {Path(model.checkpoint_dir).name} (rows: skipped s)",
                            ["s", *(str(l) for l in range(1, L))],
                            [[str(s), *(_fmt(M.get((s, l))) if l > s else "" for l in range(1, L))] for s in range(L - 1)]))
        console.print(table("summary", ["metric", "value"], _model_rows(df)))

    _emit(df, "causal", model, _settings("causal", args, model, tokens), as_json, out, save, show)


@app.command("similarity")
def similarity_command(
    ckpt: str = CKPT, data: Optional[Path] = DATA, n_tokens: int = TOKENS, seq_len: int = SEQ_LEN,
    split: str = SPLIT, seed: int = SEED, batch_size: int = BATCH, exclude_first: int = EXCLUDE,
    cka_batch: int = typer.Option(256, "--cka-batch", help="Tokens per CKA minibatch."),
    outlier_k: int = typer.Option(1, "--outlier-k", help="Massive dims removed for the *_no_outlier ranks."),
    as_json: bool = JSON, out: Optional[Path] = OUT, save: bool = SAVE,
):
    """Angular distance, minibatch CKA (debiased/biased/zscore), effective rank and token collapse per depth.

    Example: depthtools similarity --ckpt hc_L8 --exclude-first 16 --json
    """
    model, tokens = _common(ckpt, data, n_tokens, seq_len, split, seed)
    args = dict(batch_size=batch_size, exclude_first=exclude_first, cka_batch=cka_batch, outlier_k=outlier_k)
    df = run_similarity(model, tokens, **args)

    def show(df):
        console.print(_per_layer_table(df, f"depth geometry — {Path(model.checkpoint_dir).name}", [
            "adjacent_cka_debiased", "adjacent_angular_distance", "effective_rank", "participation_ratio",
            "effective_rank_no_outlier", "collapse_effective_rank", "collapse_mean_cosine"]))
        console.print(table("summary", ["metric", "value"], _model_rows(df)))

    _emit(df, "similarity", model, _settings("similarity", args, model, tokens), as_json, out, save, show)


@app.command("contrib")
def contrib_command(
    ckpt: str = CKPT, data: Optional[Path] = DATA, n_tokens: int = TOKENS, seq_len: int = SEQ_LEN,
    split: str = SPLIT, seed: int = SEED, batch_size: int = BATCH, exclude_first: int = EXCLUDE,
    jacobian: bool = typer.Option(True, "--jacobian/--no-jacobian", help="Block Jacobian identity deviation (JVPs)."),
    probes: int = typer.Option(2, "--probes", help="Rademacher probes per batch and block."),
    as_json: bool = JSON, out: Optional[Path] = OUT, save: bool = SAVE,
):
    """Relative contribution and residual cosine per block (attention/MLP split where additive), Jacobian deviation.

    Example: depthtools contrib --ckpt preln_L8 --probes 4
    """
    model, tokens = _common(ckpt, data, n_tokens, seq_len, split, seed)
    args = dict(batch_size=batch_size, exclude_first=exclude_first, jacobian=jacobian, probes=probes)
    df = run_contrib(model, tokens, **args)

    def show(df):
        console.print(_per_layer_table(df, f"contributions — {Path(model.checkpoint_dir).name}", [
            "relative_contribution", "residual_cosine", "state_cosine", "attn_relative", "mlp_relative",
            "additive", "jacobian_deviation"]))
        console.print(table("summary", ["metric", "value"], _model_rows(df)))

    _emit(df, "contrib", model, _settings("contrib", args, model, tokens), as_json, out, save, show)


@app.command("routing")
def routing_command(
    ckpt: str = CKPT, data: Optional[Path] = DATA, n_tokens: int = TOKENS, seq_len: int = SEQ_LEN,
    split: str = SPLIT, seed: int = SEED, exclude_first: int = EXCLUDE,
    long_range_k: int = typer.Option(4, "--long-range-k", help="Long-range mass: sources more than k sublayers back."),
    as_json: bool = JSON, out: Optional[Path] = OUT, save: bool = SAVE,
):
    """Native depth-routing statistics (HC/mHC unfolded weights, AttnRes maps, DenseFormer DWA).

    Example: depthtools routing --ckpt hc_L8 --json
    """
    model, tokens = _common(ckpt, data, n_tokens, seq_len, split, seed)
    args = dict(exclude_first=exclude_first, long_range_k=long_range_k)
    df = run_routing(model, tokens, **args)

    def show(df):
        if df.empty:
            return
        console.print(_per_layer_table(df, f"routing per consumer (sublayer depth) — {Path(model.checkpoint_dir).name}",
                                       ["mean_source_lag", "source_entropy", "long_range_mass", "max_weight"]))
        console.print(table("summary", ["metric", "value"], _model_rows(df)))

    _emit(df, "routing", model, _settings("routing", args, model, tokens), as_json, out, save, show)


# -- grid commands -----------------------------------------------------------------------------------

@app.command("analyze")
def analyze_command(
    grid: Path = typer.Option(..., "--grid", help="Grid directory (checkpoints/<grid>)."),
    data: Optional[Path] = DATA, n_tokens: int = TOKENS, seq_len: int = SEQ_LEN, split: str = SPLIT,
    seed: int = SEED, batch_size: int = BATCH, exclude_first: int = EXCLUDE,
    only: Optional[str] = typer.Option(None, "--only", help="Comma-separated subset of the suite (default: all)."),
    swap_pairs: str = typer.Option("all", "--swap-pairs", help="Swap pairs: all (DepthBench permutation score) or adjacent."),
    tau: float = typer.Option(0.05, "--tau", help="Pruning tolerance in nats."),
    tuned_lens: bool = typer.Option(False, "--tuned-lens", help="Also fit (train split) and evaluate a tuned lens."),
    force: bool = typer.Option(False, "--force", help="Recompute even when a table with the same settings exists."),
):
    """Run the whole depth-probe suite over every checkpoint of a grid (resumable).

    Tables already saved with the same settings (analysis arguments, token-set hash, weight hash) are
    skipped; an analysis that does not apply to an architecture is reported and skipped.

    Example: depthtools analyze --grid checkpoints/tiny --tokens 2048 --seq-len 64
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from depthtools.analysis.suite import analyze_grid

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=False) as progress:
        task = progress.add_task("analyze", total=None)

        def show(description: str, done: int, total: int) -> None:
            progress.update(task, description=description, completed=done, total=total)

        report = analyze_grid(grid, data=data, n_tokens=n_tokens, seq_len=seq_len, split=split, seed=seed,
                              batch_size=batch_size, exclude_first=exclude_first, only=only, swap_pairs=swap_pairs,
                              tau=tau, tuned_lens=tuned_lens, force=force, progress=show)
    console.print(f"analyzed {report.checkpoints} checkpoint(s): {report.ran} run, {report.reused} already saved, "
                  f"{len(report.not_applicable)} not applicable")
    for line in report.not_applicable:
        console.print(f"[yellow]skipped:[/] {escape(str(line))}", highlight=False)
    console.print(f"next: depthtools summarize --grid {grid}", markup=False, highlight=False)


@app.command("summarize")
def summarize_command(
    grid: Path = typer.Option(..., "--grid", help="Grid directory (checkpoints/<grid>)."),
    n_boot: int = typer.Option(1000, "--n-boot", help="Bootstrap resamples of the evaluation sequences."),
    seed: int = typer.Option(0, "--seed", help="Bootstrap seed."),
    as_json: bool = JSON,
    save: bool = typer.Option(True, "--save/--no-save", help="Save under <grid>/analysis/."),
):
    """Effective-depth summary per model and marginal effective depth per architecture, with intervals
    across training seeds (and a bootstrap over evaluation sequences).

    Reads the tables `analyze` (or the single commands) saved; a missing table leaves its fields
    empty with a note. Saved as <grid>/analysis/effective_depth_models.parquet and effective_depth_grid.parquet.

    Example: depthtools summarize --grid checkpoints/tiny --n-boot 500
    """
    from depthtools.analysis.suite import summarize_grid
    from depthtools.analysis.summary import SUMMARY_FIELDS

    models, slopes = summarize_grid(grid, n_boot=n_boot, seed=seed, save=save)
    if as_json:
        print_json({"models": _records(models), "grid": _records(slopes)})
        return
    wide = Console(width=max(console.width, 200))
    cols = ["model", "seed", *SUMMARY_FIELDS]
    wide.print(table(f"effective depth — {grid}", cols,
                        [[_fmt(r.get(c)) for c in cols] for r in models.to_dict(orient="records")]))
    for r in models.to_dict(orient="records"):
        if r.get("notes"):
            console.print(f"[yellow]{escape(str(r['model']))}:[/] {escape(str(r['notes']))}", highlight=False)
    gcols = ["arch", "n_models", "n_seeds", "slope_n_skip", "slope_n_skip_lo", "slope_n_skip_hi", "slope_loss_log_L",
             "slope_loss_log_L_lo", "slope_loss_log_L_hi", "slope_loss_log_L_boot_lo", "slope_loss_log_L_boot_hi"]
    wide.print(table("marginal effective depth (dN_skip/dL) and dLoss/dlog L: mean over training seeds, 95% t-interval "
                     "across seeds (_lo/_hi; none with one seed) and bootstrap over sequences (_boot_lo/_boot_hi)",
                        gcols, [[_fmt(r.get(c)) for c in gcols] for r in slopes.to_dict(orient="records")]))
    if save:
        console.print(f"saved {Path(grid) / 'analysis'}/effective_depth_{{models,grid}}.parquet", markup=False, highlight=False)
