"""Design study for the embedded default: train one candidate configuration and measure its effect and seed noise.

A candidate is a preset with some plan/recipe fields overridden. The script trains the candidate's grid
(every (arch, depth, seed) cell, in `--workers` 1-thread processes, as `depthtools demo` does), times it,
and prints, from the cells' eval.json:

  * the final val loss per (arch, depth): mean over seeds with the t-interval across seeds;
  * the depth effect per arch, loss(deepest) - loss(shallowest), per seed and as mean ± interval;
  * the contrast of every arch's depth effect against `--baseline` (Welch t-interval): negative means
    the arch loses less (or gains more) than the baseline when going deep-narrow — DepthBench's direction.

Example (the configuration the `demo` preset uses):
  python benchmarks/demo_design.py --preset demo --root /tmp/design --tag demo
  python benchmarks/demo_design.py --preset demo --arch preln,hc,attnres --layers 2,4,8 --seeds 0,1,2 \
      --tokens 400000 --budget 500000 --tag A
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pandas as pd

from depthtools.analysis.seeds import contrast, depth_effects, seed_means
from depthtools.grid import grid_spec, parse_seeds, plan_grid
from depthtools.presets import get_preset
from depthtools.train.launch import launch_local


def candidate_spec(args) -> dict:
    preset = get_preset(args.preset)
    plan, train = dict(preset.plan), dict(preset.train)
    if args.arch:
        plan["arch"] = args.arch.split(",")
    if args.layers:
        plan["layers"] = [int(v) for v in args.layers.split(",")]
    if args.budget:
        plan["budget"] = int(float(args.budget))
    if args.seeds:
        plan["seeds"] = parse_seeds(args.seeds)
    if args.tolerance:
        plan["tolerance"] = args.tolerance
    for key in ("tokens", "batch_size", "lr"):
        value = getattr(args, key)
        if value is not None:
            train[key] = value
    if args.no_tasks:
        train.pop("task_mix", None)
    return grid_spec(plan_grid(**plan), name=f"design_{args.tag}", train=train, data=preset.data, plan=plan)


def cells_table(grid_dir: Path) -> pd.DataFrame:
    """One row per trained cell (model, arch, n_layer, d_model, seed, val_loss, ...), as the grid report reads it."""
    from depthtools.report.data import read_grid
    from depthtools.report.frames import cells_frame

    return cells_frame(read_grid(grid_dir).cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--arch")
    parser.add_argument("--layers")
    parser.add_argument("--budget")
    parser.add_argument("--seeds")
    parser.add_argument("--tolerance", type=float)
    parser.add_argument("--tokens", type=int)
    parser.add_argument("--batch-size", dest="batch_size", type=int)
    parser.add_argument("--lr", type=float)
    parser.add_argument("--no-tasks", action="store_true", help="Drop the preset's task mix.")
    parser.add_argument("--baseline", default="preln")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--root", default="/tmp/demo_design")
    parser.add_argument("--data-root", default="data")
    parser.add_argument("--tag", default="candidate")
    args = parser.parse_args()

    spec = candidate_spec(args)
    start = time.perf_counter()
    results = launch_local(spec, root=args.root, data_root=args.data_root, workers=args.workers, threads=1)
    wall = time.perf_counter() - start
    failed = [r for r in results if r.get("error")]
    if failed:
        raise SystemExit(f"{len(failed)} cell(s) failed: {failed[0]['error']}")
    cells = cells_table(Path(args.root) / spec["name"])
    means = seed_means(cells)
    effects = depth_effects(cells)
    base = effects.set_index("arch").loc[args.baseline, "per_seed"] if args.baseline in set(effects["arch"]) else None
    print(f"# candidate {args.tag}: {len(cells)} cells, train wall {wall:.0f} s ({args.workers} workers)")
    print(means[["arch", "n_layer", "val_loss", "val_loss_lo", "val_loss_hi", "val_loss_sd", "n_seeds"]]
          .to_string(index=False, float_format=lambda v: f"{v:.4f}"))
    for row in effects.itertuples():
        line = (f"{row.arch}: loss(L{row.deep}) - loss(L{row.shallow}) = {row.effect:+.4f} "
                f"[{row.effect_lo:+.4f}, {row.effect_hi:+.4f}] over {row.n_seeds} seeds; per seed "
                + ", ".join(f"{v:+.4f}" for v in row.per_seed))
        if base is not None and row.arch != args.baseline:
            c = contrast(row.per_seed, base)
            line += f"; minus {args.baseline}: {c.mean:+.4f} [{c.lo:+.4f}, {c.hi:+.4f}]"
        print(line)
    out = Path(args.root) / f"{spec['name']}.json"
    out.write_text(json.dumps({"args": vars(args), "train_wall_s": wall, "cells": cells.to_dict(orient="records"),
                               "effects": effects.to_dict(orient="records")}, indent=1, default=str))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
