"""CPU training-step cost of every registered architecture, relative to Pre-LN in the same run.

One step = forward + cross-entropy + backward + the trainer's AdamW step (`build_optimizer`: its
parameter groups, fused kernel), at a deep-narrow shape (default L=32,
d=64, 4 heads, batch 8, seq 128, vocab 256), torch pinned to `--threads` (default 1) threads.
Each architecture's peak memory is read in its own fresh subprocess. Steps are interleaved
round-robin, the order shuffled every round (drifting machine load hits all architectures alike),
Pre-LN included, in one of two ways:

    --processes one   (default) every model in its OWN worker process, as in training, where one
                      model owns its process: its allocator state and page reuse are its own. The
                      coordinator runs one worker's step at a time (the others wait on a pipe).
    --processes shared  all models in ONE process (the script's earlier method): each step then
                      also pays for the other models' heap (fragmentation, freed-and-refaulted
                      pages, evicted caches), which no training run sees.

    ms/step   median wall time over the timed rounds (after warmup)
    x preln   median over rounds of (this arch's step time ÷ Pre-LN's in the same round), wall clock
    cpu x     the same ratio on process CPU time: on a shared machine this leaves out the time the
              process waits for a core (the more stable figure when other jobs run; memory-bandwidth
              contention still counts)
    peak MiB  ru_maxrss after two steps − RSS just before the first step (model already built):
              the step's working set (activations, grads, AdamW state, temporaries)
    mem x     peak MiB ÷ Pre-LN's

Same-run A/B of two checkouts (`--old-tree PATH`, with --processes one): every architecture also runs as
"ARCH@old", a worker whose `depthtools` is imported from PATH (e.g. a `git worktree` of an earlier commit), in the
same shuffled rounds; the table then adds "new/old", the median per-round ratio of this checkout's step time to
the old checkout's (wall clock and CPU time), the figure that isolates a code change from machine drift.

Usage: python benchmarks/bench_arch_step.py [--threads 1] [--reps 9] [--warmup 2] [--arch hc mhc ...]
       [--processes one|shared] [--no-memory] [--markdown] [--old-tree PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing


def rss_mib() -> float:
    """Current resident set size (Linux /proc)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    import os

    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def build_step(arch: str, args):
    """A model, its AdamW optimizer and a closure running one training step. "ARCH+compile": the
    model trains through its compiled regions (depthtools.arch.compiled, the trainer's --compile on);
    "moda+bf16kv": MoDA with option moda_kv_dtype="bfloat16"."""
    import torch

    from depthtools.arch import DepthModel, compiled
    from depthtools.config import ModelConfig, TrainConfig
    from depthtools.train.optim import build_optimizer

    arch, _, variant = arch.partition("+")
    options = {"moda_kv_dtype": "bfloat16"} if variant == "bf16kv" else {}  # MoDA's bfloat16 depth K/V cache
    cfg = ModelConfig(arch=arch, vocab_size=args.vocab, d_model=args.d_model, n_layer=args.n_layer,
                      n_heads=args.n_heads, max_seq_len=args.seq, options=options)
    model = DepthModel(cfg, seed=0).train()
    if variant == "compile":
        compiled.enable(model)
    optimizer, _ = build_optimizer(model, TrainConfig(), torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def train_step() -> None:
        logits = model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return model, train_step


def measure_memory(arch: str, args) -> dict:
    """Peak step memory of one architecture (run inside a fresh subprocess)."""
    import torch

    torch.set_num_threads(args.threads)
    model, train_step = build_step(arch, args)
    base_rss = rss_mib()
    for _ in range(2):  # the second step has AdamW state allocated
        train_step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB on Linux
    return {"arch": arch, "peak_mib": peak - base_rss, "params": model.param_counts()["total"]}


def timed(step) -> tuple[float, float]:
    """(wall s, process CPU s) of one call."""
    w0, c0 = time.perf_counter(), time.process_time()
    step()
    return time.perf_counter() - w0, time.process_time() - c0


def run_worker(arch: str, args) -> None:
    """Worker process: build one model, warm up, then time one step per "step" line on stdin. "ARCH@old": the
    model of the checkout at --old-tree (its `depthtools` first on sys.path)."""
    arch, _, old = arch.partition("@")
    if old:
        sys.path.insert(0, str(Path(args.old_tree).resolve()))
    import torch

    torch.set_num_threads(args.threads)
    model, step = build_step(arch, args)
    warmup = [timed(step)[0] for _ in range(args.warmup)]  # the first includes any compilation
    print(json.dumps({"params": model.param_counts()["total"], "warmup_s": warmup}), flush=True)
    for line in sys.stdin:
        if line.strip() != "step":
            break
        print(json.dumps(timed(step)), flush=True)


def _reply(name: str, worker: subprocess.Popen) -> str:
    """The worker's next output line; a one-line exit if it died (its traceback is on stderr above)."""
    line = worker.stdout.readline()
    if not line:
        raise SystemExit(f"{name}: the timing worker exited with {worker.wait()} (its error is printed above)")
    return line


def measure_times(names: list[str], args) -> dict[str, dict[str, float]]:
    """Per architecture: median wall ms/step and the median per-round ratios to Pre-LN (wall, CPU)."""
    if args.processes == "one":
        workers, params, warmups = {}, {}, {}
        for name in names:  # started one after another: only one process works at a time
            workers[name] = subprocess.Popen([sys.executable, __file__, *_strip_arch_values(sys.argv[1:]), "--worker", name],
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            reply = json.loads(_reply(name, workers[name]))
            params[name], warmups[name] = reply["params"], reply.get("warmup_s")

        def step_of(name, worker):
            def step():
                worker.stdin.write("step\n")
                worker.stdin.flush()
                return tuple(json.loads(_reply(name, worker)))
            return step

        steps = {name: step_of(name, worker) for name, worker in workers.items()}
    else:
        import torch

        torch.set_num_threads(args.threads)
        built = {name: build_step(name, args) for name in names}
        params = {name: model.param_counts()["total"] for name, (model, _) in built.items()}
        for _, step in built.values():
            for _ in range(args.warmup):
                step()
        steps = {name: (lambda step=step: timed(step)) for name, (_, step) in built.items()}
    wall = {name: [] for name in names}
    cpu = {name: [] for name in names}
    order, rng = list(names), random.Random(0)
    for _ in range(args.reps):
        rng.shuffle(order)
        for name in order:
            w, c = steps[name]()
            wall[name].append(w)
            cpu[name].append(c)
    if args.processes == "one":
        for worker in workers.values():
            worker.stdin.close()
            worker.wait()
    base = names[0]
    return {name: {
        "ms": 1000 * statistics.median(wall[name]),
        "x": statistics.median(w / b for w, b in zip(wall[name], wall[base])),
        "cpu_x": statistics.median(c / b for c, b in zip(cpu[name], cpu[base])),
        "params": params[name],
        "warm_s": [1000 * w for w in wall[name]],  # every timed step (ms)
        "cpu_s": [1000 * c for c in cpu[name]],  # every timed step's process CPU time (ms)
        **({"warmup_s": warmups[name]} if args.processes == "one" else {}),
    } for name in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--n-layer", dest="n_layer", type=int, default=32)
    parser.add_argument("--d-model", dest="d_model", type=int, default=64)
    parser.add_argument("--n-heads", dest="n_heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--arch", nargs="*", help="architectures to run (default: all registered)")
    parser.add_argument("--no-memory", dest="memory", action="store_false", help="skip the peak-memory subprocesses")
    parser.add_argument("--markdown", action="store_true", help="also print the table as markdown")
    parser.add_argument("--processes", choices=("one", "shared"), default="one",
                        help="one worker process per model (default, as in training) or all models in one process")
    parser.add_argument("--old-tree", dest="old_tree", help="a checkout to A/B against in the same rounds "
                        "(adds ARCH@old workers; needs --processes one)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:  # a timing worker (--processes one)
        run_worker(args.worker, args)
        return
    if args.child:  # inside the subprocess: measure one architecture, print JSON
        print(json.dumps(measure_memory(args.child, args)))
        return

    from depthtools.arch import list_archs

    names = args.arch or [spec.name for spec in list_archs()]
    names = ["preln"] + [n for n in names if n != "preln"]  # the baseline first
    passthrough = _strip_arch_values(sys.argv[1:])
    rows = []
    for name in names:
        if not args.memory:
            rows.append({"arch": name, "peak_mib": float("nan")})
            continue
        out = subprocess.run([sys.executable, __file__, *passthrough, "--child", name],
                             capture_output=True, text=True)
        if out.returncode:
            print(f"{name:14s} FAILED: {out.stderr.strip().splitlines()[-1] if out.stderr else out.returncode}")
            continue
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    if args.old_tree:
        if args.processes != "one":
            raise SystemExit("--old-tree needs --processes one (each checkout's model in its own process)")
        times = measure_times([name for row in rows for name in (row["arch"], row["arch"] + "@old")], args)
        _print_ab(rows, times)
        return
    times = measure_times([row["arch"] for row in rows], args)
    for row in rows:
        row.update(times[row["arch"]])
        _print_row(row, rows[0])
    settings = (f"L={args.n_layer} d={args.d_model} heads={args.n_heads} batch={args.batch} seq={args.seq} "
                f"vocab={args.vocab} threads={args.threads} reps={args.reps} (median) warmup={args.warmup} "
                f"processes={args.processes}")
    print(f"\n{settings}")
    if args.markdown:
        print("\n| arch | params | ms/step | x preln (wall) | x preln (CPU time) | peak MiB | mem x |")
        print("|---|---|---|---|---|---|---|")
        for row in rows:
            print(f"| {row['arch']} | {row['params']:,} | {row['ms']:.0f} | {row['x']:.2f} | {row['cpu_x']:.2f} | "
                  f"{row['peak_mib']:.0f} | {row['peak_mib'] / rows[0]['peak_mib']:.2f} |")


def _strip_arch_values(argv: list[str]) -> list[str]:
    """argv without `--arch a b c` and the parent-only flags (the parent picks the architectures)."""
    out, skipping = [], False
    for a in argv:
        if a == "--arch":
            skipping = True
            continue
        if skipping and not a.startswith("--"):
            continue
        skipping = False
        if a not in ("--markdown", "--no-memory"):
            out.append(a)
    return out


def _print_ab(rows: list[dict], times: dict) -> None:
    """The --old-tree table: per architecture ms/step of both checkouts and the median per-round new/old ratios."""
    print(f"{'arch':14s} {'new ms':>8s} {'old ms':>8s} {'new/old':>8s} {'cpu n/o':>8s} {'x preln new':>12s} {'x preln old':>12s}")
    base_new, base_old = times["preln"], times["preln@old"]
    for row in rows:
        new, old = times[row["arch"]], times[row["arch"] + "@old"]
        ratio = statistics.median(a / b for a, b in zip(new["warm_s"], old["warm_s"]))
        cpu = statistics.median(a / b for a, b in zip(new["cpu_s"], old["cpu_s"]))
        x_new = statistics.median(a / b for a, b in zip(new["warm_s"], base_new["warm_s"]))
        x_old = statistics.median(a / b for a, b in zip(old["warm_s"], base_old["warm_s"]))
        print(f"{row['arch']:14s} {new['ms']:8.1f} {old['ms']:8.1f} {ratio:8.3f} {cpu:8.3f} {x_new:12.2f} {x_old:12.2f}",
              flush=True)


_HEADER_PRINTED = False


def _print_row(row: dict, base: dict) -> None:
    global _HEADER_PRINTED
    if not _HEADER_PRINTED:
        print(f"{'arch':14s} {'params':>9s} {'ms/step':>9s} {'x preln':>8s} {'cpu x':>6s} {'peak MiB':>9s} {'mem x':>6s}")
        _HEADER_PRINTED = True
    print(f"{row['arch']:14s} {row['params']:9d} {row['ms']:9.1f} {row['x']:8.2f} {row['cpu_x']:6.2f} "
          f"{row['peak_mib']:9.1f} {row['peak_mib'] / base['peak_mib']:6.2f}", flush=True)


if __name__ == "__main__":
    main()
