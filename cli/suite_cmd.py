"""The whole suite: `analyze` (every probe over checkpoints, resumable) and `summarize` (effective depth).

`analyze` takes the probe commands' options (cli/probe_cmd.py) and runs the same analyses through
`depthtools.analysis.suite`, so a table one of them saved with the same settings is reused by the other.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from cli.app import app
from cli.common import check_device, console, fmt, parse_list, print_json, table
from cli.plain import PlainLog, is_plain
from cli.probe_cmd import (
    ANALYSIS_DTYPE,
    BATCH,
    CKPT,
    DATA,
    DEVICE,
    EXCLUDE,
    GRID,
    JSON,
    N_TOKENS_GIVEN,
    N_TOKENS_OPT,
    PRUNE_OPT,
    RECOMPUTE,
    SEED,
    SEQ_LEN_OPT,
    SPLIT,
    SWAP_PAIRS_MAX_OPT,
    TEXT,
    ProbeCommand,
)
from depthtools.analysis.suite import analyze_grid, check_prune, check_sizes, checkpoint_dirs
from depthtools.errors import DepthToolsError


@app.command("analyze", cls=ProbeCommand)
def analyze_command(
    ckpt: Optional[List[str]] = CKPT, grid: Optional[Path] = GRID,
    only: Optional[str] = typer.Option(None, "--only", help="Comma-separated analyses (default: the suite). Valid: "
                                       "similarity, causal, contrib, routing, sequence_profile, lens_logit, lens_tuned, "
                                       "ablate_skip, ablate_prune, ablate_swap, ablate_swap_adjacent, ablate_mean, "
                                       "ablate_linear."),
    pairs: str = typer.Option("all", "--pairs", help="Swap pairs of the suite: all (ablate_swap, DepthBench "
                                                     "permutation score) or adjacent (ablate_swap_adjacent)."),
    tau: float = typer.Option(0.05, "--tau", help="Pruning tolerance in nats."),
    prune: str = PRUNE_OPT,
    swap_pairs_max: Optional[int] = SWAP_PAIRS_MAX_OPT,
    tuned: bool = typer.Option(False, "--tuned", help="Also fit (train split) and evaluate a tuned lens."),
    lens_steps: int = typer.Option(250, "--lens-steps", help="Tuned-lens training steps."),
    lens_tokens: int = typer.Option(65536, "--lens-tokens", help="Training-split tokens for the tuned lens."),
    lens_lr: float = typer.Option(1e-3, "--lens-lr", help="Tuned-lens AdamW learning rate."),
    data: Optional[Path] = DATA, text: Optional[Path] = TEXT, n_tokens: int = N_TOKENS_OPT, seq_len: Optional[int] = SEQ_LEN_OPT, split: str = SPLIT,
    seed: int = SEED, batch_size: int = BATCH, exclude_first: int = EXCLUDE, device: str = DEVICE,
    recompute: bool = RECOMPUTE,
    protocol: str = typer.Option("depthtools", "--protocol", help="depthtools (this suite) or depthbench: "
                                 "DepthBench's metrics as its scripts compute them (its skip rules, states, "
                                 "512-token windows, every position; --only takes its metric names)."),
):
    """Run the whole depth-probe suite over every checkpoint of a grid (or --ckpt), resumable.

    Tables already saved with the same settings (analysis arguments, token-set hash, weight hash) —
    by an earlier `analyze` or by a probe command such as `lens` or `ablate` — are reused; an
    analysis that does not apply to an architecture is reported and skipped.

    Example: depthtools analyze --grid checkpoints/tiny --n-tokens 2048 --seq-len 64
    """
    check_device(device)
    only = parse_list(only, "str", "--only", "causal,lens_logit")
    if protocol not in ("depthtools", "depthbench"):
        raise DepthToolsError(f"unknown --protocol {protocol!r}; valid: depthtools, depthbench")
    if protocol == "depthbench":
        if ANALYSIS_DTYPE.get() != "float32":
            raise DepthToolsError(f"--dtype {ANALYSIS_DTYPE.get()} is not available with --protocol depthbench "
                                  "(DepthBench's metrics run in float32); drop --dtype")
        run_depthbench(ckpt, grid, only, data, n_tokens, seq_len, split, seed, batch_size, device)
        return
    check_prune(prune)
    settings = dict(data=data, n_tokens=n_tokens, seq_len=seq_len, split=split, seed=seed, batch_size=batch_size,
                    exclude_first=exclude_first, only=only, pairs=pairs, tau=tau, prune=prune, tuned=tuned,
                    recompute=recompute,
                    device=device, ckpts=ckpt, lens_steps=lens_steps, lens_tokens=lens_tokens, lens_lr=lens_lr,
                    dtype=ANALYSIS_DTYPE.get(), cap=not N_TOKENS_GIVEN.get(), on_plan=lambda line: console.print(line, markup=False, highlight=False,
                                                                                  soft_wrap=True),
                    **({} if swap_pairs_max is None else {"swap_pairs_max": swap_pairs_max}))
    if is_plain():  # a log file, nohup, Slurm: rich's bar would print nothing until the end
        report = analyze_grid(grid, progress=_plain_progress(), **settings)
    else:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      TextColumn("ETA"), TimeRemainingColumn(), console=console, transient=False) as progress:
            task = progress.add_task("analyze", total=None)

            def show(description: str, done: int, total: int) -> None:
                progress.update(task, description=description, completed=done, total=total)

            report = analyze_grid(grid, progress=show, **settings)
    console.print(f"analyzed {report.checkpoints} checkpoint(s): {report.ran} run, {report.reused} already saved, "
                  f"{len(report.not_applicable)} not applicable")
    for line in report.not_applicable:
        console.print(f"[yellow]skipped:[/] {escape(str(line))}", highlight=False)
    if grid is not None:
        console.print(f"next: depthtools summarize --grid {grid}", markup=False, highlight=False)


def run_depthbench(ckpt, grid, only, data, n_tokens, seq_len, split, seed, batch_size, device) -> None:
    """`analyze --protocol depthbench`: DepthBench's metrics per checkpoint, saved as analysis/depthbench.parquet.
    A family or an --only metric DepthBench does not define is a one-line error (exit 2)."""
    from depthtools.analysis.depthbench import depthbench_checkpoint  # lazy: keeps the CLI torch-free

    check_sizes(n_tokens, seq_len, batch_size)
    for ckpt_dir in checkpoint_dirs(ckpt, grid):
        df = depthbench_checkpoint(ckpt_dir, data, n_tokens, seq_len, split, seed, only, batch_size, device)
        console.print(f"{ckpt_dir.name}: {len(df)} DepthBench rows -> {ckpt_dir / 'analysis' / 'depthbench.parquet'}",
                      markup=False, highlight=False)
        for note in df.attrs.get("notes", []):
            console.print(f"[yellow]note:[/] {escape(str(note))}", highlight=False)


def _plain_progress():
    """analyze_grid's progress as plain lines: one per checkpoint done, and a line at most every minute
    within a long one (naming the analysis running)."""
    from depthtools.analysis.cost import duration  # lazy: keeps the CLI torch-free

    log, current = PlainLog(), [None]

    def eta(done: int, total: int) -> str:
        """The remaining time at the rate so far (analyses of unequal cost: a rough figure)."""
        spent = time.monotonic() - log.t0
        return f", ETA ~{duration(spent / done * (total - done))}" if 0 < done < total else ""

    def show(description: str, done: int, total: int) -> None:
        cell = description.split(":")[0]
        if current[0] is None:
            log(f"analyze: {total} analyses to run or reuse (output is not a terminal: one line per checkpoint)")
        elif cell != current[0]:
            log(f"analyze: {current[0]} done ({done}/{total}){eta(done, total)}")
        else:
            log.every(f"analyze: {description} ({done}/{total}){eta(done, total)}")
        current[0] = cell
    return show


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

    Reads the tables `analyze` (or the probe commands) saved; a missing table leaves its fields
    empty with a note. Saved as <grid>/analysis/effective_depth_models.parquet and effective_depth_grid.parquet.

    Example: depthtools summarize --grid checkpoints/tiny --n-boot 500
    """
    from depthtools.analysis.summary import SUMMARY_FIELDS, summarize_grid  # lazy: keeps the CLI torch-free

    models, slopes = summarize_grid(grid, n_boot=n_boot, seed=seed, save=save)
    if as_json:
        print_json({"models": json.loads(models.to_json(orient="records")),
                    "grid": json.loads(slopes.to_json(orient="records"))})
        return
    wide = Console(width=max(console.width, 200))
    cols = ["model", "seed", *SUMMARY_FIELDS]
    wide.print(table(f"effective depth — {grid}", cols,
                     [[fmt(r.get(c)) for c in cols] for r in models.to_dict(orient="records")]))
    for r in models.to_dict(orient="records"):
        if r.get("notes"):
            console.print(f"[yellow]{escape(str(r['model']))}:[/] {escape(str(r['notes']))}", highlight=False)
    gcols = ["arch", "n_models", "n_seeds", "slope_n_skip", "slope_n_skip_lo", "slope_n_skip_hi", "slope_loss_log_L",
             "slope_loss_log_L_lo", "slope_loss_log_L_hi", "slope_loss_log_L_boot_lo", "slope_loss_log_L_boot_hi"]
    wide.print(table("marginal effective depth (dN_skip/dL) and dLoss/dlog L: mean over training seeds, 95% t-interval "
                     "across seeds (_lo/_hi; none with one seed) and bootstrap over sequences (_boot_lo/_boot_hi)",
                     gcols, [[fmt(r.get(c)) for c in gcols] for r in slopes.to_dict(orient="records")]))
    if save:
        console.print(f"saved {Path(grid) / 'analysis'}/effective_depth_{{models,grid}}.parquet", markup=False, highlight=False)
