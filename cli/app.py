"""The root Typer app and the `grid` group that command modules register on.

Kept apart from `cli.main` (which imports every command module to register it) so that a command module can be
imported on its own: `import cli.probe_cmd` needs `app`, not the other commands.
"""

from __future__ import annotations

import typer
from rich.markup import escape
from typer.core import TyperGroup

from cli.common import err_console
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
