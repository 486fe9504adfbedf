"""Benchmark: all-pairs (L+1)×(L+1) minibatch debiased CKA, one-pass accumulator vs per-pair.

Setting (defaults): L = 32 blocks → 33 depth states, 16 384 tokens streamed in batches of
256, width d = 64, float32 activations (as cached from a model), statistics in float64.

* one-pass: :class:`CKAAccumulator` — per batch, 33 U-centred Grams, one [33, n²] matmul.
* per-pair: what one gets by running a pairwise minibatch CKA for every pair i ≤ j (561
  pairs, symmetry already exploited): per batch and pair, form and U-centre both Grams and
  accumulate HSIC(i,j), HSIC(i,i), HSIC(j,j). Same batches, same float64 maths.
* per-pair (cached Grams): an extra, stronger baseline — Grams U-centred once per batch,
  then one dot product per pair; isolates the gain of the single matmul.

Each method runs in its own child process so its peak RSS (ru_maxrss) is its own; states
are generated per batch from a seed, so no method stores the activations.

Usage: ``python benchmarks/bench_cka.py [--layers 32 --tokens 16384 --batch 256 --width 64 --threads 1]``
Timings default to one torch thread: on an oversubscribed CPU, multi-threaded small matmuls
can be 10-100x slower from OpenMP contention, which would swamp the comparison.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from depthtools.analysis.similarity import CKAAccumulator, gram_linear, u_centre  # noqa: E402

F64 = torch.float64


def make_batch(b: int, m: int, n: int, d: int) -> list[torch.Tensor]:
    """Residual-stream-like toy states for batch b: z_ℓ = z_{ℓ−1} + noise ([n, d] float32 each)."""
    g = torch.Generator().manual_seed(1000 + b)
    steps = torch.randn(m, n, d, generator=g)
    steps[0] *= 3.0  # embedding
    return list(torch.cumsum(steps, dim=0))  # m x [n, d]


def run_one_pass(m: int, batches: int, n: int, d: int) -> tuple[float, torch.Tensor]:
    """Time CKAAccumulator.update over all batches; return (seconds, CKA matrix)."""
    acc = CKAAccumulator(m, debiased=True)
    elapsed = 0.0
    for b in range(batches):
        states = make_batch(b, m, n, d)
        t0 = time.perf_counter()
        acc.update(states)
        elapsed += time.perf_counter() - t0
    return elapsed, acc.result()


def _pair_sums(m: int) -> dict[str, torch.Tensor]:
    return {k: torch.zeros(m, m, dtype=F64) for k in ("xy", "xx", "yy")}


def _ratio(s: dict[str, torch.Tensor]) -> torch.Tensor:
    C = s["xy"] / torch.sqrt(s["xx"] * s["yy"])
    return torch.triu(C) + torch.triu(C, 1).T  # fill the lower triangle by symmetry


def run_per_pair(m: int, batches: int, n: int, d: int) -> tuple[float, torch.Tensor]:
    """Pairwise minibatch CKA for every i ≤ j: Grams formed and U-centred per pair."""
    s = _pair_sums(m)
    scale = n * (n - 3)
    elapsed = 0.0
    for b in range(batches):
        states = make_batch(b, m, n, d)
        t0 = time.perf_counter()
        for i in range(m):
            for j in range(i, m):
                Ku = u_centre(gram_linear(states[i]))  # [n, n]
                Lu = u_centre(gram_linear(states[j]))  # [n, n]
                s["xy"][i, j] += (Ku * Lu).sum() / scale
                s["xx"][i, j] += (Ku * Ku).sum() / scale
                s["yy"][i, j] += (Lu * Lu).sum() / scale
        elapsed += time.perf_counter() - t0
    return elapsed, _ratio(s)


def run_per_pair_cached(m: int, batches: int, n: int, d: int) -> tuple[float, torch.Tensor]:
    """Grams U-centred once per batch, then one elementwise dot product per pair i ≤ j."""
    s = _pair_sums(m)
    scale = n * (n - 3)
    elapsed = 0.0
    for b in range(batches):
        states = make_batch(b, m, n, d)
        t0 = time.perf_counter()
        G = [u_centre(gram_linear(X)) for X in states]  # m x [n, n]
        for i in range(m):
            for j in range(i, m):
                s["xy"][i, j] += (G[i] * G[j]).sum() / scale
                s["xx"][i, j] += (G[i] * G[i]).sum() / scale
                s["yy"][i, j] += (G[j] * G[j]).sum() / scale
        elapsed += time.perf_counter() - t0
    return elapsed, _ratio(s)


METHODS = {"one_pass": run_one_pass, "per_pair": run_per_pair, "per_pair_cached": run_per_pair_cached}


def child(method: str, m: int, batches: int, n: int, d: int, out: str) -> None:
    """Run one method, write its time, peak RSS and CKA matrix to `out` (torch.save)."""
    torch.manual_seed(0)
    secs, C = METHODS[method](m, batches, n, d)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    torch.save({"secs": secs, "peak_mib": peak_mib, "C": C}, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads per method (1 = stable timings on a shared machine)")
    ap.add_argument("--skip-per-pair", action="store_true", help="skip the slow naive baseline")
    ap.add_argument("--_child", nargs=2, metavar=("METHOD", "OUT"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    m, n, d = a.layers + 1, a.batch, a.width
    batches = a.tokens // n
    if a._child:
        torch.set_num_threads(a.threads)
        child(a._child[0], m, batches, n, d, a._child[1])
        return

    print(f"L={a.layers} ({m} states, {m * (m + 1) // 2} pairs i<=j), tokens={batches * n} "
          f"in {batches} batches of {n}, d={d}, torch {torch.__version__}, threads={a.threads}")
    gram_mib = m * n * n * 8 / 2**20
    print(f"one-pass working set: {m} U-centred Grams [{n}x{n}] float64 = {gram_mib:.1f} MiB "
          f"(+ the [{m},{n},{n}] Gram stack before U-centring, same size); independent of token count")
    methods = ["one_pass", "per_pair_cached"] + ([] if a.skip_per_pair else ["per_pair"])
    res = {}
    for meth in methods:
        out = f"/tmp/bench_cka_{meth}.pt"
        cmd = [sys.executable, __file__, "--layers", str(a.layers), "--tokens", str(a.tokens),
               "--batch", str(n), "--width", str(d), "--threads", str(a.threads), "--_child", meth, out]
        subprocess.run(cmd, check=True)
        res[meth] = torch.load(out)
        print(f"  {meth:16s} {res[meth]['secs']:8.2f} s   peak RSS {res[meth]['peak_mib']:7.0f} MiB")
    base = res["one_pass"]
    for meth in methods[1:]:
        diff = float((res[meth]["C"] - base["C"]).abs().max())
        print(f"speed-up one_pass vs {meth}: {res[meth]['secs'] / base['secs']:.1f}x  "
              f"(max |ΔCKA| = {diff:.1e})")
    print(json.dumps({k: round(v["secs"], 3) for k, v in res.items()}))


if __name__ == "__main__":
    main()
