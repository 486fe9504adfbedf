"""The result table of a trained grid with its training-seed noise, as Markdown (for README/docs).

Reads only the cells' eval.json and config.json (through the report's `read_grid`), so it runs as soon
as training has finished, before any analysis:

  * final val loss per (arch, depth): mean over training seeds ± the half-width of the 95% t-interval;
  * per arch, fitted per seed: the slope of val loss against log2(n_layer) (nats per doubling of depth at
    fixed parameters), the change from each depth to the next deeper one, and the shallowest -> deepest
    change; each a mean with its seed t-interval [lo, hi];
  * per arch, the Welch contrast of its slope against `--baseline`: negative = it loses less (or gains
    more) than the baseline when going deep-narrow; an interval that covers 0 is a tie.

Example:
  python benchmarks/grid_table.py checkpoints/afternoon --baseline preln
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
import pandas as pd

from depthtools.analysis.seeds import contrast, seed_interval, seed_means
from depthtools.report.data import read_grid
from depthtools.report.frames import cells_frame


def loss_slopes(cells: pd.DataFrame) -> pd.DataFrame:
    """Per (arch, seed): the least-squares slope of val_loss on log2(n_layer) over that seed's depths."""
    rows = []
    for (arch, seed), sub in cells.dropna(subset=["val_loss"]).groupby(["arch", "seed"]):
        if sub["n_layer"].nunique() < 2:
            continue
        x, y = np.log2(sub["n_layer"].to_numpy(float)), sub["val_loss"].to_numpy(float)
        rows.append({"arch": arch, "seed": int(seed), "slope": float(np.polyfit(x, y, 1)[0])})
    return pd.DataFrame(rows, columns=["arch", "seed", "slope"])


def paired_changes(cells: pd.DataFrame, arch: str, shallow: int, deep: int) -> list[float]:
    """val_loss(deep) - val_loss(shallow) for each seed that has both cells."""
    sub = cells[cells["arch"] == arch].pivot_table(index="seed", columns="n_layer", values="val_loss")
    if shallow not in sub or deep not in sub:
        return []
    return [float(v) for v in (sub[deep] - sub[shallow]).dropna()]


def fmt_interval(values: list[float], digits: int = 3) -> str:
    iv = seed_interval(values)
    if iv.n == 0:
        return "–"
    if iv.n < 2 or not math.isfinite(iv.lo):
        return f"{iv.mean:+.{digits}f} (1 seed)"
    return f"{iv.mean:+.{digits}f} [{iv.lo:+.{digits}f}, {iv.hi:+.{digits}f}]"


def loss_cell(hit: pd.DataFrame) -> str:
    """A table cell for one (arch, depth) row of `seed_means`: mean ± half-width of the seed interval, the mean
    alone with one seed, "–" when the cell was not trained."""
    if hit.empty:
        return "–"
    r = hit.iloc[0]
    half = (r["val_loss_hi"] - r["val_loss_lo"]) / 2
    return f"{r['val_loss']:.4f} ± {half:.4f}" if math.isfinite(half) else f"{r['val_loss']:.4f}"


def markdown(cells: pd.DataFrame, baseline: str) -> str:
    means = seed_means(cells, value="val_loss", keys=("arch", "n_layer"))
    depths = sorted({int(n) for n in cells["n_layer"]})
    archs = sorted(cells["arch"].unique(), key=lambda a: (a != baseline, a))
    lines = ["| arch | " + " | ".join(f"L{n}" for n in depths) + " |", "|---" * (len(depths) + 1) + "|"]
    for arch in archs:
        row = [arch]
        for n in depths:
            row.append(loss_cell(means[(means["arch"] == arch) & (means["n_layer"] == n)]))
        lines.append("| " + " | ".join(row) + " |")
    d_models = cells.groupby(["arch", "n_layer"])["d_model"].first()
    lines += ["", "d_model per depth: " + "; ".join(
        f"{a}: " + ", ".join(f"L{n}={int(d_models[a, n])}" for n in depths if (a, n) in d_models) for a in archs)]
    slopes = loss_slopes(cells)
    steps = list(zip(depths, depths[1:]))
    head = ["arch", "slope per doubling of L"] + [f"L{a}→L{b}" for a, b in steps] \
        + [f"L{depths[0]}→L{depths[-1]}", f"slope − {baseline} slope (Welch)"]
    lines += ["", "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    base = slopes[slopes["arch"] == baseline]["slope"].tolist()
    for arch in archs:
        own = slopes[slopes["arch"] == arch]["slope"].tolist()
        row = [arch, fmt_interval(own)]
        row += [fmt_interval(paired_changes(cells, arch, a, b)) for a, b in steps]
        row.append(fmt_interval(paired_changes(cells, arch, depths[0], depths[-1])))
        if arch == baseline or len(own) < 2 or len(base) < 2:
            row.append("–")
        else:
            c = contrast(own, base)
            verdict = "tie (covers 0)" if c.lo <= 0 <= c.hi else ("loses less with depth" if c.hi < 0 else
                                                                   "loses more with depth")
            row.append(f"{c.mean:+.3f} [{c.lo:+.3f}, {c.hi:+.3f}]: {verdict}")
        lines.append("| " + " | ".join(row) + " |")
    n_seeds = cells.groupby(["arch", "n_layer"])["seed"].nunique()
    lines += ["", f"Seeds per cell group: {int(n_seeds.min())}–{int(n_seeds.max())}; intervals are 95% Student-t "
              "across training seeds (per-seed slopes and paired per-seed differences)."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("grid", type=Path)
    parser.add_argument("--baseline", default="preln")
    args = parser.parse_args()
    cells = cells_frame(read_grid(args.grid).cells).dropna(subset=["val_loss"])
    if cells.empty:
        raise SystemExit(f"{args.grid}: no finished cell (no eval.json)")
    print(f"{len(cells)} finished cells in {args.grid}\n")
    print(markdown(cells, args.baseline))


if __name__ == "__main__":
    main()
