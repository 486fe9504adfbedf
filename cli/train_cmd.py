"""Training commands: `depthtools train` (one cell), `depthtools grid train` (a whole grid, here or on
a cluster) and `depthtools grid status` (done / running / failed / pending cells).

Thin layers over `depthtools.train` (`train_cell`, `train_grid`, the launchers in
`depthtools.train.launch`), with a rich progress display (cell i/N, tokens, loss, tok/s, ETA).
Interrupted runs resume when the same command is repeated. `depthtools train` also runs under
`torchrun` (one rank per process; only rank 0 prints and writes).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any, Optional

import typer
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.text import Text

from cli.app import app, grid_app
from cli.common import console, parse_list, print_json, table
from cli.plain import PlainLog, PlainTrainDisplay, is_plain
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
            console.print(f"[dim]skip[/] {escape(str(event['cell']))} ({escape(str(event.get('why', 'finished')))})",
                          highlight=False)
            return
        if kind == "start":
            if self.cell is not None:
                self.progress.remove_task(self.cell)
            total = event["total_steps"]
            self.cell = self.progress.add_task(f"{event['cell']}", total=total, completed=event["step"], info="")
            self.progress.update(self.grid, description=f"cell {index}/{self.n_cells}")
            if event["step"]:
                console.print(f"resume {event['cell']} from step {event['step']}", markup=False)
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
            console.print(f"[green]done[/] {escape(str(event['cell']))}: val loss {val:.4f}" if val is not None
                          else f"[green]done[/] {escape(str(event['cell']))}")


def _display(total_tokens: int, n_cells: int, quiet: bool):
    """The rich display; plain lines when the output is not a terminal (rich's bars would show nothing
    there); a silent stand-in when the output must stay machine-readable (--json)."""

    if quiet:
        return contextlib.nullcontext(None)
    return PlainTrainDisplay(n_cells) if is_plain() else TrainDisplay(total_tokens, n_cells)


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
    from depthtools.data import prepare  # lazy: keeps the CLI torch-free

    if (Path(data) / "meta.json").is_file():
        return Path(data)
    if Path(data).is_file():  # not a corpus name: the user's own text, which training reads only once prepared
        raise DepthToolsError(f"--data {data} is a file, not a corpus name or a prepared data folder (one with "
                              f"meta.json); prepare it first: depthtools data prepare --input {data}")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # ranks must not prepare the same folder at once
        raise DepthToolsError(f"under torchrun --data must be a prepared folder (with meta.json), got {data!r}; "
                              f"prepare it first: depthtools data prepare --corpus {data} --tokenizer {tokenizer}")
    return prepare(data, out_dir=data_root, tokenizer=tokenizer, log=lambda m: console.print(m, markup=False, highlight=False))


def _task_mix_option(text: str) -> dict[str, Any] | None:
    """--task-mix: a JSON object (TaskMix fields) or 'off'; one-line errors for anything else."""

    if text.strip().lower() == "off":
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DepthToolsError(f"--task-mix is not valid JSON ({exc.msg} at char {exc.pos}); e.g. "
                              '\'{"fraction": 1, "tasks": ["chase"], "answer_only": true}\'') from None
    if not isinstance(value, dict):
        raise DepthToolsError(f"--task-mix must be a JSON object like {{\"fraction\": 0.05}}, got {type(value).__name__}")
    return value


def _recipe(preset_recipe: Optional[str], overrides: dict[str, Any], task_mix: Optional[str] = None,
            profile: Optional[str] = None):
    """The TrainConfig: a preset's recipe, then the profile's fields, then the options given here."""
    from depthtools.config import TrainConfig  # lazy: keeps the CLI torch-free
    from depthtools.presets import get_preset  # lazy: keeps the CLI torch-free
    from depthtools.profiles import recipe  # lazy: keeps the CLI torch-free

    base = dict(get_preset(preset_recipe).train) if preset_recipe else {}
    given = {k: v for k, v in overrides.items() if v is not None}
    if task_mix is not None:
        mix = _task_mix_option(task_mix)
        base.pop("task_mix", None)
        if mix is not None:
            given["task_mix"] = mix
    if "tokens" in given:
        base.pop("tokens_per_param", None)
    if "tokens_per_param" in given:
        base.pop("tokens", None)
    return TrainConfig.from_dict(recipe(profile, base, given))


def _model_config(arch, layers, budget, d_model, n_heads, vocab_size, max_seq_len, preset_recipe, tolerance):
    """The cell's ModelConfig: width from --d-model, or the iso-parameter width for --budget."""
    from depthtools.arch.registry import validate_model_config  # lazy: arch/ imports torch (training does anyway)
    from depthtools.config import ModelConfig  # lazy: keeps the CLI torch-free
    from depthtools.grid import plan_grid  # lazy: keeps the CLI torch-free
    from depthtools.presets import get_preset  # lazy: keeps the CLI torch-free

    if (budget is None) == (d_model is None):
        raise DepthToolsError("give exactly one of --budget (width planned for the budget) or --d-model")
    if n_heads is not None and n_heads < 1:  # 0 is a value, not "unset": never replaced by the preset's
        raise DepthToolsError(f"--n-heads must be a positive integer, got {n_heads}")
    plan = dict(get_preset(preset_recipe).plan) if preset_recipe else {}
    heads = n_heads if n_heads is not None else plan.get("n_heads", 16)
    if d_model is not None:
        return validate_model_config(ModelConfig(arch=arch, d_model=d_model, n_layer=layers, n_heads=heads,
                                                 vocab_size=vocab_size, max_seq_len=max_seq_len))
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
    profile: Optional[str] = typer.Option(None, "--profile", help="Recipe profile: depthbench switches the recipe and the architecture's options to DepthBench's code (docs/depthbench.md); options given here still win. Recorded in config.json."),
    data: str = typer.Option("default", "--data", help="Corpus name/mix to prepare, or a prepared data folder."),
    tokenizer: str = typer.Option("byte", "--tokenizer", help="Tokenizer when --data names a corpus."),
    data_root: Path = typer.Option(Path("data"), "--data-root", help="Where corpora are prepared."),
    out: Optional[Path] = typer.Option(None, "--out", help="Cell folder (default $DEPTHTOOLS_CHECKPOINTS/<arch>_L<layers>, else checkpoints/..., with _s<seed> for --seed > 0: where --ckpt NAME finds it)."),
    tokens: Optional[int] = typer.Option(None, "--tokens", help="Token budget."),
    tokens_per_param: Optional[float] = typer.Option(None, "--tokens-per-param", help="Token budget per parameter."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size"),
    micro_batch_size: Optional[int] = typer.Option(None, "--micro-batch-size", help="Gradient accumulation chunk."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len"),
    lr: Optional[float] = typer.Option(None, "--lr", help="Peak learning rate."),
    schedule: Optional[str] = typer.Option(None, "--schedule", help="cosine or wsd."),
    seed: Optional[int] = typer.Option(None, "--seed"),
    device: Optional[str] = typer.Option(None, "--device", help="auto, cpu or cuda."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Autocast dtype of the computation: auto, float32 or bfloat16."),
    param_dtype: Optional[str] = typer.Option(None, "--param-dtype", help="Dtype of the weights and AdamW state: float32 (default), bfloat16 (every parameter and its AdamW state, CPU too; float32 with a note on a device without bf16) or auto (bfloat16 on CUDA with bf16, else float32: the depthbench profile's choice)."),
    compile: Optional[str] = typer.Option(None, "--compile", help="auto (default: when the run is long enough to repay it), on or off: regional torch.compile of the training step (CPU and CUDA)."),
    threads: Optional[int] = typer.Option(None, "--threads", help="CPU threads."),
    parallel: Optional[str] = typer.Option(None, "--parallel", help="Under torchrun: ddp (default) or fsdp (FSDP2 sharding)."),
    eval_every: Optional[int] = typer.Option(None, "--eval-every"),
    checkpoint_every: Optional[int] = typer.Option(None, "--checkpoint-every"),
    log_every: Optional[int] = typer.Option(None, "--log-every"),
    task_mix: Optional[str] = typer.Option(None, "--task-mix", help="Synthetic task rows as JSON, e.g. '{\"fraction\": 1, \"tasks\": [\"s5\"], \"answer_only\": true, \"curriculum\": true}' (fraction 1 = task stream only); 'off' drops a preset recipe's mix."),
    divergence_margin: Optional[float] = typer.Option(None, "--divergence-margin", help="Stop when the train loss rises this many nats above its lowest (default 5; 0 = only NaN/inf)."),
    resume_with_changed_lr: bool = typer.Option(False, "--resume-with-changed-lr", help="Resume a stopped run (e.g. diverged) from its last checkpoint with another --lr; recorded in config.json."),
    force: bool = typer.Option(False, "--force", help="Retrain a finished cell from scratch."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
):
    """Train one model (one grid cell); re-running resumes an interrupted run.

    A run stopped for divergence (NaN/inf, or loss far above its minimum) keeps its last good
    checkpoint; continue it with a lower LR: the same command with --lr LOWER --resume-with-changed-lr.

    Example: depthtools train --arch hc --layers 8 --budget 250k --preset-recipe tiny --out checkpoints/one/hc_L8

    A task cell (answer-only loss, k curriculum): depthtools train --arch preln --layers 2 --d-model 64 --tokens 600k
    --preset-recipe demo --task-mix '{"fraction": 1, "tasks": ["s5"], "k_max": 4, "answer_only": true, "curriculum": true}'

    On several GPUs: torchrun --nproc_per_node=8 -m cli train ... --data data/<prepared> [--parallel fsdp]
    """
    from depthtools.checkpoint import checkpoints_root  # lazy: keeps the CLI torch-free
    from depthtools.data import read_meta  # lazy: keeps the CLI torch-free
    from depthtools.grid import cell_name, count_params  # lazy: keeps the CLI torch-free
    from depthtools.train import train_cell  # lazy: keeps the CLI torch-free
    from depthtools.train.distributed import env_rank  # lazy: keeps the CLI torch-free

    recipe = _recipe(preset_recipe, dict(
        tokens=tokens, tokens_per_param=tokens_per_param, batch_size=batch_size, micro_batch_size=micro_batch_size,
        seq_len=seq_len, lr=lr, schedule=schedule, seed=seed, device=device, dtype=dtype, param_dtype=param_dtype,
        compile=compile,
        threads=threads, eval_every=eval_every, checkpoint_every=checkpoint_every, log_every=log_every,
        parallel=parallel, divergence_margin=divergence_margin,
    ), task_mix, profile)
    data_dir = _data_dir(data, tokenizer, data_root)
    vocab_size = int(read_meta(data_dir)["tokenizer"]["vocab_size"])
    model_cfg = _model_config(arch, layers, budget, d_model, n_heads, vocab_size, max(recipe.seq_len, 1),
                              preset_recipe, tolerance)
    if profile is not None:
        from depthtools.profiles import apply_model  # lazy: keeps the CLI torch-free

        model_cfg = apply_model(profile, model_cfg)
    out = out or checkpoints_root() / cell_name(model_cfg.arch, layers, recipe.seed)  # where --ckpt NAME looks
    params = count_params(model_cfg)["total"]
    main_rank = env_rank() == 0
    quiet = as_json or not main_rank
    with _interruptible(), _display(recipe.total_steps(params) * recipe.batch_size * recipe.seq_len, 1, quiet=quiet) as display:
        summary = train_cell(model_cfg, recipe, data_dir, out, force=force, progress=display,
                             allow_lr_change=resume_with_changed_lr)
    if not main_rank:
        return
    if as_json:
        print_json(summary)
    else:
        val = summary.get("val_loss")
        val_text = f"val loss {val:.4f}" if val is not None else "no validation split: no val loss"
        console.print(f"wrote {out} (d_model={model_cfg.d_model}, {params:,} params, {val_text})", markup=False)


LAUNCHERS = ("local", "slurm", "ray")


def _grid_spec(grid: Optional[Path], preset: Optional[str]) -> dict[str, Any]:
    """The grid spec from a file or a preset name (exactly one of them)."""
    from depthtools.train.sweep import load_spec  # lazy: keeps the CLI torch-free

    if (grid is None) == (preset is None):
        raise DepthToolsError("give a grid spec file or --preset NAME (not both)")
    if preset is not None:
        from depthtools.presets import get_preset  # lazy: keeps the CLI torch-free

        return load_spec(get_preset(preset).grid_spec())
    return load_spec(grid)


# Options shared by `grid train` and `grid status` (one grid named the same way in both).
GRID_SPEC = typer.Argument(None, help="Grid spec JSON from `depthtools grid plan --out`.")
GRID_PRESET = typer.Option(None, "--preset", help="A named grid (tiny, demo, cpu-small, depthbench-400m) instead of a spec file.")
GRID_ROOT = typer.Option(Path("checkpoints"), "--root", envvar="DEPTHTOOLS_CHECKPOINTS",
                         help="Cells live in ROOT/<grid name>/<cell>/ (default $DEPTHTOOLS_CHECKPOINTS or checkpoints).")


@grid_app.command("train")
def grid_train_command(
    grid: Optional[Path] = GRID_SPEC,
    preset: Optional[str] = GRID_PRESET,
    root: Path = GRID_ROOT,
    data_root: Path = typer.Option(Path("data"), "--data-root", help="Where the grid's corpus is prepared."),
    cells: Optional[str] = typer.Option(None, "--cells", help="Only these cells (comma-separated names)."),
    launcher: str = typer.Option("local", "--launcher", help="local (processes here), slurm (job array via submitit) or ray."),
    workers: int = typer.Option(1, "--workers", help="local: cells trained at once (1 = in this process)."),
    threads: Optional[int] = typer.Option(None, "--threads", help="local/ray: torch threads per cell (default 1 with --workers > 1)."),
    compile: Optional[str] = typer.Option(None, "--compile", help="auto, on or off for every cell (overrides the grid's recipe; not part of a cell's run fingerprint)."),
    partition: Optional[str] = typer.Option(None, "--partition", help="slurm: partition."),
    gpus_per_cell: int = typer.Option(1, "--gpus-per-cell", help="slurm/ray: GPUs per cell (slurm: >1 = one DDP rank per GPU)."),
    cpus_per_cell: int = typer.Option(8, "--cpus-per-cell", help="slurm/ray: CPU cores per cell."),
    time: str = typer.Option("24:00:00", "--time", help="slurm: time limit per cell (cells requeue and resume on timeout)."),
    mem_gb: Optional[int] = typer.Option(None, "--mem-gb", help="slurm: memory per cell."),
    ray_address: Optional[str] = typer.Option(None, "--ray-address", help="ray: cluster address (default: start or join a local one)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="slurm: print one line per cell (command, resources) and submit nothing."),
    force: bool = typer.Option(False, "--force", help="Retrain finished cells too."),
    as_json: bool = typer.Option(False, "--json", help="Print the per-cell summaries as JSON."),
):
    """Train every cell of a grid: finished cells are skipped, interrupted ones resume.

    Examples:
      depthtools grid plan --preset tiny --out tiny.json && depthtools grid train tiny.json
      depthtools grid train tiny.json --workers 2 --threads 1
      depthtools grid train big.json --launcher slurm --partition gpu --gpus-per-cell 1 --time 24:00:00 --dry-run
      depthtools grid status big.json
    """
    from depthtools.train.sweep import select_cells  # lazy: keeps the CLI torch-free

    if launcher not in LAUNCHERS:
        raise DepthToolsError(f"unknown launcher {launcher!r}; valid: {', '.join(LAUNCHERS)}")
    spec = select_cells(_grid_spec(grid, preset), parse_list(cells, "str", "--cells", "preln_L2,hc_L4"))
    if compile is not None:
        from depthtools.config import TrainConfig  # lazy: keeps the CLI torch-free

        train = {**(spec.get("train") or {}), "compile": compile}
        TrainConfig.from_dict(train)  # a bad value: one line before any cell starts
        spec = {**spec, "train": train}
    if launcher == "slurm":
        _grid_slurm(spec, grid, root, data_root, force, dry_run, as_json, partition=partition,
                    gpus_per_cell=gpus_per_cell, cpus_per_cell=cpus_per_cell, time=time, mem_gb=mem_gb)
        return
    if dry_run:
        raise DepthToolsError("--dry-run applies to --launcher slurm")
    log = None if as_json else _launcher_log()
    if launcher == "ray":
        from depthtools.train.launch import launch_ray  # lazy: keeps the CLI torch-free

        summaries = launch_ray(spec, root, data_root, gpus_per_cell=gpus_per_cell, cpus_per_cell=cpus_per_cell,
                               threads=threads, address=ray_address, force=force, log=log)
    elif workers > 1:
        from depthtools.train.launch import launch_local  # lazy: keeps the CLI torch-free

        summaries = launch_local(spec, root, data_root, workers=workers, threads=threads or 1, force=force, log=log)
    else:
        summaries = _grid_here(spec, root, data_root, threads, force, as_json)
    _report(spec, root, summaries, as_json)


def _plain(line: str) -> None:
    """Print a launcher's log line literally (cell names and errors are not rich markup)."""
    console.print(line, markup=False, highlight=False)


def _launcher_log():
    """A launcher's per-cell lines: literal on a terminal, stamped with the elapsed time in a log."""

    return PlainLog() if is_plain() else _plain


def _grid_here(spec, root: Path, data_root: Path, threads: Optional[int], force: bool, as_json: bool):
    """All cells one after another in this process, with the progress display."""
    from depthtools.config import TrainConfig  # lazy: keeps the CLI torch-free
    from depthtools.train import held_checkpoint, train_grid  # lazy: keeps the CLI torch-free

    if threads:
        spec = {**spec, "train": {**(spec.get("train") or {}), "threads": threads}}
    recipe = TrainConfig.from_dict(spec.get("train") or {})
    grid_dir = root / spec.get("name", "grid")
    todo = [c for c in spec["cells"] if force or held_checkpoint(grid_dir / c.name) is None]
    total = sum(recipe.total_steps(c.params_total) * recipe.batch_size * recipe.seq_len for c in todo)
    with _interruptible(), _display(total, len(spec["cells"]), quiet=as_json) as display:
        return train_grid(spec, root=root, force=force, progress=display, data_root=data_root)


def _report(spec, root: Path, summaries: list[dict[str, Any]], as_json: bool) -> None:
    """Per-cell table (or JSON); exit code 1 when a cell failed."""
    failed = [s for s in summaries if s.get("error")]
    if as_json:
        print_json(summaries)
    else:
        trained = [s for s in summaries if not s.get("skipped") and not s.get("error")]
        grid_dir = root / spec.get("name", "grid")
        console.print(table(
            f"grid {spec.get('name')} -> {grid_dir} ({len(trained)} trained, {len(failed)} failed, "
            f"{len(summaries) - len(trained) - len(failed)} skipped)",
            ["cell", "status", "val loss", "time"],
            [[s["name"], _status_word(s), f"{s['val_loss']:.4f}" if s.get("val_loss") is not None else "",
              f"{s['elapsed_s']:.0f}s" if "elapsed_s" in s else ""] for s in summaries],
        ))
    if failed:
        raise typer.Exit(1)


def _status_word(summary: dict[str, Any]) -> str:
    if summary.get("error"):
        return f"failed: {summary['error']}"
    if summary.get("skipped"):
        return "skipped" if summary.get("state", "finished") == "finished" else f"skipped: {summary['why']}"
    return "resumed" if summary.get("resumed_from") else "trained"


def _grid_slurm(spec, grid_path, root: Path, data_root: Path, force: bool, dry_run: bool, as_json: bool, **resources):
    """Submit the unfinished cells as a Slurm job array, or print what would be submitted."""
    from depthtools.train.launch import (  # lazy: keeps the CLI torch-free
        SlurmResources,
        dry_run as planned_jobs,  # lazy: keeps the CLI torch-free
        dry_run_lines,
        submit_cells,
    )

    res = SlurmResources(**resources)
    res.timeout_min  # noqa: B018 - validate --time before anything else
    if dry_run:
        if as_json:
            print_json(planned_jobs(spec, root, data_root, res, grid_path=grid_path, force=force))
            return
        lines = dry_run_lines(spec, root, data_root, res, grid_path=grid_path, force=force)
        for line in lines:
            print(line)
        print(f"# {len(lines)} cell(s) would be submitted, {len(spec['cells']) - len(lines)} finished")
        return
    jobs = submit_cells(spec, root, data_root, res, cluster="slurm", force=force)
    if as_json:
        print_json([{"cell": name, "job_id": job.job_id} for name, job in jobs])
        return
    for name, job in jobs:
        console.print(f"submitted {name}: job {job.job_id}", markup=False)
    console.print(f"{len(jobs)} cell(s) submitted; follow them with: depthtools grid status {grid_path or '<spec>'} --root {root}",
                  markup=False)


@grid_app.command("status")
def grid_status_command(
    grid: Optional[Path] = GRID_SPEC,
    preset: Optional[str] = GRID_PRESET,
    root: Path = GRID_ROOT,
    stale_after: float = typer.Option(900.0, "--stale-after", help="Seconds without a heartbeat (from another host) before a running cell counts as failed."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON record per cell."),
):
    """Which cells are done, running, failed or pending, read from the cell folders alone.

    Example: depthtools grid status tiny.json --root checkpoints
    """

    from depthtools.train.sweep import STATES, grid_status  # lazy: keeps the CLI torch-free

    spec = _grid_spec(grid, preset)
    rows = grid_status(spec, root, stale_after=stale_after)
    if as_json:
        print_json(rows)
        return
    counts = {state: sum(r["state"] == state for r in rows) for state in STATES}
    colour = {"done": "green", "imported": "blue", "damaged": "bold red", "running": "cyan", "failed": "red",
              "pending": "dim"}

    def step(r):
        return "" if r["step"] is None else f"{r['step']}" + (f"/{r['total_steps']}" if r.get("total_steps") else "")

    console.print(table(
        f"grid {spec.get('name')} in {root / spec.get('name', 'grid')}", ["cell", "state", "step", "detail"],
        [[r["cell"], Text(r["state"], style=colour[r["state"]]), step(r), r["detail"]] for r in rows],
    ))
    console.print(", ".join(f"{state} {n}" for state, n in counts.items()  # imported/damaged only when there are some
                            if n or state not in ("imported", "damaged")))
