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

--timed-run: instead, TIME whole runs of --run-steps training steps, each in a fresh process (model
build + every step, compilation included; interpreter start and imports excluded), one process at a
time: eager Pre-LN first and last (the baseline is their mean), then per architecture the eager run,
"+compile" with a COLD inductor cache (an empty folder) and "+compile" again with that folder WARM
(what a second run on the machine sees). Reported: run wall s, ratio to eager Pre-LN's run, first step
s, and extra s = the run minus run_steps × its median step (model build and the first steps' extra:
compilation, for "+compile").

Usage: python benchmarks/bench_compile.py [--batches 8 16] [--reps 7] [--arch preln hc mhc attnres moda]
       [--run-steps 500] [--profile ARCH+compile]   (--profile: a torch.profiler table of 2 warm steps)
       python benchmarks/bench_compile.py --timed-run [--run-steps 500] [--batches 8] [--arch hc mhc] [--skip-eager]
       python benchmarks/bench_compile.py --timed-run --eager-only --arch moda moda+bf16kv   (MoDA: eager runs only)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
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


def run_worker(name: str, batch: int, args) -> None:
    """One whole timed run in this (fresh) process: build the model, then --run-steps steps."""
    import torch

    import depthtools.arch.compiled  # noqa: F401  (imports before the clock: build_step imports lazily)
    import depthtools.train.optim  # noqa: F401

    torch.set_num_threads(1)
    start = time.perf_counter()
    _, step = bench_arch_step.build_step(name, shape_args(batch, args))
    steps = []
    for _ in range(args.run_steps):
        t = time.perf_counter()
        step()
        steps.append(time.perf_counter() - t)
    total = time.perf_counter() - start
    print(json.dumps({"total_s": total, "first_s": steps[0], "median_s": statistics.median(steps)}), flush=True)


def timed_runs(names: list[str], batch: int, args) -> list[dict]:
    def one(name: str, cache: str) -> dict:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "DEPTHTOOLS_COMPILE_CACHE": cache, "TORCHINDUCTOR_CACHE_DIR": cache}
        cmd = [sys.executable, __file__, "--run-worker", name, "--batches", str(batch), "--run-steps",
               str(args.run_steps), "--n-layer", str(args.n_layer), "--d-model", str(args.d_model)]
        out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
        result = json.loads(out.strip().splitlines()[-1])
        print(f"  {name} batch {batch}: {result}", file=sys.stderr, flush=True)
        return result

    rows = []
    base = [one("preln", tempfile.mkdtemp(prefix="depthtools-inductor-"))]
    for name in names:
        if args.eager_only:  # e.g. MoDA, which has no compiled region: its eager run(s) only
            rows.append({"name": name, "cache": "-", **one(name, tempfile.mkdtemp(prefix="depthtools-inductor-"))})
            continue
        if name != "preln" and not args.skip_eager:
            rows.append({"name": name, "cache": "-", **one(name, tempfile.mkdtemp(prefix="depthtools-inductor-"))})
        cache = tempfile.mkdtemp(prefix="depthtools-inductor-")
        rows.append({"name": f"{name}+compile", "cache": "cold", **one(f"{name}+compile", cache)})
        rows.append({"name": f"{name}+compile", "cache": "warm", **one(f"{name}+compile", cache)})
    base.append(one("preln", tempfile.mkdtemp(prefix="depthtools-inductor-")))
    base_total = statistics.mean(b["total_s"] for b in base)
    rows.insert(0, {"name": "preln", "cache": "-", "total_s": base_total, "first_s": base[0]["first_s"],
                    "median_s": statistics.mean(b["median_s"] for b in base),
                    "note": " / ".join(f"{b['total_s']:.0f}" for b in base)})
    for r in rows:
        r["batch"], r["x"] = batch, r["total_s"] / base_total
        r["compile_s"] = max(0.0, r["total_s"] - args.run_steps * r["median_s"])
    return rows


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
    parser.add_argument("--timed-run", dest="timed_run", action="store_true",
                        help="time whole --run-steps runs in fresh processes, cold and warm inductor cache")
    parser.add_argument("--eager-only", dest="eager_only", action="store_true",
                        help="--timed-run: time each --arch name as given (no +compile runs), e.g. moda moda+bf16kv")
    parser.add_argument("--skip-eager", dest="skip_eager", action="store_true",
                        help="--timed-run: time only eager Pre-LN and the compiled runs (not each eager architecture)")
    parser.add_argument("--run-worker", dest="run_worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    if args.run_worker:
        run_worker(args.run_worker, args.batches[0], args)
        return
    if args.profile:
        profile(args.profile, args)
        return
    if args.timed_run:
        rows = [r for batch in args.batches for r in timed_runs(args.arch, batch, args)]
        print(f"\nL={args.n_layer} d={args.d_model} heads=4 seq=128 vocab=256 threads=1; timed runs of {args.run_steps} "
              "steps (model build + steps, compile included), fresh process each, one at a time\n")
        print("| model | batch | inductor cache | run s | x eager preln run | first step s | median step ms | extra s |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            total = f"{r['total_s']:.0f}" + (f" (runs {r['note']})" if "note" in r else "")
            print(f"| {r['name']} | {r['batch']}x128 | {r['cache']} | {total} | {r['x']:.2f} | {r['first_s']:.1f} | "
                  f"{1000 * r['median_s']:.0f} | {r['compile_s']:.1f} |")
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
