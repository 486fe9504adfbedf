"""Depth-probe commands: `lens`, `ablate`, `causal`, `similarity`, `contrib`, `routing`.

Every probe command (and `analyze`, cli/suite_cmd.py) takes the same options for the same things:

    --ckpt NAME (repeatable) / --grid DIR   which checkpoints
    --data DIR                              prepared data (default: the one each checkpoint records)
    --text FILE                             or a text file, tokenized with the model's own tokenizer
    --n-tokens N --seq-len T --split S      the evaluation windows: ceil(N/T) seeded windows of split S
    --seed K --batch-size B --device D      window seed, sequences per batch, cpu or cuda
    --recompute                             ignore tables saved with the same settings
    --json / --out FILE / --save/--no-save  print JSON, also write the table, save beside the checkpoint

Each runs its analysis through `depthtools.analysis.suite.run_analysis`, so it saves the tables
`analyze` saves (same names, same settings) and reuses a table saved with identical settings.
Old option spellings (--tokens, --force, --swap-pairs, --tuned-lens) still work and print a
one-line deprecation note.
"""

from __future__ import annotations

import contextvars
import json
from pathlib import Path
from typing import Any, Callable, List, Optional

import pandas as pd
import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from typer.core import TyperCommand

from cli.app import app
from cli.common import check_device, check_devices, console, err_console, fmt, parse_list, print_json, table, write_out
from cli.plain import PlainLog, PlainProgress, is_plain
from cli.probe_depthbench import PROTOCOL_OPT, check_protocol, emit_depthbench, run_probe as run_depthbench_probe
from depthtools.analysis.suite import (
    DTYPES,
    N_TOKENS,
    SEQ_LEN,
    ablate_analysis,
    analysis_args,
    check_dtype,
    check_prune,
    check_sizes,
    checkpoint_dirs,
    loaded_checkpoints,
    plan,
    progress_total,
    run_analysis,
    skip_is_measured,
)
from depthtools.checkpoint import loading
from depthtools.errors import DepthToolsError

# -- the shared option vocabulary --------------------------------------------------------------------
DEPRECATED = {"--tokens": "--n-tokens", "--force": "--recompute", "--swap-pairs": "--pairs", "--tuned-lens": "--tuned"}


# --dtype of the running probe command (ProbeCommand adds the option to every probe command and sets this).
ANALYSIS_DTYPE: contextvars.ContextVar[str] = contextvars.ContextVar("analysis_dtype", default="float32")
# Whether the running command was given --n-tokens: if not, a split shorter than the default evaluates on the
# windows it holds (tokens.split_note) instead of resampling it.
N_TOKENS_GIVEN: contextvars.ContextVar[bool] = contextvars.ContextVar("n_tokens_given", default=True)


class ProbeCommand(TyperCommand):
    """A command that accepts the old option spellings (hidden), printing a one-line note for each,
    and takes `--dtype float32|bfloat16|float16` (the analysis dtype; `probe` and `analyze` read ANALYSIS_DTYPE)."""

    DTYPE_HELP = ("--dtype float32|bfloat16|float16: the analysis dtype, weights loaded straight into it "
                  "(default float32; the metrics accumulate in float32/float64 either way). --stream: read each block "
                  "from the checkpoint's safetensors when it runs (a model larger than memory; same results). "
                  "--devices N (with --device cuda): blocks over the first N CUDA devices, split by bytes.")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.epilog = f"{self.epilog}\n\n{self.DTYPE_HELP}" if self.epilog else self.DTYPE_HELP

    @staticmethod
    def take_dtype(args: list) -> tuple[list, str]:
        """Remove `--dtype X` / `--dtype=X` from args: (the rest, X or 'float32')."""
        rest, dtype, i = [], "float32", 0
        while i < len(args):
            arg = args[i]
            if arg == "--":
                rest += args[i:]
                break
            if isinstance(arg, str) and arg.startswith("--dtype="):
                dtype = arg.split("=", 1)[1]
            elif arg == "--dtype":
                if i + 1 >= len(args):
                    raise DepthToolsError(f"--dtype needs a value; valid: {', '.join(DTYPES)}")
                dtype, i = str(args[i + 1]), i + 1
            else:
                rest.append(arg)
            i += 1
        return rest, dtype

    @staticmethod
    def take_loading(args: list) -> tuple[list, bool, int | None]:
        """Remove `--stream` and `--devices N` / `--devices=N` from args: (the rest, stream, N or None)."""
        rest, stream, devices, i = [], False, None, 0
        while i < len(args):
            arg = args[i]
            if arg == "--":
                rest += args[i:]
                break
            value = None
            if arg == "--stream":
                stream = True
            elif isinstance(arg, str) and arg.startswith("--devices="):
                value = arg.split("=", 1)[1]
            elif arg == "--devices":
                if i + 1 >= len(args):
                    raise DepthToolsError("--devices needs a value: the number of CUDA devices, e.g. --devices 2")
                value, i = str(args[i + 1]), i + 1
            else:
                rest.append(arg)
            if value is not None:
                if not value.isdigit():
                    raise DepthToolsError(f"--devices {value!r} is not a whole number of CUDA devices, e.g. --devices 2")
                devices = int(value)
            i += 1
        return rest, stream, devices

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        args, ctx.meta["depthtools.dtype"] = self.take_dtype(list(args))
        args, ctx.meta["depthtools.stream"], ctx.meta["depthtools.devices"] = self.take_loading(args)
        known = {opt for param in self.params for opt in getattr(param, "opts", [])}
        rewritten = []
        for i, arg in enumerate(args):
            if not isinstance(arg, str):  # programmatic callers may pass paths
                rewritten.append(arg)
                continue
            if arg == "--":
                rewritten += args[i:]
                break
            name, eq, value = arg.partition("=")
            new = DEPRECATED.get(name)
            if new is not None and new in known and name not in known:
                typer.echo(f"note: {name} is deprecated; use {new}", err=True)
                arg = new + eq + value
            rewritten.append(arg)
        return super().parse_args(ctx, rewritten)

    def invoke(self, ctx):
        """Run the command under the analysis dtype (--dtype) with --text FILE travelling as the data argument
        (a file there means text to tokenize with the checkpoint's own tokenizer: suite.eval_tokens)."""
        text, data = ctx.params.get("text"), ctx.params.get("data")
        if data is not None and Path(data).is_file():  # --data names a folder; only --text FILE is tokenized as text
            raise DepthToolsError(f"--data {data} is a file, not a prepared data folder (one with meta.json); to "
                                  f"evaluate on a text file pass --text {data}")
        if text is not None:
            if ctx.params.get("data") is not None:
                raise DepthToolsError("give --data DIR or --text FILE, not both")
            if not Path(text).is_file():
                raise DepthToolsError(f"--text {text} is not a file (expected a UTF-8 text file)")
            ctx.params["data"], ctx.params["text"] = Path(text), None
        token = ANALYSIS_DTYPE.set(check_dtype(ctx.meta.get("depthtools.dtype", "float32")))
        given = N_TOKENS_GIVEN.set(self.given(ctx, "n_tokens"))
        devices = ctx.meta.get("depthtools.devices")
        try:
            if devices is not None:
                check_devices(ctx.params.get("device") or "cpu", devices)
            with loading(stream=ctx.meta.get("depthtools.stream", False), devices=devices):
                return super().invoke(ctx)
        finally:
            ANALYSIS_DTYPE.reset(token)
            N_TOKENS_GIVEN.reset(given)

    @staticmethod
    def given(ctx, name: str) -> bool:
        """Whether option `name` was given on the command line (not its default). Compared by name: typer may
        run its own copy of click, whose ParameterSource enum is not `click.core`'s."""
        source = ctx.get_parameter_source(name)
        return source is not None and getattr(source, "name", str(source)) not in ("DEFAULT", "DEFAULT_MAP")


CKPT = typer.Option(None, "--ckpt", help="Checkpoint path or cell name (repeatable), e.g. preln_L4.")
GRID = typer.Option(None, "--grid", help="Every checkpoint found under this directory.")
DATA = typer.Option(None, "--data", help="Prepared data directory (default: the one recorded in each checkpoint).")
TEXT = typer.Option(None, "--text", help="A UTF-8 text file to evaluate on instead of --data: tokenized with the "
                                          "checkpoint's own tokenizer into the evaluation windows (no dataset needed).")
N_TOKENS_OPT = typer.Option(N_TOKENS, "--n-tokens", help="Evaluation tokens: ceil(n-tokens/seq-len) windows.")
SEQ_LEN_OPT = typer.Option(None, "--seq-len", help=f"Window length (default min({SEQ_LEN}, context)).")
SPLIT = typer.Option("val", "--split", help="Data split the evaluation windows are sampled from.")
SEED = typer.Option(0, "--seed", help="Seed of the window offsets (and of the tuned-lens batches).")
BATCH = typer.Option(8, "--batch-size", help="Sequences per forward batch.")
DEVICE = typer.Option("cpu", "--device", help="cpu or cuda.")
RECOMPUTE = typer.Option(False, "--recompute", help="Recompute even when tables with the same settings are saved.")
EXCLUDE = typer.Option(1, "--exclude-first", help="Leading positions excluded from every statistic (>= 1: the sink).")
JSON = typer.Option(False, "--json", help="Print JSON instead of tables.")
OUT = typer.Option(None, "--out", help="Also write the table to this .parquet or .csv file.")
SWAP_PAIRS_MAX_OPT = typer.Option(None, "--swap-pairs-max", help="All-pairs swaps: evaluate at most N pairs spread "
                                  "evenly (default 64: every pair up to 11 layers); recorded with the table.")
SAVE = typer.Option(True, "--save/--no-save", help="Save the tables beside each checkpoint (analysis/<name>.parquet).")


CELL_WIDTH = 11  # a fmt() number ("-0.0001234", 10 characters) plus a column separator


def column_blocks(columns: list, width: int, first: int = 6) -> list[list]:
    """`columns` cut into consecutive blocks whose table fits `width` characters (a wide matrix, e.g. the
    causal matrix of a 30-layer model, is printed as several tables instead of truncating every cell)."""
    per = max(1, (max(width, 40) - first - 4) // (CELL_WIDTH + 3))
    return [columns[i:i + per] for i in range(0, len(columns), per)] or [columns]



def out_console():
    """The app's console on a terminal; a wide one for pipes and files, so columns are not truncated."""
    if console.is_terminal:
        return console

    return Console(width=max(console.width, 200))


def progress_bar(description: str, total: Optional[float], log: Optional[PlainLog] = None):
    """A transient rich progress bar on stderr (stdout stays clean for --json); plain `[m:ss]` lines on
    stderr, at least one a minute, when stderr is not a terminal (`log`: the command's clock)."""
    if is_plain(err_console):
        plain = PlainProgress(description, total, log if log is not None else PlainLog(out=err_console))
        return plain, plain.advance
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("ETA"), TimeRemainingColumn(), console=err_console, transient=True)
    task = bar.add_task(description, total=total)
    return bar, (lambda advance: bar.advance(task, advance))


def probe(names: list[str], ckpts: Optional[list[str]], grid: Optional[Path], data: Optional[Path], n_tokens: int,
          seq_len: Optional[int], split: str, seed: int, batch_size: int, device: str, recompute: bool, save: bool,
          **options) -> list[tuple[Any, dict]]:
    """Run the analyses `names` on every checkpoint of --ckpt/--grid: [(model, {name: Result})].

    With several checkpoints, one an analysis does not apply to is skipped with a line on stderr.
    """
    from depthtools.analysis.sweep import shared_sweeps  # lazy: keeps the CLI torch-free

    check_sizes(n_tokens, seq_len, batch_size)
    check_device(device)
    dirs = checkpoint_dirs(ckpts, grid)
    options = dict(options, batch_size=batch_size, seed=seed)
    done, skipped = [], []
    log = PlainLog(out=err_console)  # one clock for the command's plain lines

    def skip(exc: DepthToolsError) -> None:
        skipped.append(str(exc))
        err_console.print(f"[yellow]skipped:[/] {escape(str(exc))}", highlight=False)

    # windows, data and tokenizer are checked against config.json before the weights are read
    for ckpt_dir, model, tokens in loaded_checkpoints(
            dirs, data, n_tokens, seq_len, split, seed, cap=not N_TOKENS_GIVEN.get(),
            train_tokens=options.get("lens_tokens") if "lens_tuned" in names else None, device=device,
            dtype=ANALYSIS_DTYPE.get(), skip=skip if len(dirs) > 1 else None):
        results = {}
        try:
            if "lens_tuned" in names:  # refused before the plan and any table (HC/mHC readout "normed_sum")
                from depthtools.analysis.lens import check_tuned_lens  # lazy: keeps the CLI torch-free

                check_tuned_lens(model)
            for note in tokens.notes:
                err_console.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)
            err_console.print(plan(names, model, tokens, recompute, shared_states=True, **options), markup=False,
                              highlight=False, soft_wrap=True)
            with shared_sweeps():  # one intact forward per batch serves every pass of the probes
                for name in names:
                    total = progress_total(name, model, analysis_args(name, **options),
                                           skip_is_measured(names, model, tokens, **options))
                    bar, advance = progress_bar(f"{name} {ckpt_dir.name}", total, log)
                    with bar:
                        results[name] = run_analysis(name, model, tokens, data=data, recompute=recompute, save=save,
                                                     progress=advance, **options)
                    where = Path(ckpt_dir) / "analysis" / f"{name}.parquet"
                    if results[name].reused:
                        err_console.print(f"reused {where} (saved with the same settings; --recompute to recompute)",
                                          markup=False, highlight=False)
                    elif save:
                        err_console.print(f"saved {where}", markup=False, highlight=False)
        except DepthToolsError as exc:
            if len(dirs) == 1:
                raise
            skip(exc)
            continue
        done.append((model, results))
    if not done:
        raise DepthToolsError(f"{names[0]} applies to none of the checkpoints: {skipped[0]}")
    return done



PRUNE_OPT = typer.Option("order", "--prune", help="Pruning curve beside Gromov's: order (blocks removed in their "
                         "single-skip ΔCE order, L plans; default) or greedy (re-measured after every removal, "
                         "about L²/2 plans).")


# -- lens and ablate: one wide table over all checkpoints ----------------------------------------------
ABLATE_COLUMNS = {
    "skip": ["model", "rule", "layer", "rel_depth", "delta_ce", "kl_intact_ablated", "top1_agree", "top1_retention"],
    "swap": ["model", "layer", "layer2", "delta_ce", "perm_score", "kl_intact_ablated", "top1_agree"],
    "prune": ["model", "rule", "method", "n_removed", "layers", "delta_ce", "kl_intact_ablated", "f_tau"],
    "linear": ["model", "layer", "rel_depth", "usefulness_ratio", "significant", "delta_ce", "kl_intact_ablated"],
    "mean": ["model", "layer", "rel_depth", "delta_ce", "kl_intact_ablated", "top1_agree", "top1_retention"],
}
LENS_COLUMNS = ["model", "lens", "depth", "rel_depth", "ce", "kl_final_lens", "kl_lens_final", "entropy",
                "top1_agree", "top5_overlap", "target_rank"]
LABELS = {"rel_depth": "l/L", "delta_ce": "ΔCE", "kl_intact_ablated": "KL(intact‖abl)", "top1_agree": "top1 agree",
          "top1_retention": "top1 ret", "perm_score": "perm", "usefulness_ratio": "ratio", "n_removed": "removed",
          "kl_final_lens": "KL(final‖lens)", "kl_lens_final": "KL(lens‖final)", "top5_overlap": "top5",
          "target_rank": "rank"}


def emit_records(df: pd.DataFrame, as_json: bool, out: Optional[Path], columns: list[str], title: str,
                 notes: list[str]) -> None:
    """--json: the rows as JSON records; else a rich table of `columns` and one note per line."""
    write_out(df, out)
    if as_json:
        print_json(df.astype(object).where(df.notna(), None).to_dict(orient="records"))
        return
    columns = [c for c in columns if c in df.columns]
    rows = [[fmt(v) for v in record] for record in df[columns].astype(object).itertuples(index=False)]
    out_console().print(table(title, [LABELS.get(c, c) for c in columns], rows))
    for note in notes:
        out_console().print(note, markup=False, highlight=False)


def ablation_notes(df: pd.DataFrame, mode: str) -> list[str]:
    """One summary line per model (and rule / method) under the table."""
    notes = []
    keys = ["model", "rule"] + (["method"] if mode == "prune" else [])
    for key, group in df.groupby(keys, sort=False, dropna=False):
        label = " ".join(str(k) for k in key if k != "-")
        first = group.iloc[0]
        if mode in ("skip", "mean", "linear"):
            line = f"{label}: N_skip = {fmt(first['n_skip'])} ({fmt(first['n_skip_over_L'])}·L) from KL"
            if mode == "linear":
                line += f"; usefulness = {fmt(first['usefulness'])} (fraction of layers with ratio > 1.1)"
        elif mode == "swap":
            line = f"{label}: mean permutation score = {fmt(float(group['perm_score'].mean()))}"
            if "perm_score_se" in group and len(group) < int(first.get("n_pairs_total", len(group))):
                line += (f" ± {fmt(float(first['perm_score_se']))} (standard error: {len(group)} of "
                         f"{int(first['n_pairs_total'])} pairs; every pair: --swap-pairs-max {int(first['n_pairs_total'])}"
                         " or --protocol depthbench)")
        else:
            line = f"{label}: F_tau = {fmt(first['f_tau'])} at tau = {fmt(first['tau'])} nats"
        notes.append(line)
    return notes


@app.command("ablate", cls=ProbeCommand)
def ablate_command(
    ckpt: Optional[List[str]] = CKPT, grid: Optional[Path] = GRID,
    mode: str = typer.Option("skip", "--mode", help="skip | swap | prune | linear | mean."),
    pairs: str = typer.Option("adjacent", "--pairs", help="Swap pairs: adjacent (i, i+1; saved as ablate_swap_adjacent) "
                                                          "or all (every i < j; ablate_swap, what analyze runs)."),
    rule: Optional[List[str]] = typer.Option(None, "--rule", help="Skip rule(s) (default: every rule of the architecture)."),
    tau: float = typer.Option(0.05, "--tau", help="Prune tolerance on ΔCE in nats."),
    max_prune_steps: Optional[int] = typer.Option(None, "--max-prune-steps", help="Cap the prune curve's steps."),
    prune: str = PRUNE_OPT,
    swap_pairs_max: Optional[int] = SWAP_PAIRS_MAX_OPT,
    data: Optional[Path] = DATA, text: Optional[Path] = TEXT, n_tokens: int = N_TOKENS_OPT, seq_len: Optional[int] = SEQ_LEN_OPT, split: str = SPLIT,
    seed: int = SEED, batch_size: int = BATCH, device: str = DEVICE, recompute: bool = RECOMPUTE,
    as_json: bool = JSON, out: Optional[Path] = OUT, save: bool = SAVE, protocol: str = PROTOCOL_OPT,
):
    """Ablate blocks (skip, swap, prune, linear replacement, mean) and compare with the intact model.

    Saved as analysis/ablate_<mode> (swap: ablate_swap for all pairs, ablate_swap_adjacent), the tables
    `analyze` reads and writes. --json prints the rows as JSON records.

    Examples:
      depthtools ablate --ckpt preln_L4 --mode skip
      depthtools ablate --grid checkpoints/tiny --mode swap --pairs all --out swaps.parquet
      depthtools ablate --ckpt hc_L8 --mode prune --tau 0.05 --data data/default --json
    """
    if check_protocol(protocol):  # skip: layer_pruning, swap: permutation_score (all pairs), linear: usefulness
        return run_depthbench_probe("ablate", mode, ckpt, grid, data, n_tokens, seq_len, split, seed, batch_size,
                                    device, as_json, out, save)
    name = ablate_analysis(mode, pairs)
    done = probe([name], ckpt, grid, data, n_tokens, seq_len, split, seed, batch_size, device, recompute, save,
                 rules=rule or None, tau=tau, max_prune_steps=max_prune_steps, prune=check_prune(prune),
                 **({} if swap_pairs_max is None else {"swap_pairs_max": swap_pairs_max}))
    df = pd.concat([results[name].table for _, results in done], ignore_index=True)
    emit_records(df, as_json, out, ABLATE_COLUMNS[mode], f"ablate --mode {mode}", ablation_notes(df, mode))


@app.command("lens", cls=ProbeCommand)
def lens_command(
    ckpt: Optional[List[str]] = CKPT, grid: Optional[Path] = GRID,
    tuned: bool = typer.Option(False, "--tuned", help="Also train (or reuse) a tuned lens and report it."),
    lens_steps: int = typer.Option(250, "--lens-steps", help="Tuned-lens training steps."),
    lens_tokens: int = typer.Option(65536, "--lens-tokens", help="Training-split tokens for the tuned lens."),
    lens_lr: float = typer.Option(1e-3, "--lens-lr", help="Tuned-lens AdamW learning rate."),
    data: Optional[Path] = DATA, text: Optional[Path] = TEXT, n_tokens: int = N_TOKENS_OPT, seq_len: Optional[int] = SEQ_LEN_OPT, split: str = SPLIT,
    seed: int = SEED, batch_size: int = BATCH, device: str = DEVICE, recompute: bool = RECOMPUTE,
    as_json: bool = JSON, out: Optional[Path] = OUT, save: bool = SAVE, protocol: str = PROTOCOL_OPT,
):
    """Logit lens (and --tuned lens) at every depth: CE, KL both ways, entropy, agreement, target rank.

    kl_final_lens = KL(p_final || p_lens) (tuned-lens direction); kl_lens_final = KL(p_lens || p_final).
    Saved as analysis/lens_logit (+ lens_logit_summary, prediction_depth) and, with --tuned, lens_tuned
    (+ _summary, prediction_depth_tuned): the tables `analyze` reads and writes. --json prints the
    per-depth rows, with the per-model summary columns, as JSON records.

    Examples:
      depthtools lens --ckpt preln_L4
      depthtools lens --grid checkpoints/tiny --tuned --out lens.parquet
    """
    if check_protocol(protocol):  # DepthBench's logit_lens; it has no tuned lens
        return run_depthbench_probe("lens", "tuned" if tuned else None, ckpt, grid, data, n_tokens, seq_len, split,
                                    seed, batch_size, device, as_json, out, save)
    names = ["lens_logit"] + (["lens_tuned"] if tuned else [])
    done = probe(names, ckpt, grid, data, n_tokens, seq_len, split, seed, batch_size, device, recompute, save,
                 lens_steps=lens_steps, lens_tokens=lens_tokens, lens_lr=lens_lr)
    frames = []
    for _, results in done:
        for name in names:
            depths, summary = results[name].tables[name], results[name].tables[f"{name}_summary"]
            frames.append(depths.assign(**{k: summary[k].iloc[0]
                                           for k in ("pd_mean", "pd_mean_over_L", "pd_loss_spearman", "n_lens")}))
    df = pd.concat(frames, ignore_index=True)
    notes = [
        f"{m} {lens} lens: mean prediction depth {fmt(g['pd_mean'].iloc[0])} "
        f"({fmt(g['pd_mean_over_L'].iloc[0])}·L), Spearman(PD, token loss) = "
        f"{fmt(g['pd_loss_spearman'].iloc[0])}, N_lens = {fmt(g['n_lens'].iloc[0])}"
        for (m, lens), g in df.groupby(["model", "lens"], sort=False)
    ]
    emit_records(df, as_json, out, LENS_COLUMNS, "lens" + (" (logit + tuned)" if tuned else " (logit)"), notes)


# -- causal, similarity, contrib, routing: long tables shown per checkpoint ----------------------------
def model_rows(df) -> list[list[str]]:
    sub = df[df["unit"] == "model"]
    return [[m, fmt(v)] for m, v in zip(sub["metric"], sub["value"])]


def per_layer_table(df, title: str, metrics: list[str]):
    sub = df[(df["unit"] != "model") & df["layer_j"].isna() & df["metric"].isin(metrics)]
    wide = sub.pivot_table(index="layer", columns="metric", values="value", aggfunc="first")
    cols = [m for m in metrics if m in wide.columns]
    return table(title, ["layer", *cols], [[str(l), *(fmt(float(wide.loc[l, c])) for c in cols)] for l in wide.index])


def emit_long(name: str, done: list, as_json: bool, out: Optional[Path], show: Callable) -> None:
    """--json: {"table": rows, "notes": [...], "settings": {...}} (settings: a list, one per checkpoint, when
    several); else `show(model, df)` and the notes, per checkpoint."""
    frames = [results[name].table for _, results in done]
    df = pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0]
    write_out(df, out)
    notes = [str(n) for f in frames for n in f.attrs.get("notes", [])]
    if as_json:
        settings = [results[name].settings for _, results in done]
        print_json({"table": json.loads(df.to_json(orient="records")), "notes": notes,
                    "settings": settings[0] if len(settings) == 1 else settings})
        return
    for (model, _), frame in zip(done, frames):
        show(model, frame)
        for note in frame.attrs.get("notes", []):
            console.print(f"[yellow]note:[/] {escape(str(note))}", highlight=False)


@app.command("causal", cls=ProbeCommand)
def causal_command(
    ckpt: Optional[List[str]] = CKPT, grid: Optional[Path] = GRID,
    rule: Optional[str] = typer.Option(None, "--rule", help="Skip rule (default: the architecture's first)."),
    future: bool = typer.Option(True, "--future/--no-future", help="Also the Csordás future-effect matrix."),
    cuts: Optional[str] = typer.Option(None, "--cuts", help="Future cut points, e.g. 8,16 (default: up to 4 of 8,16,…)."),
    data: Optional[Path] = DATA, text: Optional[Path] = TEXT, n_tokens: int = N_TOKENS_OPT, seq_len: Optional[int] = SEQ_LEN_OPT, split: str = SPLIT,
    seed: int = SEED, batch_size: int = BATCH, exclude_first: int = EXCLUDE, device: str = DEVICE,
    recompute: bool = RECOMPUTE, as_json: bool = JSON, out: Optional[Path] = OUT, save: bool = SAVE,
    protocol: str = PROTOCOL_OPT,
):
    """Causal score C(s,l) of skipping block s on every later update (DepthBench), + future effect.

    Example: depthtools causal --ckpt preln_L8 --n-tokens 2048 --seq-len 64
    """
    if check_protocol(protocol):  # DepthBench's causal_score with its skip rule, + mean/max/top-10
        if rule is not None:
            raise DepthToolsError("--rule does not apply to --protocol depthbench (DepthBench's skip rule is fixed "
                                  "per family: identity, MoDA zero, Full and Block AttnRes depthbench)")
        return run_depthbench_probe("causal", None, ckpt, grid, data, n_tokens, seq_len, split, seed, batch_size,
                                    device, as_json, out, save)
    cut_list = parse_list(cuts, "int", "--cuts", "8,16")
    done = probe(["causal"], ckpt, grid, data, n_tokens, seq_len, split, seed, batch_size, device, recompute, save,
                 exclude_first=exclude_first, rule=rule, future=future, cuts=cut_list)

    def show(model, df):
        L = model.n_layer
        sub = df[df["metric"] == "causal_score"]
        M = {(int(s), int(l)): v for s, l, v in zip(sub["layer"], sub["layer_j"], sub["value"])}
        title = f"causal score C(s,l) — {Path(model.checkpoint_dir).name} (rows: skipped s)"
        for block in column_blocks(list(range(1, L)), console.width):  # never squeezed into "2…" cells
            part = f" — columns l={block[0]}..{block[-1]}" if len(block) < L - 1 else ""
            console.print(table(title + part, ["s", *(str(l) for l in block)],
                                [[str(s), *(fmt(M.get((s, l))) if l > s else "" for l in block)]
                                 for s in range(min(L - 1, block[-1]))]))
        console.print(table("summary", ["metric", "value"], model_rows(df)))

    emit_long("causal", done, as_json, out, show)


@app.command("similarity", cls=ProbeCommand)
def similarity_command(
    ckpt: Optional[List[str]] = CKPT, grid: Optional[Path] = GRID,
    cka_batch: int = typer.Option(256, "--cka-batch", help="Tokens per CKA minibatch."),
    outlier_k: int = typer.Option(1, "--outlier-k", help="Massive dims removed for the *_no_outlier ranks."),
    data: Optional[Path] = DATA, text: Optional[Path] = TEXT, n_tokens: int = N_TOKENS_OPT, seq_len: Optional[int] = SEQ_LEN_OPT, split: str = SPLIT,
    seed: int = SEED, batch_size: int = BATCH, exclude_first: int = EXCLUDE, device: str = DEVICE,
    recompute: bool = RECOMPUTE, as_json: bool = JSON, out: Optional[Path] = OUT, save: bool = SAVE,
    protocol: str = PROTOCOL_OPT,
):
    """Angular distance, minibatch CKA (debiased/biased/zscore), effective rank and token collapse per depth.

    Example: depthtools similarity --ckpt hc_L8 --exclude-first 16 --json
    """
    if check_protocol(protocol):  # DepthBench's angular_distance (all pairs) and token_collapse
        return run_depthbench_probe("similarity", None, ckpt, grid, data, n_tokens, seq_len, split, seed, batch_size,
                                    device, as_json, out, save)
    done = probe(["similarity"], ckpt, grid, data, n_tokens, seq_len, split, seed, batch_size, device, recompute, save,
                 exclude_first=exclude_first, cka_batch=cka_batch, outlier_k=outlier_k)

    def show(model, df):
        console.print(per_layer_table(df, f"depth geometry — {Path(model.checkpoint_dir).name}", [
            "adjacent_cka_debiased", "adjacent_angular_distance", "effective_rank", "participation_ratio",
            "effective_rank_no_outlier", "collapse_effective_rank", "collapse_mean_cosine"]))
        console.print(table("summary", ["metric", "value"], model_rows(df)))

    emit_long("similarity", done, as_json, out, show)


@app.command("contrib", cls=ProbeCommand)
def contrib_command(
    ckpt: Optional[List[str]] = CKPT, grid: Optional[Path] = GRID,
    jacobian: bool = typer.Option(True, "--jacobian/--no-jacobian", help="Block Jacobian identity deviation (JVPs)."),
    probes: int = typer.Option(2, "--probes", help="Rademacher probes per batch and block."),
    data: Optional[Path] = DATA, text: Optional[Path] = TEXT, n_tokens: int = N_TOKENS_OPT, seq_len: Optional[int] = SEQ_LEN_OPT, split: str = SPLIT,
    seed: int = SEED, batch_size: int = BATCH, exclude_first: int = EXCLUDE, device: str = DEVICE,
    recompute: bool = RECOMPUTE, as_json: bool = JSON, out: Optional[Path] = OUT, save: bool = SAVE,
    protocol: str = PROTOCOL_OPT,
):
    """Relative contribution and residual cosine per block (attention/MLP split where additive), Jacobian deviation.

    Example: depthtools contrib --ckpt preln_L8 --probes 4
    """
    if check_protocol(protocol):  # DepthBench's jacobian_norm
        return run_depthbench_probe("contrib", None if jacobian else "no-jacobian", ckpt, grid, data, n_tokens,
                                    seq_len, split, seed, batch_size, device, as_json, out, save)
    done = probe(["contrib"], ckpt, grid, data, n_tokens, seq_len, split, seed, batch_size, device, recompute, save,
                 exclude_first=exclude_first, jacobian=jacobian, probes=probes)

    def show(model, df):
        console.print(per_layer_table(df, f"contributions — {Path(model.checkpoint_dir).name}", [
            "relative_contribution", "residual_cosine", "state_cosine", "attn_relative", "mlp_relative",
            "additive", "jacobian_deviation"]))
        console.print(table("summary", ["metric", "value"], model_rows(df)))

    emit_long("contrib", done, as_json, out, show)


def show_expert_routing(df, name: str) -> None:
    """A mixture-of-experts model's expert routing: per MoE block, and the skip matrix (rows: skipped block s)."""
    console.print(per_layer_table(df, f"expert routing per MoE block — {name}", ["router_entropy", "expert_load_max"]))
    sub = df[df["metric"] == "routing_change_after_skip"]
    if sub.empty:
        return
    M = {(int(s), int(l)): v for s, l, v in zip(sub["layer"], sub["layer_j"], sub["value"])}
    later = sorted({l for _, l in M})
    for block in column_blocks(later, console.width):
        console.print(table(f"top-k experts changed, block s skipped — {name}",
                            ["s", *(str(l) for l in block)],
                            [[str(s), *(fmt(M.get((s, l))) if (s, l) in M else "" for l in block)]
                             for s in sorted({s for s, _ in M})]))


@app.command("routing", cls=ProbeCommand)
def routing_command(
    ckpt: Optional[List[str]] = CKPT, grid: Optional[Path] = GRID,
    long_range_k: int = typer.Option(4, "--long-range-k", help="Long-range mass: sources more than k sublayers back."),
    data: Optional[Path] = DATA, text: Optional[Path] = TEXT, n_tokens: int = N_TOKENS_OPT, seq_len: Optional[int] = SEQ_LEN_OPT, split: str = SPLIT,
    seed: int = SEED, batch_size: int = BATCH, exclude_first: int = EXCLUDE, device: str = DEVICE,
    recompute: bool = RECOMPUTE, as_json: bool = JSON, out: Optional[Path] = OUT, save: bool = SAVE,
    protocol: str = PROTOCOL_OPT,
):
    """Native depth-routing statistics (HC/mHC unfolded weights, AttnRes maps, DenseFormer DWA), and for
    mixture-of-experts models the expert routing (load, router entropy, top-k change when a block is skipped).

    Example: depthtools routing --ckpt hc_L8 --json
    """
    if check_protocol(protocol):  # DepthBench has none: a one-line error
        return run_depthbench_probe("routing", None, ckpt, grid, data, n_tokens, seq_len, split, seed, batch_size,
                                    device, as_json, out, save)
    done = probe(["routing"], ckpt, grid, data, n_tokens, seq_len, split, seed, batch_size, device, recompute, save,
                 exclude_first=exclude_first, long_range_k=long_range_k)

    def show(model, df):
        if df.empty:
            return
        name = Path(model.checkpoint_dir).name
        if df["metric"].isin(["mean_source_lag"]).any():
            console.print(per_layer_table(df, f"routing per consumer (sublayer depth) — {name}",
                                          ["mean_source_lag", "source_entropy", "long_range_mass", "max_weight"]))
        if df["metric"].isin(["router_entropy"]).any():
            show_expert_routing(df, name)
        console.print(table("summary", ["metric", "value"], model_rows(df)))

    emit_long("routing", done, as_json, out, show)


@app.command("depthbench", cls=ProbeCommand)
def depthbench_command(
    ckpt: Optional[List[str]] = CKPT, grid: Optional[Path] = GRID,
    metrics: Optional[str] = typer.Option(None, "--metrics", help="Comma-separated DepthBench metrics (default: "
                                          "every one it defines for the architecture): angular_distance, causal_score, "
                                          "permutation_score, layer_pruning, usefulness_score, token_collapse, "
                                          "jacobian, logit_lens."),
    data: Optional[Path] = DATA, text: Optional[Path] = TEXT, n_tokens: int = typer.Option(8192, "--n-tokens", help="Evaluation tokens."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help="Window length (default min(512, context))."),
    split: str = SPLIT, seed: int = SEED,
    batch_size: int = typer.Option(4, "--batch-size", help="DepthBench's micro-batch size."),
    device: str = DEVICE, as_json: bool = JSON, out: Optional[Path] = OUT, save: bool = SAVE,
):
    """DepthBench's metrics as its analysis scripts compute them (= analyze --protocol depthbench).

    Its skip rules (Full and Block AttnRes `depthbench`, MoDA zero), its depth states (HC streams concatenated or folded),
    all-pairs permutation with its mean, causal mean/max/top-10, every position of its windows.

    Example: depthtools depthbench --ckpt attnres_L8 --metrics causal_score,layer_pruning --n-tokens 4096
    """
    from depthtools.analysis.depthbench import depthbench_checkpoint  # lazy: keeps the CLI torch-free

    check_sizes(n_tokens, seq_len, batch_size)
    check_device(device)
    emit_depthbench([depthbench_checkpoint(d, data, n_tokens, seq_len, split, seed, metrics, batch_size, device, save)
                     for d in checkpoint_dirs(ckpt, grid)], as_json, out)
