"""CPU training-step cost of every registered architecture, relative to Pre-LN in the same run.

One step = forward + cross-entropy + backward + AdamW step, at a deep-narrow shape (default L=32,
d=64, 4 heads, batch 8, seq 128, vocab 256). Each architecture runs in its own fresh subprocess so
its peak memory can be read cleanly:

    ms/step   median wall time over the interleaved timed reps (after warmup)
    x preln   ms/step ÷ Pre-LN's ms/step measured in this run
    peak MiB  ru_maxrss after two steps − RSS just before the first step (model already built):
              the step's working set (activations, grads, AdamW state, temporaries)
    mem x     peak MiB ÷ Pre-LN's

Usage: python benchmarks/bench_arch_step.py [--threads 2] [--reps 5] [--warmup 2] [--arch attnres ...]
"""

from __future__ import annotations

import argparse
import json
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
    """A model, its AdamW optimizer and a closure running one training step."""
    import torch

    from depthtools.arch import DepthModel
    from depthtools.config import ModelConfig

    cfg = ModelConfig(arch=arch, vocab_size=args.vocab, d_model=args.d_model, n_layer=args.n_layer,
                      n_heads=args.n_heads, max_seq_len=args.seq)
    model = DepthModel(cfg, seed=0).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
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


def measure_times(names: list[str], args) -> dict[str, float]:
    """Median ms/step per architecture, reps interleaved round-robin so load drifts hit all alike."""
    import torch

    torch.set_num_threads(args.threads)
    steps = {name: build_step(name, args)[1] for name in names}
    for step in steps.values():
        for _ in range(args.warmup):
            step()
    times = {name: [] for name in names}
    for _ in range(args.reps):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return {name: 1000 * statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--n-layer", dest="n_layer", type=int, default=32)
    parser.add_argument("--d-model", dest="d_model", type=int, default=64)
    parser.add_argument("--n-heads", dest="n_heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--arch", nargs="*", help="architectures to run (default: all registered)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:  # inside the subprocess: measure one architecture, print JSON
        print(json.dumps(measure_memory(args.child, args)))
        return

    from depthtools.arch import list_archs

    names = args.arch or [spec.name for spec in list_archs()]
    names = ["preln"] + [n for n in names if n != "preln"]  # the baseline first
    passthrough = _strip_arch_values(sys.argv[1:])
    rows = []
    for name in names:
        out = subprocess.run([sys.executable, __file__, *passthrough, "--child", name],
                             capture_output=True, text=True)
        if out.returncode:
            print(f"{name:14s} FAILED: {out.stderr.strip().splitlines()[-1] if out.stderr else out.returncode}")
            continue
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    times = measure_times([row["arch"] for row in rows], args)
    for row in rows:
        row["ms"] = times[row["arch"]]
        _print_row(row, rows[0])
    print(f"\nL={args.n_layer} d={args.d_model} heads={args.n_heads} batch={args.batch} seq={args.seq} "
          f"vocab={args.vocab} threads={args.threads} reps={args.reps} (median) warmup={args.warmup}")


def _strip_arch_values(argv: list[str]) -> list[str]:
    """argv without `--arch a b c` (the parent picks the architectures)."""
    out, skipping = [], False
    for a in argv:
        if a == "--arch":
            skipping = True
            continue
        if skipping and not a.startswith("--"):
            continue
        skipping = False
        out.append(a)
    return out


_HEADER_PRINTED = False


def _print_row(row: dict, base: dict) -> None:
    global _HEADER_PRINTED
    if not _HEADER_PRINTED:
        print(f"{'arch':14s} {'params':>9s} {'ms/step':>9s} {'x preln':>8s} {'peak MiB':>9s} {'mem x':>6s}")
        _HEADER_PRINTED = True
    print(f"{row['arch']:14s} {row['params']:9d} {row['ms']:9.1f} {row['ms'] / base['ms']:8.2f} "
          f"{row['peak_mib']:9.1f} {row['peak_mib'] / base['peak_mib']:6.2f}", flush=True)


if __name__ == "__main__":
    main()
