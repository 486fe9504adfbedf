"""Issue 37 part 4: does Full AttnRes's depth trend change under DepthBench's recipe?

Pre-LN and Full AttnRes at L4 and L32 with the afternoon preset's shapes and recipe (~0.42M parameters,
2.5M tokens per cell, lr 3e-3), 3 training seeds, trained twice: with depthtools' default recipe and with
the `depthbench` profile (depthtools.profiles: DepthBench's weight-decay groups, norm eps 1e-6, its
scale-free AdamW/schedule choices; the afternoon LR stays). Then, per recipe:

  * the val-loss slope per doubling of L, fitted per seed on log2(n_layer) (with the two depths L4 and
    L32: (loss(L32) - loss(L4)) / 3), as a mean with its 95% t-interval over seeds;
  * the AttnRes - Pre-LN slope difference, Welch over the two sets of seeds (positive: AttnRes loses
    more with depth than Pre-LN; the README's afternoon grid: +0.014 [+0.010, +0.018] at L4..L32);
  * and, across recipes, how much each slope and that difference change from the default recipe to the
    profile (a Welch-Satterthwaite interval over the independent seed samples).

Run (24 cells; on 2 CPU cores about 1.5-2 h, an estimate scaled from the afternoon grid's measured
2 h 02 min for 36 cells, not measured here):
  python benchmarks/depthbench_attnres.py plan --out-dir runs
  depthtools grid train runs/attnres-depthtools.json --workers 2 --threads 1
  depthtools grid train runs/attnres-depthbench.json --workers 2 --threads 1
  python benchmarks/depthbench_attnres.py table --root checkpoints

A toy end-to-end check (seconds): plan --prefix toy --layers 2,4 --seeds 0 --tokens 8192, train both
specs, then table --prefix toy.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parent))  # grid_table.py, beside this file

from depthtools.analysis.seeds import seed_means, welch_combination  # noqa: E402
from depthtools.grid import parse_seeds, save_grid  # noqa: E402
from depthtools.presets import get_preset  # noqa: E402
from depthtools.profiles import apply_to_spec  # noqa: E402

from grid_table import fmt_interval, loss_cell, loss_slopes  # noqa: E402

RECIPES = ("depthtools", "depthbench")  # depthtools' default recipe, then the profile
ARCHS = ("preln", "attnres")

# The default recipe's L4 -> L32 loss change per architecture as recorded from the `afternoon` grid (the same
# cells: preset shapes, data, recipe and seeds 0-2; trained 2026-12-04 with `depthtools grid train --preset
# afternoon --workers 2`, table by `python benchmarks/grid_table.py checkpoints/afternoon --baseline preln`,
# README/docs/seeds.md): mean and 95% t-interval over 3 seeds, rounded to 3 decimals. `table --default recorded`
# compares the profile's grid against these when the default-recipe grid was not retrained.
RECORDED_DEFAULT_L4_L32 = {"preln": (0.074, 0.058, 0.089, 3), "attnres": (0.119, 0.102, 0.135, 3)}


def grid_name(prefix: str, recipe: str) -> str:
    return f"{prefix}-{recipe}"


def plan_specs(prefix: str, layers: list[int], seeds: list[int], tokens: int | None) -> dict[str, dict]:
    """The two grid specs: the afternoon preset's Pre-LN and Full AttnRes at `layers`, the second under
    the depthbench profile (depthtools.profiles.apply_to_spec, as `grid plan --profile` does)."""
    preset = get_preset("afternoon")
    plan = {**preset.plan, "arch": list(ARCHS), "layers": layers, "seeds": seeds}
    from depthtools.grid import grid_spec, plan_grid

    cells = plan_grid(**plan)
    train = dict(preset.train)
    if tokens is not None:
        train["tokens"] = tokens
    specs = {}
    for recipe in RECIPES:
        spec = grid_spec(cells, name=grid_name(prefix, recipe), train=train, data=preset.data, plan=plan)
        specs[recipe] = apply_to_spec(spec, recipe) if recipe != "depthtools" else spec
    return specs


def read_cells(root: Path, prefix: str, recipes: tuple[str, ...] = RECIPES) -> pd.DataFrame:
    """Finished cells of the recipes' grids, one row each, with a `recipe` column."""
    from depthtools.report.data import read_grid
    from depthtools.report.frames import cells_frame

    frames = []
    for recipe in recipes:
        grid = root / grid_name(prefix, recipe)
        if not grid.is_dir():
            raise SystemExit(f"{grid}: no such grid folder; train it first (see this script's docstring)")
        cells = cells_frame(read_grid(grid).cells).dropna(subset=["val_loss"])
        frames.append(cells.assign(recipe=recipe))
    return pd.concat(frames, ignore_index=True)


def slopes_by(cells: pd.DataFrame) -> dict[tuple[str, str], list[float]]:
    """{(recipe, arch): per-seed slopes of val loss per doubling of L}."""
    out = {}
    for recipe, sub in cells.groupby("recipe"):
        s = loss_slopes(sub)
        for arch in ARCHS:
            out[(recipe, arch)] = s[s["arch"] == arch]["slope"].tolist()
    return out


def fmt_combination(samples, weights, digits: int = 3) -> str:
    iv = welch_combination(samples, weights)
    if iv.n == 0:
        return "–"
    if not iv.has_noise:
        return f"{iv.mean:+.{digits}f} ({iv.n} seed: no interval)"
    verdict = "covers 0" if iv.lo <= 0 <= iv.hi else "excludes 0"
    return f"{iv.mean:+.{digits}f} [{iv.lo:+.{digits}f}, {iv.hi:+.{digits}f}] ({verdict})"


def markdown(cells: pd.DataFrame) -> str:
    depths = sorted({int(n) for n in cells["n_layer"]})
    means = seed_means(cells, value="val_loss", keys=("recipe", "arch", "n_layer"))
    lines = ["| recipe | arch | " + " | ".join(f"L{n} val loss" for n in depths) + " |",
             "|---" * (len(depths) + 2) + "|"]
    for recipe in RECIPES:
        for arch in ARCHS:
            row = [recipe, arch]
            for n in depths:
                row.append(loss_cell(means[(means["recipe"] == recipe) & (means["arch"] == arch) & (means["n_layer"] == n)]))
            lines.append("| " + " | ".join(row) + " |")
    s = slopes_by(cells)
    lines += ["", "| recipe | Pre-LN slope per doubling of L | Full AttnRes slope | AttnRes − Pre-LN (Welch) |",
              "|---|---|---|---|"]
    for recipe in RECIPES:
        lines.append(f"| {recipe} | {fmt_interval(s[(recipe, 'preln')])} | {fmt_interval(s[(recipe, 'attnres')])} | "
                     f"{fmt_combination([s[(recipe, 'attnres')], s[(recipe, 'preln')]], [1, -1])} |")
    d, b = RECIPES
    lines.append(f"| {b} − {d} | {fmt_combination([s[(b, 'preln')], s[(d, 'preln')]], [1, -1])} | "
                 f"{fmt_combination([s[(b, 'attnres')], s[(d, 'attnres')]], [1, -1])} | "
                 f"{fmt_combination([s[(b, 'attnres')], s[(b, 'preln')], s[(d, 'attnres')], s[(d, 'preln')]], [1, -1, -1, 1])} |")
    n_seeds = cells.groupby(["recipe", "arch", "n_layer"])["seed"].nunique()
    lines += ["", f"Depths {', '.join(f'L{n}' for n in depths)}; seeds per cell group: {int(n_seeds.min())}–"
              f"{int(n_seeds.max())}. Intervals are 95% Student-t over training seeds (slopes fitted per seed); "
              "differences are Welch(-Satterthwaite) over independent seed samples."]
    return "\n".join(lines)


def _stats_from_interval(mean: float, lo: float, hi: float, n: int, per: float) -> tuple[float, float, int]:
    """(mean, standard error, n) of a recorded 95% t-interval over n seeds, scaled by 1/per."""
    half = (hi - lo) / 2
    return mean / per, half / stats.t.ppf(0.975, n - 1) / per, n


def welch_from_stats(parts: list[tuple[float, float, int]], weights: list[float]) -> tuple[float, float, float]:
    """Σ w_k m_k with its 95% Welch-Satterthwaite interval from summary statistics (mean, se, n) of
    independent seed samples (what `seeds.welch_combination` computes from the samples themselves)."""
    value = sum(w * m for w, (m, _, _) in zip(weights, parts))
    v = [w * w * se * se for w, (_, se, _) in zip(weights, parts)]
    dof = sum(v) ** 2 / sum(vk * vk / (n - 1) for vk, (_, _, n) in zip(v, parts))
    half = stats.t.ppf(0.975, dof) * math.sqrt(sum(v))
    return value, value - half, value + half


def recorded_comparison(cells: pd.DataFrame) -> str:
    """The profile's per-seed slopes (L4, L32 only) against the recorded default recipe (RECORDED_DEFAULT_L4_L32)."""
    s = slopes_by(cells)
    doublings = math.log2(32 / 4)
    rec = {a: _stats_from_interval(*RECORDED_DEFAULT_L4_L32[a][:3], RECORDED_DEFAULT_L4_L32[a][3], doublings)
           for a in ARCHS}
    prof = {a: (float(np.mean(s[("depthbench", a)])),
                float(np.std(s[("depthbench", a)], ddof=1) / math.sqrt(len(s[("depthbench", a)]))),
                len(s[("depthbench", a)])) for a in ARCHS}

    def show(v):
        m, lo, hi = v
        return f"{m:+.4f} [{lo:+.4f}, {hi:+.4f}] ({'covers 0' if lo <= 0 <= hi else 'excludes 0'})"

    lines = ["| recipe | Pre-LN slope per doubling (L4->L32) | Full AttnRes slope | AttnRes - Pre-LN (Welch) |",
             "|---|---|---|---|"]
    for name, src in (("depthtools (recorded)", rec), ("depthbench profile", prof)):
        lines.append(f"| {name} | " + " | ".join(show(welch_from_stats([src[a]], [1])) for a in ARCHS)
                     + f" | {show(welch_from_stats([src['attnres'], src['preln']], [1, -1]))} |")
    lines.append("| profile - default | " + " | ".join(show(welch_from_stats([prof[a], rec[a]], [1, -1])) for a in ARCHS)
                 + f" | {show(welch_from_stats([prof['attnres'], prof['preln'], rec['attnres'], rec['preln']], [1, -1, -1, 1]))} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="write the two grid specs")
    plan.add_argument("--out-dir", type=Path, default=Path("."))
    plan.add_argument("--prefix", default="attnres", help="grid names are PREFIX-depthtools and PREFIX-depthbench")
    plan.add_argument("--layers", default="4,32")
    plan.add_argument("--seeds", default="0,1,2")
    plan.add_argument("--tokens", type=int, default=None, help="token budget per cell (default: the afternoon preset's)")
    table = sub.add_parser("table", help="print the slopes and differences of the trained grids")
    table.add_argument("--root", type=Path, default=Path("checkpoints"))
    table.add_argument("--prefix", default="attnres")
    table.add_argument("--default", choices=("trained", "recorded"), default="trained",
                       help="recorded: compare the profile's grid with the afternoon grid's recorded default-recipe "
                            "intervals (RECORDED_DEFAULT_L4_L32) instead of a retrained default grid")
    args = parser.parse_args()
    if args.command == "plan":
        layers = [int(v) for v in args.layers.split(",")]
        args.out_dir.mkdir(parents=True, exist_ok=True)
        for recipe, spec in plan_specs(args.prefix, layers, parse_seeds(args.seeds), args.tokens).items():
            path = save_grid(spec, args.out_dir / f"{grid_name(args.prefix, recipe)}.json")
            print(f"wrote {path} ({len(spec['cells'])} cells)")
        return
    if args.default == "recorded":
        cells = read_cells(args.root, args.prefix, recipes=("depthbench",))
        print(f"{len(cells)} finished cells of the profile's grid under {args.root}\n")
        print(recorded_comparison(cells))
        return
    cells = read_cells(args.root, args.prefix)
    print(f"{len(cells)} finished cells under {args.root}\n")
    print(markdown(cells))


if __name__ == "__main__":
    main()
