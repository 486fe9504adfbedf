"""Depth-probe commands: `lens` and `ablate`, on one checkpoint, several, or a whole grid.

Both sample one fixed token set per data directory (seeded windows of its val split), so every
model of a grid is measured on the same tokens; tables are printed with rich (or --json), written
with --out, and saved beside each checkpoint under analysis/ with their settings (reused when the
settings, tokens and weights match, unless --recompute).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, List, Optional

import pandas as pd
import typer
from rich.markup import escape

from cli.main import app, console, err_console, print_json, table
from depthtools.errors import DepthToolsError

DEFAULT_SEQ_LEN = 128

CKPT_HELP = "Checkpoint path or cell name (repeatable), e.g. preln_L4."
GRID_HELP = "Run every checkpoint found under this directory."
DATA_HELP = "Prepared data directory (default: the one recorded in each checkpoint's config.json)."

ABLATE_COLUMNS = {
    "skip": ["model", "rule", "layer", "rel_depth", "delta_ce", "kl_intact_ablated", "top1_agree", "top1_retention"],
    "swap": ["model", "layer", "layer2", "delta_ce", "perm_score", "kl_intact_ablated", "top1_agree"],
    "prune": ["model", "rule", "method", "n_removed", "layers", "delta_ce", "kl_intact_ablated", "f_tau"],
    "linear": ["model", "layer", "rel_depth", "usefulness_ratio", "significant", "delta_ce", "kl_intact_ablated"],
    "mean": ["model", "layer", "rel_depth", "delta_ce", "kl_intact_ablated", "top1_agree", "top1_retention"],
}
LENS_COLUMNS = ["model", "lens", "depth", "rel_depth", "ce", "kl_final_lens", "kl_lens_final", "entropy",
                "top1_agree", "top5_overlap", "target_rank"]


# -- shared plumbing -------------------------------------------------------------------------------
def checkpoint_dirs(ckpts: list[str], grid: Optional[Path]) -> list[Path]:
    """Resolve --ckpt names and --grid into checkpoint directories (in order, without repeats)."""
    from depthtools.checkpoint import CONFIG, WEIGHTS, resolve

    if not ckpts and grid is None:
        raise DepthToolsError("give --ckpt NAME (repeatable) or --grid DIR")
    dirs = [resolve(name) for name in ckpts]
    if grid is not None:
        if not grid.is_dir():
            raise DepthToolsError(f"--grid {grid} is not a directory")
        found = sorted(p.parent for p in grid.rglob(CONFIG) if (p.parent / WEIGHTS).is_file())
        if not found:
            raise DepthToolsError(f"no checkpoints (config.json + model.safetensors) under --grid {grid}")
        dirs += found
    unique: dict[str, Path] = {}
    for d in dirs:
        unique.setdefault(str(Path(d).resolve()), Path(d))
    return list(unique.values())


def check_device(device: str) -> str:
    import torch

    if device not in ("cpu", "cuda"):
        raise DepthToolsError(f"unknown device {device!r}; valid: cpu, cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise DepthToolsError("--device cuda requested but no CUDA device is available; use --device cpu")
    return device


def data_dir_for(ckpt_dir: Path, data: Optional[Path]) -> Path:
    """--data, else the data directory recorded in the checkpoint, checked against the checkpoint's
    tokenizer and data fingerprint (`depthtools.analysis.tokens.checkpoint_data_dir`)."""
    from depthtools.analysis.tokens import checkpoint_data_dir

    return checkpoint_data_dir(ckpt_dir, data)


class TokenSets:
    """One sampled token set per (data dir, split, sizes, seed): identical tokens for a whole grid."""

    def __init__(self, n_tokens: int, seq_len: Optional[int], seed: int):
        if n_tokens < 1:
            raise DepthToolsError(f"empty token set: --tokens must be >= 1, got {n_tokens}")
        if seq_len is not None and seq_len < 2:
            raise DepthToolsError(f"--seq-len must be >= 2 (position 0 is not scored), got {seq_len}")
        self.n_tokens, self.seq_len, self.seed = n_tokens, seq_len, seed
        self._cache: dict = {}

    def for_model(self, model, data_dir: Path, split: str = "val", n_tokens: Optional[int] = None):
        from depthtools.analysis.tokens import sample_windows

        context = model.config.max_seq_len
        seq_len = self.seq_len if self.seq_len is not None else min(DEFAULT_SEQ_LEN, context)
        if seq_len > context:
            raise DepthToolsError(
                f"--seq-len {seq_len} exceeds the context {context} of {model_name(model)}; use --seq-len <= {context}"
            )
        key = (str(Path(data_dir).resolve()), split, n_tokens or self.n_tokens, seq_len, self.seed)
        if key not in self._cache:
            self._cache[key] = sample_windows(data_dir, key[2], seq_len, split=split, seed=self.seed)
        return self._cache[key]


def model_name(model) -> str:
    from depthtools.analysis.tables import model_columns

    return model_columns(model)["model"]


def progress_bar(description: str, total: Optional[float]):
    """A transient rich progress bar on stderr (stdout stays clean for --json)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=err_console, transient=True)
    task = bar.add_task(description, total=total)
    return bar, (lambda advance: bar.advance(task, advance))


def cached_or_run(ckpt_dir: Path, name: str, settings: dict, save: bool, recompute: bool,
                  compute: Callable[[], pd.DataFrame]) -> pd.DataFrame:
    """The saved table when settings match (unless --recompute), else compute (and save)."""
    from depthtools.analysis.tables import load_table, save_table

    if not recompute:
        saved = load_table(ckpt_dir, name, settings)
        if saved is not None:
            return saved
    df = compute()
    if save:
        save_table(df, ckpt_dir, name, settings)
    return df


def _fmt(value) -> str:
    if value is None or (isinstance(value, float) and value != value):
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


LABELS = {"rel_depth": "l/L", "delta_ce": "ΔCE", "kl_intact_ablated": "KL(intact‖abl)", "top1_agree": "top1 agree",
          "top1_retention": "top1 ret", "perm_score": "perm", "usefulness_ratio": "ratio", "n_removed": "removed",
          "kl_final_lens": "KL(final‖lens)", "kl_lens_final": "KL(lens‖final)", "top5_overlap": "top5",
          "target_rank": "rank"}


def show(df: pd.DataFrame, columns: list[str], title: str) -> None:
    """A rich table of the chosen columns (short labels for the long metric names)."""
    columns = [c for c in columns if c in df.columns]
    rows = [[_fmt(v) for v in record] for record in df[columns].astype(object).itertuples(index=False)]
    out_console().print(table(title, [LABELS.get(c, c) for c in columns], rows))


def out_console():
    """The app's console on a terminal; a wide one for pipes and files, so columns are not truncated."""
    if console.is_terminal:
        return console
    from rich.console import Console

    return Console(width=max(console.width, 200))


def emit(df: pd.DataFrame, as_json: bool, out: Optional[Path], columns: list[str], title: str, notes: list[str]) -> None:
    from depthtools.analysis.tables import write_frame

    if out is not None:
        write_frame(df, out)
    if as_json:
        print_json(df.astype(object).where(df.notna(), None).to_dict(orient="records"))
        return
    show(df, columns, title)
    for note in notes:
        out_console().print(note, highlight=False)
    if out is not None:
        out_console().print(f"wrote {out}", highlight=False)


def load_model(ckpt_dir: Path, device: str):
    from depthtools.checkpoint import load

    return load(ckpt_dir, device=device)


# -- ablate ----------------------------------------------------------------------------------------
def ablation_notes(df: pd.DataFrame, mode: str) -> list[str]:
    """One summary line per model (and rule / method) under the table."""
    notes = []
    keys = ["model", "rule"] + (["method"] if mode == "prune" else [])
    for key, group in df.groupby(keys, sort=False, dropna=False):
        label = " ".join(str(k) for k in key if k != "-")
        first = group.iloc[0]
        if mode in ("skip", "mean", "linear"):
            line = f"{label}: N_skip = {_fmt(first['n_skip'])} ({_fmt(first['n_skip_over_L'])}·L) from KL"
            if mode == "linear":
                line += f"; usefulness = {_fmt(first['usefulness'])} (fraction of layers with ratio > 1.1)"
        elif mode == "swap":
            line = f"{label}: mean permutation score = {_fmt(float(group['perm_score'].mean()))}"
        else:
            line = f"{label}: F_tau = {_fmt(first['f_tau'])} at tau = {_fmt(first['tau'])} nats"
        notes.append(line)
    return notes


@app.command("ablate")
def ablate_command(
    ckpt: Optional[List[str]] = typer.Option(None, "--ckpt", help=CKPT_HELP),
    grid: Optional[Path] = typer.Option(None, "--grid", help=GRID_HELP),
    mode: str = typer.Option("skip", "--mode", help="skip | swap | prune | linear | mean."),
    pairs: str = typer.Option("adjacent", "--pairs", help="Swap pairs: adjacent (i, i+1) or all (every i < j)."),
    rule: Optional[List[str]] = typer.Option(None, "--rule", help="Skip rule(s) (default: every rule of the architecture)."),
    tau: float = typer.Option(0.05, "--tau", help="Prune tolerance on ΔCE in nats."),
    max_prune_steps: Optional[int] = typer.Option(None, "--max-prune-steps", help="Cap the greedy prune curve."),
    data: Optional[Path] = typer.Option(None, "--data", help=DATA_HELP),
    n_tokens: int = typer.Option(8192, "--tokens", help="Evaluation tokens (windows of --seq-len)."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help=f"Window length (default min({DEFAULT_SEQ_LEN}, context))."),
    batch_size: int = typer.Option(8, "--batch-size", help="Sequences per batch."),
    seed: int = typer.Option(0, "--seed", help="Seed of the token windows."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
    as_json: bool = typer.Option(False, "--json", help="Print the table as JSON records."),
    out: Optional[Path] = typer.Option(None, "--out", help="Also write the table (.parquet or .csv)."),
    save: bool = typer.Option(True, "--save/--no-save", help="Save beside each checkpoint (analysis/ablate_<mode>)."),
    recompute: bool = typer.Option(False, "--recompute", help="Ignore a saved table with the same settings."),
):
    """Ablate blocks (skip, swap, prune, linear replacement, mean) and compare with the intact model.

    Examples:
      depthtools ablate --ckpt preln_L4 --mode skip
      depthtools ablate --grid checkpoints/tiny --mode swap --pairs all --out swaps.parquet
      depthtools ablate --ckpt hc_L8 --mode prune --tau 0.05 --data data/default --json
    """
    from depthtools.analysis import ablate, token_fingerprint
    from depthtools.analysis.ablate import UnsupportedAblation, check_mode, n_plans, swap_pairs
    from depthtools.analysis.lens import model_fingerprint

    check_mode(mode)
    swap_pairs(2, pairs)
    check_device(device)
    if batch_size < 1:
        raise DepthToolsError(f"--batch-size must be >= 1, got {batch_size}")
    dirs = checkpoint_dirs(ckpt or [], grid)
    token_sets = TokenSets(n_tokens, seq_len, seed)
    frames, skipped = [], []
    for ckpt_dir in dirs:
        model = load_model(ckpt_dir, device)
        tokens = token_sets.for_model(model, data_dir_for(ckpt_dir, data))
        name = f"ablate_{mode}" + ("_all" if mode == "swap" and pairs == "all" else "")
        settings = {"analysis": "ablate", "mode": mode, "pairs": pairs, "rules": rule or None, "tau": tau,
                    "max_prune_steps": max_prune_steps, "tokens": token_fingerprint(tokens),
                    "batch_size": batch_size, "model": model_fingerprint(model)}
        bar, advance = progress_bar(f"{mode} {model_name(model)}", n_plans(model, mode, pairs, rule or None))

        def compute():
            with bar:
                return ablate(model, tokens, mode=mode, pairs=pairs, rules=rule or None, tau=tau,
                              batch_size=batch_size, max_prune_steps=max_prune_steps, progress=advance)

        try:
            frames.append(cached_or_run(ckpt_dir, name, settings, save, recompute, compute))
        except UnsupportedAblation as exc:
            if len(dirs) == 1:
                raise
            skipped.append(str(exc))
            err_console.print(f"[yellow]skipped:[/] {escape(str(exc))}", highlight=False)
    if not frames:
        raise DepthToolsError(f"mode {mode!r} is unsupported for every checkpoint: {skipped[0]}")
    df = pd.concat(frames, ignore_index=True)
    emit(df, as_json, out, ABLATE_COLUMNS[mode], f"ablate --mode {mode}", ablation_notes(df, mode))


# -- lens ------------------------------------------------------------------------------------------
@app.command("lens")
def lens_command(
    ckpt: Optional[List[str]] = typer.Option(None, "--ckpt", help=CKPT_HELP),
    grid: Optional[Path] = typer.Option(None, "--grid", help=GRID_HELP),
    tuned: bool = typer.Option(False, "--tuned", help="Also train (or reuse) a tuned lens and report it."),
    lens_steps: int = typer.Option(250, "--lens-steps", help="Tuned-lens training steps."),
    lens_tokens: int = typer.Option(65536, "--lens-tokens", help="Training-split tokens for the tuned lens."),
    lens_lr: float = typer.Option(1e-3, "--lens-lr", help="Tuned-lens AdamW learning rate."),
    data: Optional[Path] = typer.Option(None, "--data", help=DATA_HELP),
    n_tokens: int = typer.Option(8192, "--tokens", help="Evaluation tokens (windows of --seq-len)."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help=f"Window length (default min({DEFAULT_SEQ_LEN}, context))."),
    batch_size: int = typer.Option(8, "--batch-size", help="Sequences per batch."),
    seed: int = typer.Option(0, "--seed", help="Seed of the token windows (and the tuned-lens batches)."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
    as_json: bool = typer.Option(False, "--json", help="Print the per-depth table (with per-model summary columns) as JSON records."),
    out: Optional[Path] = typer.Option(None, "--out", help="Also write the per-depth table (.parquet or .csv)."),
    save: bool = typer.Option(True, "--save/--no-save", help="Save beside each checkpoint (analysis/lens, lens_summary)."),
    recompute: bool = typer.Option(False, "--recompute", help="Ignore saved tables with the same settings."),
):
    """Logit lens (and --tuned lens) at every depth: CE, KL both ways, entropy, agreement, target rank.

    kl_final_lens = KL(p_final || p_lens) (tuned-lens direction); kl_lens_final = KL(p_lens || p_final).

    Examples:
      depthtools lens --ckpt preln_L4
      depthtools lens --grid checkpoints/tiny --tuned --out lens.parquet
    """
    from depthtools.analysis import fit_tuned_lens, lens_analysis, token_fingerprint
    from depthtools.analysis.lens import model_fingerprint

    check_device(device)
    if batch_size < 1:
        raise DepthToolsError(f"--batch-size must be >= 1, got {batch_size}")
    dirs = checkpoint_dirs(ckpt or [], grid)
    token_sets = TokenSets(n_tokens, seq_len, seed)
    depth_frames = []
    for ckpt_dir in dirs:
        model = load_model(ckpt_dir, device)
        data_dir = data_dir_for(ckpt_dir, data)
        tokens = token_sets.for_model(model, data_dir)
        settings = {"analysis": "lens", "tuned": tuned, "tokens": token_fingerprint(tokens), "batch_size": batch_size,
                    "model": model_fingerprint(model)}
        if tuned:
            settings.update(lens_steps=lens_steps, lens_tokens=lens_tokens, lens_lr=lens_lr, seed=seed)
        name = model_name(model)

        def compute() -> pd.DataFrame:
            results = []
            bar, advance = progress_bar(f"logit lens {name}", 1)
            with bar:
                results.append(lens_analysis(model, tokens, batch_size=batch_size, progress=advance))
            if tuned:
                train = token_sets.for_model(model, data_dir, split="train", n_tokens=lens_tokens)
                bar, advance = progress_bar(f"tuned lens {name}", lens_steps)
                with bar:
                    translators = fit_tuned_lens(model, train, ckpt_dir, steps=lens_steps, lr=lens_lr,
                                                 batch_size=batch_size, seed=seed, progress=advance)
                results.append(lens_analysis(model, tokens, translators, batch_size=batch_size))
            depths = pd.concat([r.depths for r in results], ignore_index=True)
            summary = pd.concat([r.summary for r in results], ignore_index=True)
            return depths.assign(**{k: depths["lens"].map(summary.set_index("lens")[k])
                                    for k in ("pd_mean", "pd_mean_over_L", "pd_loss_spearman", "n_lens")})

        df = cached_or_run(ckpt_dir, "lens" + ("_tuned" if tuned else ""), settings, save, recompute, compute)
        depth_frames.append(df)
    df = pd.concat(depth_frames, ignore_index=True)
    notes = [
        f"{m} {lens} lens: mean prediction depth {_fmt(g['pd_mean'].iloc[0])} "
        f"({_fmt(g['pd_mean_over_L'].iloc[0])}·L), Spearman(PD, token loss) = "
        f"{_fmt(g['pd_loss_spearman'].iloc[0])}, N_lens = {_fmt(g['n_lens'].iloc[0])}"
        for (m, lens), g in df.groupby(["model", "lens"], sort=False)
    ]
    emit(df, as_json, out, LENS_COLUMNS, "lens" + (" (logit + tuned)" if tuned else " (logit)"), notes)
