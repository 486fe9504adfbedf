"""HTML reports: one self-contained file per grid, checkpoint or comparison (docs/design.md §6, §8).

    from depthtools.report import grid_report, model_report
    grid_report("checkpoints/tiny", "reports/tiny.html")            # the whole grid
    model_report(["hc_L8"], "reports/hc_L8.html")                   # every probe of one checkpoint
    model_report(["hc_L8", "preln_L8"], "reports/compare.html")     # side by side

Reports only read saved tables (training curves, eval.json, `depthtools analyze` / `summarize` /
`tasks eval` outputs), say what is missing instead of failing, escape every string they embed, and
open offline (inline CSS and script, PNG figures as data URIs).
"""

from depthtools.report.build import default_name, grid_report, grid_sections, model_report, model_sections
from depthtools.report.data import CellData, GridData, read_cell, read_grid

__all__ = ["CellData", "GridData", "default_name", "grid_report", "grid_sections", "model_report", "model_sections",
           "read_cell", "read_grid"]
