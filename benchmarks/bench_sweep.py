"""Benchmark: full single-skip sweep, cached-prefix engine vs naive full re-runs — target <= 0.6x.

Setting (defaults): Pre-LN, L = 32 blocks, d = 64, vocab 256, 16 sequences × 128 tokens in
batches of 8, float32, one torch thread. Both methods evaluate the same 32 plans (skip block l,
l = 0..31) with the same metrics through `depthtools.analysis.sweep`:

* cached: each plan starts from the intact state z_l (plus one intact pass per batch):
  1 + Σ_l (L − l − 1) ≈ L²/2 block applications per batch.
* naive: `reuse_prefix=False`, every plan re-runs all L blocks: L² block applications.

Ideal ratio (block work only) = (L + L(L−1)/2) / L² ≈ 0.52 at L = 32; heads and metrics are
identical work in both and move the ratio up slightly. Best of --reps runs each, same process.

Usage: ``python benchmarks/bench_sweep.py [--arch preln --layers 32 --width 64 --seqs 16 --seq-len 128]``
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from depthtools.analysis.sweep import sweep  # noqa: E402
from depthtools.arch import DepthModel, Plan  # noqa: E402
from depthtools.config import ModelConfig  # noqa: E402


def best_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="preln")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = ModelConfig(arch=args.arch, vocab_size=args.vocab, d_model=args.width, n_layer=args.layers,
                      n_heads=max(1, args.width // 16), max_seq_len=args.seq_len)
    model = DepthModel(cfg, seed=0).to(args.device).eval()
    tokens = torch.randint(0, args.vocab, (args.seqs, args.seq_len + 1), generator=torch.Generator().manual_seed(0))
    plans = [Plan.skipping(l) for l in range(args.layers)]
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)

    def run(reuse: bool):
        def go():
            sweep(model, tokens, plans, batch_size=args.batch, reuse_prefix=reuse)
            sync()
        return go

    run(True)()  # warm-up
    fast, slow = run(True), run(False)
    assert sweep(model, tokens, plans[:3], batch_size=args.batch) == sweep(
        model, tokens, plans[:3], batch_size=args.batch, reuse_prefix=False)
    t_cached = best_time(fast, args.reps)
    t_naive = best_time(slow, args.reps)
    L = args.layers
    ideal = (L + L * (L - 1) / 2) / (L * L)
    print(f"{args.arch} L={L} d={args.width} {args.seqs}x{args.seq_len} tokens, batch {args.batch}, "
          f"{args.threads} thread(s), {args.device}: {L} single-skip plans")
    print(f"cached prefix: {t_cached * 1e3:.1f} ms   naive: {t_naive * 1e3:.1f} ms   "
          f"ratio {t_cached / t_naive:.3f}x (target <= 0.6x; block-work ideal {ideal:.3f}x)")


if __name__ == "__main__":
    main()
