"""Training commands: `depthtools train` (one cell) and `depthtools grid train` (a whole grid).

Thin layers over `depthtools.train.train_cell` / `train_grid`, with a rich progress display
(cell i/N, tokens, loss, tok/s, ETA). Interrupted runs resume when the same command is repeated.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Optional

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from cli.main import app, console, grid_app, print_json, table
from depthtools.errors import DepthToolsError


class TrainDisplay:
    """A `progress` callback drawing one bar for the grid and one for the current cell."""

    def __init__(self, total_tokens: int, n_cells: int):
        self.progress = Progress(
            TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=console,
        )
        self.grid = self.progress.add_task(f"grid 0/{n_cells}", total=max(1, total_tokens), info="")
        self.cell = None
        self.done_tokens = 0  # tokens of cells finished in this call
        self.n_cells = n_cells

    def __enter__(self) -> "TrainDisplay":
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def __call__(self, event: dict[str, Any]) -> None:
        index = event.get("cell_index", 0) + 1
        kind = event["event"]
        if kind == "skip":
            console.print(f"[dim]skip[/] {event['cell']} (finished)")
            return
        if kind == "start":
            if self.cell is not None:
                self.progress.remove_task(self.cell)
            total = event["total_steps"]
            self.cell = self.progress.add_task(f"{event['cell']}", total=total, completed=event["step"], info="")
            self.progress.update(self.grid, description=f"cell {index}/{self.n_cells}")
            if event["step"]:
                console.print(f"resume {event['cell']} from step {event['step']}")
            self.progress.update(self.grid, completed=self.done_tokens + event.get("tokens", 0))
            return
        if kind == "step":
            info = f"loss {event['train_loss']:.3f}"
            if event.get("val_loss") is not None:
                info += f" val {event['val_loss']:.3f}"
            if event.get("tokens_per_s"):
                info += f" {event['tokens_per_s']:,.0f} tok/s"
            self.progress.update(self.cell, completed=event["step"], info=info)
            self.progress.update(self.grid, completed=self.done_tokens + event["tokens"], info=f"{event['tokens']:,} tok")
            return
        if kind == "done":
            self.done_tokens += event["tokens"]
            val = event.get("val_loss")
            console.print(f"[green]done[/] {event['cell']}: val loss {val:.4f}" if val is not None else f"done {event['cell']}")


def _display(total_tokens: int, n_cells: int, quiet: bool):
    """The rich display, or a silent stand-in when the output must stay machine-readable (--json)."""
    return contextlib.nullcontext(None) if quiet else TrainDisplay(total_tokens, n_cells)


@contextlib.contextmanager
def _interruptible():
    """Ctrl-C ends with one line saying how to resume instead of a traceback (exit code 130)."""
    try:
        yield
    except KeyboardInterrupt:
        console.print("interrupted; run the same command again to resume from the last checkpoint")
        raise typer.Exit(130) from None


def _data_dir(data: str, tokenizer: str, data_root: Path) -> Path:
    """A prepared dataset folder: `data` itself if it holds meta.json, else prepare corpus `data`."""
    from depthtools.data import prepare

    if (Path(data) / "meta.json").is_file():
        return Path(data)
    return prepare(data, out_dir=data_root, tokenizer=tokenizer, log=lambda m: console.print(m, markup=False, highlight=False))


def _recipe(preset_recipe: Optional[str], overrides: dict[str, Any]):
    from depthtools.config import TrainConfig
    from depthtools.presets import get_preset

    base = dict(get_preset(preset_recipe).train) if preset_recipe else {}
    given = {k: v for k, v in overrides.items() if v is not None}
    if "tokens" in given:
        base.pop("tokens_per_param", None)
    if "tokens_per_param" in given:
        base.pop("tokens", None)
    return TrainConfig.from_dict({**base, **given})


def _model_config(arch, layers, budget, d_model, n_heads, vocab_size, max_seq_len, preset_recipe, tolerance):
    """The cell's ModelConfig: width from --d-model, or the iso-parameter width for --budget."""
    from depthtools.config import ModelConfig
    from depthtools.grid import plan_grid
    from depthtools.presets import get_preset

    if (budget is None) == (d_model is None):
        raise DepthToolsError("give exactly one of --budget (width planned for the budget) or --d-model")
    plan = dict(get_preset(preset_recipe).plan) if preset_recipe else {}
    heads = n_heads or plan.get("n_heads", 16)
    if d_model is not None:
        return ModelConfig(arch=arch, d_model=d_model, n_layer=layers, n_heads=heads, vocab_size=vocab_size,
                           max_seq_len=max_seq_len)
    shape = {k: plan[k] for k in ("head_dim_multiple", "ffn_multiple") if k in plan}
    cells = plan_grid(arch, budget, vocab_size=vocab_size, layers=[layers], n_heads=heads, max_seq_len=max_seq_len,
                      tolerance=tolerance if tolerance is not None else plan.get("tolerance", 0.05), **shape)
    return cells[0].model_config()


@app.command("train")
def train_command(
    arch: str = typer.Option(..., "--arch", help="Architecture (see `depthtools archs`)."),
    layers: int = typer.Option(..., "--layers", help="Number of blocks (n_layer)."),
    budget: Optional[str] = typer.Option(None, "--budget", help="Parameter budget (e.g. 1.6M): the width is planned for it."),
    d_model: Optional[int] = typer.Option(None, "--d-model", help="Width, instead of --budget."),
    n_heads: Optional[int] = typer.Option(None, "--n-heads", help="Attention heads (default: the preset's, else 16)."),
    tolerance: Optional[float] = typer.Option(None, "--tolerance", help="Allowed deviation from --budget."),
    preset_recipe: Optional[str] = typer.Option(None, "--preset-recipe", help="Start from a preset's recipe (tiny, demo, cpu-small, depthbench-400m)."),
    data: str = typer.Option("default", "--data", help="Corpus name/mix to prepare, or a prepared data folder."),
    tokenizer: str = typer.Option("byte", "--tokenizer", help="Tokenizer when --data names a corpus."),
    data_root: Path = typer.Option(Path("data"), "--data-root", help="Where corpora are prepared."),
    out: Optional[Path] = typer.Option(None, "--out", help="Cell folder (default checkpoints/<arch>_L<layers>)."),
    tokens: Optional[int] = typer.Option(None, "--tokens", help="Token budget."),
    tokens_per_param: Optional[float] = typer.Option(None, "--tokens-per-param", help="Token budget per parameter."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size"),
    micro_batch_size: Optional[int] = typer.Option(None, "--micro-batch-size", help="Gradient accumulation chunk."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len"),
    lr: Optional[float] = typer.Option(None, "--lr", help="Peak learning rate."),
    schedule: Optional[str] = typer.Option(None, "--schedule", help="cosine or wsd."),
    seed: Optional[int] = typer.Option(None, "--seed"),
    device: Optional[str] = typer.Option(None, "--device", help="auto, cpu or cuda."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="auto, float32 or bfloat16."),
    compile: Optional[bool] = typer.Option(None, "--compile/--no-compile", help="torch.compile on CUDA."),
    threads: Optional[int] = typer.Option(None, "--threads", help="CPU threads."),
    eval_every: Optional[int] = typer.Option(None, "--eval-every"),
    checkpoint_every: Optional[int] = typer.Option(None, "--checkpoint-every"),
    log_every: Optional[int] = typer.Option(None, "--log-every"),
    force: bool = typer.Option(False, "--force", help="Retrain a finished cell from scratch."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
):
    """Train one model (one grid cell); re-running resumes an interrupted run.

    Example: depthtools train --arch hc --layers 8 --budget 250k --preset-recipe tiny --out checkpoints/one/hc_L8
    """
    from depthtools.data import read_meta
    from depthtools.grid import count_params
    from depthtools.train import train_cell

    recipe = _recipe(preset_recipe, dict(
        tokens=tokens, tokens_per_param=tokens_per_param, batch_size=batch_size, micro_batch_size=micro_batch_size,
        seq_len=seq_len, lr=lr, schedule=schedule, seed=seed, device=device, dtype=dtype, compile=compile,
        threads=threads, eval_every=eval_every, checkpoint_every=checkpoint_every, log_every=log_every,
    ))
    data_dir = _data_dir(data, tokenizer, data_root)
    vocab_size = int(read_meta(data_dir)["tokenizer"]["vocab_size"])
    model_cfg = _model_config(arch, layers, budget, d_model, n_heads, vocab_size, max(recipe.seq_len, 1),
                              preset_recipe, tolerance)
    out = out or Path("checkpoints") / f"{model_cfg.arch}_L{layers}"
    params = count_params(model_cfg)["total"]
    with _interruptible(), _display(recipe.total_steps(params) * recipe.batch_size * recipe.seq_len, 1, quiet=as_json) as display:
        summary = train_cell(model_cfg, recipe, data_dir, out, force=force, progress=display)
    if as_json:
        print_json(summary)
    else:
        console.print(f"wrote {out} (d_model={model_cfg.d_model}, {params:,} params, val loss {summary['val_loss']:.4f})")


@grid_app.command("train")
def grid_train_command(
    grid: Optional[Path] = typer.Argument(None, help="Grid spec JSON from `depthtools grid plan --out`."),
    preset: Optional[str] = typer.Option(None, "--preset", help="Train a named grid instead of a spec file."),
    root: Path = typer.Option(Path("checkpoints"), "--root", help="Cells land in ROOT/<grid name>/<cell>/."),
    data_root: Path = typer.Option(Path("data"), "--data-root", help="Where the grid's corpus is prepared."),
    force: bool = typer.Option(False, "--force", help="Retrain finished cells too."),
    as_json: bool = typer.Option(False, "--json", help="Print the per-cell summaries as JSON."),
):
    """Train every cell of a grid: finished cells are skipped, interrupted ones resume.

    Examples:
      depthtools grid plan --preset tiny --out tiny.json && depthtools grid train tiny.json
      depthtools grid train --preset demo
    """
    from depthtools.config import TrainConfig
    from depthtools.train import is_finished, train_grid
    from depthtools.train.sweep import load_spec

    if (grid is None) == (preset is None):
        raise DepthToolsError("give a grid spec file or --preset NAME (not both)")
    if preset is not None:
        from depthtools.presets import get_preset

        spec = load_spec(get_preset(preset).grid_spec())
    else:
        spec = load_spec(grid)
    recipe = TrainConfig.from_dict(spec.get("train") or {})
    grid_dir = root / spec.get("name", "grid")
    todo = [c for c in spec["cells"] if force or not is_finished(grid_dir / c.name)]
    total = sum(recipe.total_steps(c.params_total) * recipe.batch_size * recipe.seq_len for c in todo)
    with _interruptible(), _display(total, len(spec["cells"]), quiet=as_json) as display:
        summaries = train_grid(spec, root=root, force=force, progress=display, data_root=data_root)
    if as_json:
        print_json(summaries)
        return
    trained = [s for s in summaries if not s.get("skipped")]
    console.print(table(
        f"grid {spec.get('name')} -> {grid_dir} ({len(trained)} trained, {len(summaries) - len(trained)} skipped)",
        ["cell", "status", "val loss", "time"],
        [[s["name"], "skipped" if s.get("skipped") else ("resumed" if s.get("resumed_from") else "trained"),
          f"{s['val_loss']:.4f}" if s.get("val_loss") is not None else "", f"{s['elapsed_s']:.0f}s" if "elapsed_s" in s else ""]
         for s in summaries],
    ))
