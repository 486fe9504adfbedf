"""`depthtools demo`: the README's main job — train a small grid on CPU, probe it, write the report."""

from __future__ import annotations

import os
from pathlib import Path

import typer
from rich.markup import escape
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

from cli.app import app
from cli.common import console
from cli.plain import PlainLog, is_plain


@app.command("demo")
def demo_command(
    preset: str = typer.Option("demo", "--preset", help="Named grid to run (demo: about 10 min on 2 idle CPU cores, measured in benchmarks/RESULTS.md; tasks: the depth-task grid, ~19 min; tiny: the CI-sized grid)."),
    root: Path = typer.Option(Path("checkpoints"), "--root", help="Cells land in ROOT/<preset>/<cell>/."),
    data_root: Path = typer.Option(Path("data"), "--data-root", help="Where the corpus is prepared."),
    reports: Path = typer.Option(Path("reports"), "--reports", help="The report lands in REPORTS/<preset>/index.html."),
    threads: int = typer.Option(0, "--threads", help="torch CPU threads of this process (0: leave torch's default)."),
    workers: int = typer.Option(min(2, os.cpu_count() or 1), "--workers",
                                help="Cells trained at once in 1-thread worker processes (1: train in this process)."),
    tasks: bool = typer.Option(True, "--tasks/--no-tasks", help="Also evaluate the synthetic depth tasks."),
):
    """Prepare the default corpus, train the preset's iso-parameter grid, run every depth probe, write the report.

    Re-running reuses what is done: finished cells are skipped, interrupted ones resume from their
    last checkpoint, analyses saved with the same settings are not recomputed.

    Examples:
      depthtools demo                 # the embedded default (preset demo)
      depthtools demo --preset tiny   # CI-sized
    """
    import torch  # lazy: keeps the CLI torch-free

    from depthtools.demo import run_demo  # lazy: keeps the CLI torch-free

    if threads > 0:
        torch.set_num_threads(threads)
    columns = (TextColumn("[bold]{task.fields[stage]:<8}"), BarColumn(), TaskProgressColumn(), TimeElapsedColumn(),
               TextColumn("{task.description}"))
    try:
        if is_plain():  # a log file, nohup, Slurm: rich's bar would print nothing until the end
            log = PlainLog()
            log(f"demo: preset {preset}; one line per stage and cell (output is not a terminal)")
            result = run_demo(preset, root=root, data_root=data_root, reports_root=reports, tasks=tasks,
                              workers=workers, log=log)
        else:
            with Progress(*columns, console=console, transient=False) as progress:
                bar = progress.add_task("starting", total=1.0, stage="demo")

                def show(stage: str, fraction: float, detail: str) -> None:
                    progress.update(bar, completed=fraction, stage=stage, description=detail)

                result = run_demo(preset, root=root, data_root=data_root, reports_root=reports, on_progress=show,
                                  tasks=tasks, workers=workers)
    except KeyboardInterrupt:
        console.print("interrupted; run the same command again to continue where it stopped")
        raise typer.Exit(130) from None
    for note in result.notes:
        console.print(f"[yellow]note:[/] {escape(str(note))}", highlight=False)
    timing = ", ".join(f"{k} {v:.0f}s" for k, v in result.seconds.items())
    console.print(f"report: {result.report}  (grid {result.grid_dir}; {timing})", markup=False, highlight=False)
