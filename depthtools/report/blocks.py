"""The building blocks of a report page: sections holding figures, tables, notes and lists.

A block is plain data; `templates/report.html.j2` renders it with autoescaping on, so every string a
block carries (titles, captions, cell values taken from configs and directory names) is escaped.
Tables keep, per cell, the displayed text and the full-precision value: the inline script sorts on
the value and writes it to the CSV download.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import pandas as pd

from depthtools.report import figures


@dataclass
class FigureBlock:
    id: str
    title: str
    uri: str  # data:image/png;base64,...
    caption: str
    kind: str = "figure"


@dataclass
class TableCell:
    text: str  # what the page shows
    value: str  # full precision, for sorting and CSV ("" for missing)


@dataclass
class TableBlock:
    id: str
    title: str
    columns: list[str]
    numeric: list[bool]
    rows: list[list[TableCell]]
    caption: str
    filename: str
    kind: str = "table"


@dataclass
class NoteBlock:
    text: str
    level: str = "info"  # info | missing
    kind: str = "note"


@dataclass
class ListBlock:
    items: list[str]
    kind: str = "list"


@dataclass
class Section:
    id: str
    title: str
    intro: str = ""
    blocks: list[Any] = field(default_factory=list)

    def add(self, block) -> "Section":
        if block is not None:
            self.blocks.append(block)
        return self


# -- tables -------------------------------------------------------------------------------------

def _is_missing(value: Any) -> bool:
    if value is None or value is pd.NA:
        return True
    try:
        return bool(pd.isna(value))
    except (TypeError, ValueError):
        return False


def format_value(value: Any) -> TableCell:
    """Displayed text (4 significant digits for floats, '–' when missing) and the exact value."""
    if _is_missing(value):
        return TableCell("–", "")
    if isinstance(value, (bool, np.bool_)):
        return TableCell("yes" if value else "no", "true" if value else "false")
    if isinstance(value, (int, np.integer)):
        return TableCell(f"{int(value):,}" if abs(int(value)) >= 10_000 else str(int(value)), str(int(value)))
    if isinstance(value, (float, np.floating)):
        v = float(value)
        if math.isinf(v):
            return TableCell("∞" if v > 0 else "−∞", "inf" if v > 0 else "-inf")
        return TableCell(f"{v:.4g}", repr(v))
    return TableCell(str(value), str(value))


def table_block(id: str, title: str, df: pd.DataFrame, caption: str, columns: Sequence[str] | None = None,
                filename: str | None = None) -> TableBlock:
    """A sortable, downloadable table of `df` (columns in the given order, those present)."""
    cols = [c for c in (columns or list(df.columns)) if c in df.columns]
    numeric = [bool(pd.api.types.is_numeric_dtype(df[c]) and not pd.api.types.is_bool_dtype(df[c])) for c in cols]
    rows = [[format_value(v) for v in record] for record in df[cols].itertuples(index=False, name=None)]
    return TableBlock(id=id, title=title, columns=[str(c) for c in cols], numeric=numeric, rows=rows, caption=caption,
                      filename=filename or f"{id}.csv")


# -- figures ------------------------------------------------------------------------------------

def figure_block(id: str, title: str, caption: str, plot: Callable, *args, **kwargs) -> FigureBlock | NoteBlock:
    """Draw one figure and embed it; a figure that cannot be drawn becomes a note saying why."""
    try:
        fig = plot(*args, **kwargs)
    except Exception as exc:  # a report names a broken figure instead of failing the whole page
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        return NoteBlock(f"{title}: could not be drawn ({type(exc).__name__}: {first})", level="missing")
    return FigureBlock(id=id, title=title, uri=figures.to_data_uri(fig), caption=caption)
