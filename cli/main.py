"""The `depthtools` command: a thin Typer layer over the library (docs/design.md §1).

Sub-commands live in small modules (`cli/*_cmd.py`) that register on `app` or on the `grid`
group. User errors (`DepthToolsError`) print one line to stderr and exit with code 2.
"""

from __future__ import annotations

import importlib
import json
import math
import sys

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text
from typer.core import TyperGroup

from depthtools.errors import DepthToolsError
from depthtools.fsutil import os_error_line

err_console = Console(stderr=True)


class _OneLineErrors(TyperGroup):
    """Every command, sub-group included: a user error is one line on stderr and exit code 2.

    Done on the root group (not only in `main()`) so that programmatic invocation — typer's
    CliRunner in tests and notebooks — sees the same exit code as the console script.
    """

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except DepthToolsError as exc:
            err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None
        except OSError as exc:  # a permission, a full or read-only disk: one line naming the path
            line = os_error_line(exc)
            if line is None:
                raise
            err_console.print(f"[bold red]error:[/] {escape(line)}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None


app = typer.Typer(
    name="depthtools",
    cls=_OneLineErrors,
    help="Does extra depth become extra computation? Train iso-parameter grids, probe depth, write reports.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
grid_app = typer.Typer(help="Plan, train and inspect iso-parameter grids.", no_args_is_help=True)
app.add_typer(grid_app, name="grid")

console = Console()

# Command modules that register themselves on `app` / `grid_app` when imported (all part of the package: a
# missing one is an ImportError, not a silently absent command).
COMMAND_MODULES = ("cli.core_cmd", "cli.data_cmd", "cli.train_cmd", "cli.probe_cmd", "cli.suite_cmd",
                   "cli.report_cmd", "cli.demo_cmd", "cli.interop_cmd", "cli.tasks_cmd")


def print_json(obj) -> None:
    """Machine-readable output on stdout (no rich markup)."""
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


def table(title: str, columns: list[str], rows: list[list]) -> Table:
    """A rich table whose title, headers and cells are shown literally (a `[` in a name is not markup).

    A cell that should be styled is passed as a rich `Text` (e.g. Text(state, style="green")): it is
    rendered as it is, never parsed, so user text inside it stays literal too."""
    out = Table(title=escape(str(title)))
    for column in columns:
        out.add_column(escape(str(column)))
    for row in rows:
        out.add_row(*(v if isinstance(v, Text) else escape(str(v)) for v in row))
    return out


def fmt(value, digits: int = 4) -> str:
    """A number as every table shows it: `digits` significant figures; missing (None, NaN, NA) as "–"."""
    if value is None or (isinstance(value, float) and value != value) or type(value).__name__ == "NAType":
        return "–"
    return f"{value:.{digits}g}" if isinstance(value, float) else str(value)


LIST_KINDS = {"int": "an integer", "float": "a finite number", "str": "a name"}


def parse_list(text: str | None, kind: str, option: str, example: str) -> list | None:
    """A comma-separated option value as a list: every list-valued option of the CLI parses here.

    `kind` is "int", "float" (finite) or "str"; None (option not given) stays None; spaces and empty
    items ("16,,24,") are ignored. A value that names nothing, or an item of the wrong kind, is a
    one-line DepthToolsError (exit 2) naming the option, the item and an example (`example`)."""
    if text is None:
        return None
    items = [item.strip() for item in str(text).split(",") if item.strip()]
    if not items:
        raise DepthToolsError(f"{option} {text!r} names no value; use comma-separated values like {example}")
    out = []
    for item in items:
        try:
            value = {"int": int, "float": float, "str": str}[kind](item)
        except ValueError:
            value = None
        if value is None or (kind == "float" and not math.isfinite(value)):
            raise DepthToolsError(f"cannot read {option} {text!r}: {item!r} is not {LIST_KINDS[kind]}; "
                                  f"use comma-separated values like {example}")
        out.append(value)
    return out


def _load_command_modules() -> None:

    for name in COMMAND_MODULES:
        module = importlib.import_module(name)
        # A module with its own command group (`depthtools data ...`) names it in SUB_APPS.
        for group, sub_app in getattr(module, "SUB_APPS", {}).items():
            app.add_typer(sub_app, name=group)


def main() -> None:
    """Console-script entry point: run the app, turning user errors into one line + exit 2.

    Typer's standalone mode already reports usage errors (exit 2); library errors surface here.
    """
    try:
        app()
    except DepthToolsError as exc:
        err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except OSError as exc:
        line = os_error_line(exc)
        if line is None:
            raise
        err_console.print(f"[bold red]error:[/] {escape(line)}", highlight=False, soft_wrap=True)
        sys.exit(2)


_load_command_modules()
