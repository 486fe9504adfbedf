"""Benchmark: this CPU's matrix-multiply rates at the products of the SmolLM-135M-shaped suite (bench_real_size.py),
in float32 and in the half types its matrix units take (bfloat16 on AMX), and what a split-float32 product would
gain: issue 47's question whether the suite's GEMM floor can move without changing its numbers.

A float32 operand splits exactly into three bfloat16 parts (8 bits of significand each); a product that keeps
float32 accuracy needs the six cross products of the parts above the last bits (bf16x6), each accumulated in
float32 by the hardware; bf16x3 keeps ~16 bits only, far outside the suite's 1e-6. So a split pays only if one
bfloat16 product runs at more than 6x the float32 one (the split of each activation costs extra on top).

    python benchmarks/bench_gemm_rates.py [--rows 1024 --threads 2 --reps 20]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

# (name, K, N) of the suite's products, as F.linear(x [rows, K], W [N, K]) at SmolLM-135M's shape
PRODUCTS = [("q / o projection", 576, 576), ("k / v projection", 576, 192), ("w1 / w3", 576, 1536),
            ("w2", 1536, 576), ("head", 576, 49152)]


def rate(rows: int, k: int, n: int, dtype: torch.dtype, reps: int) -> float:
    """GFLOP/s of F.linear at this shape and dtype (best of `reps` after a warm-up)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    for _ in range(3):
        F.linear(x, w)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        F.linear(x, w)
        best = min(best, time.perf_counter() - t0)
    return 2 * rows * k * n / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1024, help="rows per product (one batch: 8 x 128 tokens)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{'product':<18} {'K':>5} {'N':>6}  {'float32':>8} {'bfloat16':>9} {'float16':>8}  GFLOP/s   "
          f"bf16x6 / float32 time")
    for name, k, n in PRODUCTS:
        f32, bf16, f16 = (rate(args.rows, k, n, dtype, args.reps)
                          for dtype in (torch.float32, torch.bfloat16, torch.float16))
        print(f"{name:<18} {k:>5} {n:>6}  {f32:8.0f} {bf16:9.0f} {f16:8.0f}            {6 * f32 / bf16:6.2f}x")


if __name__ == "__main__":
    main()
