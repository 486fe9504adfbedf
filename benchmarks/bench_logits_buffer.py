"""Logits decoded into one reused block (`headmetrics.LogitsBuffer`) against a fresh tensor per call, same run.

Each side runs in its own child process (`headmetrics.REUSE_LOGITS` True / False) on the same random-weight
SmolLM-135M-shaped Llama (L 30, d 576, V 49,152) and the same 8 × 128 tokens, and times, best of `--reps`:
one sweep plan's head with its metrics (`sweep.plan_head_sums`), one forward (`run_states`), one logit-lens batch
(`lens.lens_analysis`: 31 depths) and a single-skip sweep of one batch (30 plans); with the wall time it prints the
process's system time (page faults and zeroing of fresh pages) and its peak RSS (VmHWM). The children also hash
the sweep's per-sequence sums and the lens table, which must be equal bit for bit (only where the logits are
written changes).

A fresh [1016, 49152] float32 block (200 MB) is above glibc's mmap threshold: each one is new pages that the kernel
faults in and zeroes, and unmaps on free. (Raising glibc's thresholds with mallopt removes that too, tried first:
the head was as fast, but the peak RSS of this script went from 2.6 to 4.8 GB, so it was not kept.)

    python benchmarks/bench_logits_buffer.py [--reps 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

CHILD = r"""
import hashlib, json, os, sys, time, torch
torch.set_num_threads(int(sys.argv[2]))
from depthtools.checkpoint import load
from depthtools.analysis.sweep import _Sums, Reference, plan_head_sums, scored_logprobs, sweep
from depthtools.analysis.lens import lens_analysis
from depthtools.analysis.tokens import split_inputs
from depthtools.arch.model import Plan
from depthtools.analysis import headmetrics

headmetrics.REUSE_LOGITS = sys.argv[4] == "1"
model = load(sys.argv[1]).eval()
reps = int(sys.argv[3])
tokens = torch.randint(0, model.config.vocab_size, (8, 129), generator=torch.Generator().manual_seed(0))
inputs, targets = split_inputs(tokens)
targets = targets.flatten()


def best(fn):
    wall = sys_s = float("inf")
    for _ in range(reps):
        t, w = os.times(), time.perf_counter()
        fn()
        t2, w2 = os.times(), time.perf_counter()
        wall, sys_s = min(wall, w2 - w), min(sys_s, t2.system - t.system)
    return wall, sys_s


with torch.no_grad():
    states = model.run_states(inputs)
    ref = Reference.of(scored_logprobs(model.head(states[-1])))
    fused = plan_head_sums(_Sums(), model.head(states[-1]), ref, targets, 8)
    hidden = model.scheme.final_hidden(states[-2], model.ln_final)
    out, buffer = {}, headmetrics.LogitsBuffer()  # as the sweep decodes its plans
    out["head"] = best(lambda: plan_head_sums(_Sums(), buffer.decode(model, hidden), ref, targets, 8, fused))
    out["forward"] = best(lambda: model.run_states(inputs))
    out["lens"] = best(lambda: lens_analysis(model, tokens, batch_size=8))
    plans = [Plan.skipping(l) for l in range(model.n_layer)]
    out["sweep"] = best(lambda: sweep(model, tokens, plans, batch_size=8))
    sums = torch.cat(sweep(model, tokens, plans, batch_size=8).plan_sequences)
    lens = lens_analysis(model, tokens, batch_size=8)
    out["hash"] = hashlib.sha256(sums.numpy().tobytes() + lens.depths.to_csv().encode()
                                 + lens.prediction_depth.tobytes()).hexdigest()[:16]
with open("/proc/self/status") as f:
    out["peak_mib"] = next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024
print(json.dumps(out))
"""


def child(ckpt: Path, reuse: bool, threads: int, reps: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", CHILD, str(ckpt), str(threads), str(reps), "1" if reuse else "0"],
                            env=env,
                            capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    from bench_real_size import build_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        build_checkpoint(Path(tmp), 128)
        fresh = child(Path(tmp) / "ckpt", False, args.threads, args.reps)
        reused = child(Path(tmp) / "ckpt", True, args.threads, args.reps)
    print(f"SmolLM-135M-shaped Llama, 8 x 128 tokens, {args.threads} threads, best of {args.reps}; "
          "a fresh logits tensor per call (fresh) vs one reused block (reused)")
    print(f"{'part':<10} {'fresh wall':>13} {'reused wall':>11} {'ratio':>6} {'fresh sys':>12} {'reused sys':>10}")
    for part in ("head", "forward", "lens", "sweep"):
        (w0, s0), (w1, s1) = fresh[part], reused[part]
        print(f"{part:<10} {w0 * 1e3:11.0f} ms {w1 * 1e3:7.0f} ms {w1 / w0:6.2f} {s0 * 1e3:9.0f} ms {s1 * 1e3:6.0f} ms")
    print(f"peak RSS: {fresh['peak_mib']:.0f} MiB fresh, {reused['peak_mib']:.0f} MiB reused")
    same = fresh["hash"] == reused["hash"]
    print(f"sweep per-sequence sums and lens tables bit for bit equal: {same} ({fresh['hash']} / {reused['hash']})")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
