"""Compiled vs eager training steps (issue 20): same-run ratios to eager Pre-LN, warm and whole-run.

Reuses bench_arch_step's machinery: every model in its own worker process (as in training), steps
interleaved round-robin in shuffled order, Pre-LN eager the baseline of every ratio. Each
architecture runs eager ("hc") and through its compiled regions ("hc+compile", the trainer's
--compile on). Workers start one after another, so each one's first step -- which includes
compiling its regions -- runs alone; the inductor cache starts empty (a fresh folder per batch
size, --cache to reuse one), so compile times are cold-cache figures.

    warm ms     median wall ms of the timed steps (after --warmup steps)
    x preln     median over rounds of this step ÷ eager Pre-LN's step in the same round
    first s     wall time of the first step (compilation included)
    compile s   first step − warm step: the compilation's cost
    run x       whole-run ratio for --run-steps steps, compile included:
                (first + (run_steps − 1) × warm) ÷ the same for eager Pre-LN -- extrapolated from the
                measured first and warm steps, not a timed 500-step run

Usage: python benchmarks/bench_compile.py [--batches 8 16] [--reps 7] [--arch preln hc mhc attnres moda]
       [--run-steps 500] [--profile ARCH+compile]   (--profile: a torch.profiler table of 2 warm steps)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_arch_step  # noqa: E402


def shape_args(batch: int, args) -> argparse.Namespace:
    return argparse.Namespace(threads=1, reps=args.reps, warmup=args.warmup, n_layer=args.n_layer, d_model=args.d_model,
                              n_heads=4, batch=batch, seq=128, vocab=256, processes="one")


def run_batch(batch: int, names: list[str], args) -> list[dict]:
    shape = shape_args(batch, args)
    # bench_arch_step's workers re-parse argv: hand them exactly this shape
    sys.argv = [sys.argv[0], "--threads", "1", "--reps", str(args.reps), "--warmup", str(args.warmup),
                "--n-layer", str(args.n_layer), "--d-model", str(args.d_model), "--batch", str(batch)]
    times = bench_arch_step.measure_times(names, shape)
    rows, base = [], times["preln"]
    base_run = base["warmup_s"][0] + (args.run_steps - 1) * base["ms"] / 1000
    for name in names:
        t = times[name]
        first, warm = t["warmup_s"][0], t["ms"] / 1000
        run = first + (args.run_steps - 1) * warm
        rows.append({"name": name, "batch": batch, "ms": t["ms"], "x": t["x"], "cpu_x": t["cpu_x"], "first_s": first,
                     "compile_s": max(0.0, first - warm), "run_x": run / base_run})
    return rows


def profile(name: str, args) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile as torch_profile

    torch.set_num_threads(1)
    _, step = bench_arch_step.build_step(name, shape_args(args.batches[0], args))
    for _ in range(3):
        step()
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--arch", nargs="+", default=["preln", "hc", "mhc", "attnres", "moda", "blockattnres",
                                                      "denseformer"])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--n-layer", dest="n_layer", type=int, default=32)
    parser.add_argument("--d-model", dest="d_model", type=int, default=64)
    parser.add_argument("--run-steps", dest="run_steps", type=int, default=500)
    parser.add_argument("--cache", help="inductor cache folder (default: a fresh one per batch size: cold)")
    parser.add_argument("--profile", help="print a profiler table for this model (e.g. mhc+compile) and exit")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    if args.profile:
        profile(args.profile, args)
        return
    names = ["preln"] + [n for a in args.arch for n in (a, f"{a}+compile") if n != "preln"]
    rows = []
    for batch in args.batches:
        os.environ["DEPTHTOOLS_COMPILE_CACHE"] = args.cache or tempfile.mkdtemp(prefix="depthtools-inductor-")
        rows += run_batch(batch, names, args)
        print(f"batch {batch}x128 done", file=sys.stderr, flush=True)
    print(f"\nL={args.n_layer} d={args.d_model} heads=4 seq=128 vocab=256 threads=1 reps={args.reps} (median) "
          f"warmup={args.warmup}; run x = {args.run_steps} steps extrapolated from first + warm steps\n")
    print("| model | batch | warm ms | x preln (wall) | x preln (CPU) | first step s | compile s | run x |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {r['batch']}x128 | {r['ms']:.0f} | {r['x']:.2f} | {r['cpu_x']:.2f} | {r['first_s']:.1f} | "
              f"{r['compile_s']:.1f} | {r['run_x']:.2f} |")


if __name__ == "__main__":
    main()
