"""The `depthtools` command: a thin Typer layer over the library (docs/design.md §1).

Sub-commands live in small modules (`cli/*_cmd.py`) that register on `app` or on the `grid`
group. User errors (`DepthToolsError`) print one line to stderr and exit with code 2.
"""

from __future__ import annotations

import importlib
import sys

import typer
from rich.markup import escape
from typer.core import TyperGroup

# the shared output helpers live in cli.common (which imports no command module); re-exported for the commands
from cli.common import check_device, console, err_console, fmt, parse_list, print_json, table, write_out  # noqa: F401
from depthtools.errors import DepthToolsError
from depthtools.fsutil import os_error_line


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

# Command modules that register themselves on `app` / `grid_app` when imported (all part of the package: a
# missing one is an ImportError, not a silently absent command).
COMMAND_MODULES = ("cli.core_cmd", "cli.data_cmd", "cli.train_cmd", "cli.probe_cmd", "cli.suite_cmd",
                   "cli.report_cmd", "cli.demo_cmd", "cli.interop_cmd", "cli.tasks_cmd")


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
