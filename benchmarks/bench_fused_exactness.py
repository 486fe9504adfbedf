"""Which head path is nearer the exact numbers: the full float32 log-softmax or the fused row metrics (issues 45, 47).

The fused row metrics (`headmetrics.fused_metrics`, the C kernel csrc/rowmetrics.c) sum in float32 within 256
columns and in float64 across; the full path sums [rows, V] float32 products in float32. Their per-token
metrics differ by float32 rounding (~1e-7 on these models), but the suite's derived counts -- n_lens (lens
progress), n_skip = exp(H(π)) over normalised skip importances -- divide by small differences on tiny random
models and move by up to ~5e-5. This script says which side moved: per column it prints the largest
|full − exact| and |fused − exact|, where "exact" is the same model and tokens in float64 (the full path: the
fused kernel takes float32 only), on the logit lens (per-depth and summary tables) and the skip ablation.

Models: those of benchmarks/suite_same_run.py (tiny Pre-LN and HC DepthModels with perturbed weights and an
imported random Llama; nothing downloads), or the SmolLM-135M-shaped random Llama with --real-size.

    python benchmarks/bench_fused_exactness.py [--layers 6] [--n-tokens 256] [--seq-len 32] [--real-size]
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from depthtools.analysis import headmetrics  # noqa: E402
from depthtools.analysis.ablate import ablate_skip  # noqa: E402
from depthtools.analysis.lens import lens_analysis  # noqa: E402
from depthtools.checkpoint import load  # noqa: E402


def tables(model, tokens: torch.Tensor, batch: int, fused: bool) -> dict[str, pd.DataFrame]:
    """The lens depth and summary tables and the skip table of `model` with the fused path on or off."""
    headmetrics.FUSED = fused
    try:
        lens = lens_analysis(model, tokens, batch_size=batch, chunked_head=False)
        return {"lens depths": lens.depths, "lens summary": lens.summary,
                "skip": ablate_skip(model, tokens, batch_size=batch)}
    finally:
        headmetrics.FUSED = True


def worst(a: pd.DataFrame, b: pd.DataFrame) -> dict[str, float]:
    """Per numeric column both share: the largest |a − b| (NaN = NaN equal)."""
    out = {}
    for column in a.columns:
        if column in b.columns and pd.api.types.is_float_dtype(a[column]):
            x, y = a[column].to_numpy(np.float64), b[column].to_numpy(np.float64)
            out[column] = float(np.where(np.isnan(x) & np.isnan(y), 0.0, np.abs(x - y)).max(initial=0.0))
    return out


def report(name: str, model, tokens: torch.Tensor, batch: int) -> tuple[int, int]:
    """Print the comparison for one model; (columns where fused is nearer, columns where full is nearer) among
    those the two paths disagree on by more than 1e-9."""
    full, fused = tables(model, tokens, batch, False), tables(model, tokens, batch, True)
    exact = tables(model.double(), tokens, batch, False)
    model.float()
    nearer = [0, 0]
    print(f"{name}: {tokens.shape[0]}x{tokens.shape[1] - 1} tokens")
    for table in exact:
        e_full, e_fused, d = worst(full[table], exact[table]), worst(fused[table], exact[table]), worst(fused[table], full[table])
        for column in e_full:
            if d[column] <= 1e-9:
                continue
            nearer[0 if e_fused[column] < e_full[column] else 1] += 1
            print(f"  {table:<13} {column:<18} |full − f64| {e_full[column]:.1e}  |fused − f64| {e_fused[column]:.1e}"
                  f"  |fused − full| {d[column]:.1e}")
    return nearer[0], nearer[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--n-tokens", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--real-size", action="store_true", help="the SmolLM-135M-shaped Llama (L30, V49152)")
    args = parser.parse_args()
    n_seqs = math.ceil(args.n_tokens / args.seq_len)
    totals = [0, 0]
    with tempfile.TemporaryDirectory() as tmp:
        if args.real_size:
            from bench_real_size import build_checkpoint
            model, _ = build_checkpoint(Path(tmp), args.seq_len, 30, 49152)
            models = [("smollm_shape", model)]
        else:
            from suite_same_run import build_checkpoints
            models = [(p.name, load(p)) for p in build_checkpoints(Path(tmp), args.layers, max(args.seq_len, 32))]
        for name, model in models:
            tokens = torch.randint(0, model.config.vocab_size, (n_seqs, args.seq_len + 1),
                                   generator=torch.Generator().manual_seed(0))
            a, b = report(name, model, tokens, args.batch)
            totals[0], totals[1] = totals[0] + a, totals[1] + b
    print(f"columns where the paths differ: fused nearer float64 in {totals[0]}, full float32 nearer in {totals[1]}")


if __name__ == "__main__":
    main()
