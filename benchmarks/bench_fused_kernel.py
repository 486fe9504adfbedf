"""The fused row metrics against the full float32 path on one block of logits, same run (issues 45 and 47).

On a [rows, V] block of random float32 logits (default 1,016 x 49,152: a SmolLM-135M-shaped batch of 8 x 127
scored tokens) this times, best of `--reps`:
  * the C kernel alone (`headmetrics._kernel_sums`) without a reference, with one, and with one for both KLs;
  * one sweep plan's metrics (`sweep.plan_head_sums` on [B, T, V] logits) fused and with the fused path off
    (`headmetrics.FUSED = False`: the full log-softmax with the sweep's sums);
  * one lens depth's metrics (`headmetrics.fused_metrics` with top-5, rank and both KLs) against the same
    computed through torch's log-softmax (`headmetrics._torch_rows`),
and prints the full / fused ratios.

    python benchmarks/bench_fused_kernel.py [--rows 1016] [--vocab 49152] [--threads 2] [--reps 5]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from depthtools.analysis import headmetrics  # noqa: E402
from depthtools.analysis.sweep import Reference, _Sums, plan_head_sums, scored_logprobs  # noqa: E402


def best(fn, reps: int) -> float:
    """Best wall seconds of `reps` calls (after one warm-up call)."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1016)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    B = 8
    T = args.rows // B + 1
    n, V = B * (T - 1), args.vocab
    logits = torch.randn(B, T, V, generator=gen) * 3
    targets = torch.randint(0, V, (n,), generator=gen)
    intact = Reference.of(scored_logprobs(torch.randn(B, T, V, generator=gen) * 3))
    lens_ref = headmetrics.Reference.of(intact.logp, k=5, p=intact.p, sums=False)
    z = logits[:, 1:].reshape(n, V).contiguous()
    print(f"{n} rows x V {V}, float32, {args.threads} thread(s), best of {args.reps}")
    for label, ref, k in (("kernel, no reference", None, 2), ("kernel, reference", lens_ref, 2),
                          ("kernel, reference, top-6", lens_ref, 6)):
        print(f"  {label:<28} {1e3 * best(lambda: headmetrics._kernel_sums(z, targets, ref, k), args.reps):8.1f} ms")
    fused_ref = plan_head_sums(_Sums(), logits, intact, targets, B)
    t_fused = best(lambda: plan_head_sums(_Sums(), logits, intact, targets, B, fused_ref), args.reps)
    headmetrics.FUSED = False
    try:
        t_full = best(lambda: plan_head_sums(_Sums(), logits, intact, targets, B), args.reps)
    finally:
        headmetrics.FUSED = True
    print(f"  sweep plan metrics: full {1e3 * t_full:.1f} ms, fused {1e3 * t_fused:.1f} ms, "
          f"full / fused {t_full / t_fused:.1f}x")
    t_lens = best(lambda: headmetrics.fused_metrics(z, targets, lens_ref, k=5, rank=True, reverse=True), args.reps)
    t_torch = best(lambda: headmetrics._torch_rows(z, targets, lens_ref, 5), args.reps)
    print(f"  lens depth metrics: full {1e3 * t_torch:.1f} ms, fused {1e3 * t_lens:.1f} ms, "
          f"full / fused {t_torch / t_lens:.1f}x")


if __name__ == "__main__":
    main()
