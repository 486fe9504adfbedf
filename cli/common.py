"""What every command module shares: the consoles, JSON and table output, number formatting, list options.

A module of its own (cli.main re-exports these names) so that helper modules such as cli.plain and
cli.probe_depthbench can import them at the top without importing cli.main, whose import registers every
command module, which import those helpers in turn.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from depthtools.errors import DepthToolsError

if TYPE_CHECKING:
    import pandas as pd

err_console = Console(stderr=True)
console = Console()


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


def check_device(device: str) -> str:
    """`device` ("cpu" or "cuda", the latter only when one is available), or a one-line error."""
    import torch  # lazy: keeps the CLI torch-free

    if device not in ("cpu", "cuda"):
        raise DepthToolsError(f"unknown device {device!r}; valid: cpu, cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise DepthToolsError("--device cuda requested but no CUDA device is available; use --device cpu")
    return device


def check_devices(device: str, n: int) -> list[str]:
    """The devices `--device D --devices N` places blocks on, or a one-line error (N needs --device cuda and
    at most the visible CUDA devices)."""
    from depthtools.arch.stream import check_devices as check  # lazy: keeps the CLI torch-free

    check_device(device)
    return check(device, n)


def write_out(df: pd.DataFrame, out: Path | None) -> None:
    """A probe command's --out: the table written to `out` (by its suffix), with a line on stderr."""
    from depthtools.analysis.tables import write_frame  # lazy: keeps the CLI torch-free

    if out is not None:
        write_frame(df, out)
        err_console.print(f"wrote {out}", markup=False, highlight=False)


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
