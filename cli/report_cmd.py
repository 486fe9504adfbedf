"""`depthtools report`: write a self-contained HTML report of a grid, a checkpoint, or a comparison.

A thin layer over `depthtools.report`: `--grid DIR` calls `grid_report`, one `--ckpt` calls
`model_report` (every probe of that checkpoint), two or more `--ckpt` a side-by-side comparison.
The report reads saved tables only; run `depthtools analyze` / `summarize` first for full content.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer
from rich.markup import escape

from cli.app import app
from cli.common import console, err_console
from depthtools.errors import DepthToolsError

REPORTS = Path("reports")


@app.command("report")
def report_command(
    grid: Optional[Path] = typer.Option(None, "--grid", help="Grid directory (checkpoints/<grid>)."),
    ckpt: Optional[List[str]] = typer.Option(None, "--ckpt", help="Checkpoint path or cell name; repeat to compare."),
    out: Optional[Path] = typer.Option(None, "-o", "--out", help="Output .html file (default: reports/<name>.html)."),
    title: Optional[str] = typer.Option(None, "--title", help="Page title (default: from the grid or checkpoints)."),
):
    """Write an HTML report (one self-contained file that opens offline).

    Examples:
      depthtools report --grid checkpoints/tiny -o reports/tiny.html
      depthtools report --ckpt hc_L8
      depthtools report --ckpt hc_L8 --ckpt preln_L8
    """
    from depthtools.report import default_name, grid_report, model_report  # lazy: keeps the CLI torch-free

    if (grid is None) == (not ckpt):
        raise DepthToolsError("give either --grid DIR or one or more --ckpt NAME (not both)")
    if out is not None and out.suffix.lower() not in (".html", ".htm"):
        raise DepthToolsError(f"output {out} must be an .html file")
    path = out if out is not None else REPORTS / default_name(grid, ckpt or ())
    if grid is not None:
        written = grid_report(grid, path, title=title)
    else:
        written = model_report(list(ckpt), path, title=title)
    console.print(f"wrote {written} ({written.stat().st_size / 1024:.0f} KB)", markup=False, highlight=False)
    _warn_weights(grid, ckpt)


def _warn_weights(grid: Optional[Path], ckpts: Optional[List[str]]) -> None:
    """One stderr line per checkpoint whose weights are missing or damaged (the report says so too)."""
    from depthtools.report.data import weights_warnings_of  # lazy: keeps the CLI torch-free

    for line in weights_warnings_of(grid, ckpts):
        err_console.print(f"[bold yellow]warning:[/] weights missing or damaged: {escape(line)}", highlight=False,
                          soft_wrap=True)
