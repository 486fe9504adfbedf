"""The logit lens' floor (issue 45): one head GEMM per depth, timed at several row counts (same run).

The lens decodes every depth's rows with the model's head, rows [M, d] @ W^T [d, V]; its cost cannot fall below
(L + 1) such GEMMs plus the forward. This prints the GEMM time per 1,016 rows (a SmolLM-135M-shaped batch of
8 x 127 scored tokens) at M = 254 ... 4,064 rows, best of 3, so the row count the lens uses can be checked against
the alternatives (smaller tiles keep a depth's logits in cache but read W more often).

    python benchmarks/bench_head_gemm.py [--d 576] [--vocab 49152] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d", type=int, default=576)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    W = torch.randn(args.vocab, args.d) * 0.05
    print(f"head GEMM rows x {args.d} @ {args.d} x {args.vocab}, float32, {args.threads} thread(s)")
    for M in (254, 508, 1016, 2032, 4064):
        x = torch.randn(M, args.d)
        F.linear(x, W)
        best = min(_timed(lambda: F.linear(x, W)) for _ in range(3))
        print(f"  M {M:>5}: {best * 1000:7.1f} ms = {best / M * 1016 * 1000:6.1f} ms per 1,016 rows "
              f"({2 * M * args.d * args.vocab / best / 1e9:.0f} GFLOP/s)")


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
