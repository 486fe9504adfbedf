"""The `depthtools` command: a thin Typer layer over the library (docs/design.md §1).

Sub-commands live in small modules (`cli/*_cmd.py`) that register on `app` or on the `grid`
group. User errors (`DepthToolsError`) print one line to stderr and exit with code 2.
"""

from __future__ import annotations

import importlib
import sys

from rich.markup import escape

from cli.app import app, grid_app  # noqa: F401  (re-exported: `from cli.main import app` is the entry point's app)

# the shared output helpers live in cli.common (which imports no command module); re-exported as before
from cli.common import check_device, console, err_console, fmt, parse_list, print_json, table, write_out  # noqa: F401
from depthtools.errors import DepthToolsError
from depthtools.fsutil import os_error_line

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
