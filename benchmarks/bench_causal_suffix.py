"""Benchmark (issue 47): causal's future effect with shared rows against whole runs of every cut, same process.

A SmolLM-135M-shaped Pre-LN model (d 576, 9 heads / 3 kv heads, MLP 1536: the Llama block the imported
families run; random weights; a small vocabulary, since causal never reads the head) runs `causal_scores`
at its defaults (4 cuts: 8, 48, 80, 120 at T = 128) twice per round, alternating: with the suffix step
(`causal.suffix_support` None: the largest cut whole, each smaller cut its rows >= cut) and with it turned
off (every cut a whole run, the code before). It prints each round's seconds, the best of each, their ratio
beside the cost plan's block-call ratio, the load average before and after, and max |shared - whole| over
every saved value (the hard rule: <= 1e-6); and each time against the plan's block calls times one timed block.

    python benchmarks/bench_causal_suffix.py [--layers 12 --seqs 8 --seq-len 128 --threads 2 --rounds 2 --cpu-time]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from depthtools.analysis import causal, cost  # noqa: E402
from depthtools.analysis.cost import analysis_cost  # noqa: E402
from depthtools.analysis.suite import analysis_args  # noqa: E402
from depthtools.arch import DepthModel  # noqa: E402
from depthtools.config import ModelConfig  # noqa: E402


def timed(model, tokens, shared: bool, clock=time.perf_counter):
    """(seconds, table) of causal_scores at its defaults, with the shared rows on or off."""
    real = causal.suffix_support
    if not shared:
        causal.suffix_support = lambda m: "turned off for the comparison"
    try:
        t0 = clock()
        df = causal.causal_scores(model, tokens, batch_size=8)
        return clock() - t0, df
    finally:
        causal.suffix_support = real


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cpu-time", action="store_true", help="CPU seconds of this process instead of wall time "
                        "(steadier on a machine others load; use with --threads 1: waiting threads spin)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = ModelConfig(arch="preln", vocab_size=512, d_model=576, n_layer=args.layers, n_heads=9, n_kv_heads=3,
                      d_ff=1536, max_seq_len=max(args.seq_len, 128), tie_embeddings=True)
    model = DepthModel(cfg, seed=0).eval()
    tokens = torch.randint(0, cfg.vocab_size, (args.seqs, args.seq_len + 1), generator=torch.Generator().manual_seed(0))
    clock = time.process_time if args.cpu_time else time.perf_counter
    with torch.no_grad():  # one block call in the same clock (best of 3 whole forwards / L): the plan's unit
        model.run_states(tokens[:8, :-1])
        t_block = math.inf
        for _ in range(3):
            t0 = clock()
            model.run_states(tokens[:8, :-1])
            t_block = min(t_block, (clock() - t0) / args.layers)
    load_before = os.getloadavg()[0]
    times = {True: [], False: []}
    tables = {}
    for r in range(args.rounds):
        for shared in ((True, False) if r % 2 == 0 else (False, True)):
            seconds, tables[shared] = timed(model, tokens, shared, clock)
            times[shared].append(seconds)
            print(f"  round {r}: {'shared rows' if shared else 'whole runs '} {seconds:7.1f} s", flush=True)
    load_after = os.getloadavg()[0]
    diff = (tables[True].value - tables[False].value).abs().max()
    args_ = analysis_args("causal")
    plan_new = analysis_cost("causal", model, args_, args.seqs, args.seq_len, 8).blocks
    real = cost.suffix_support
    cost.suffix_support = lambda m: "off"
    try:
        plan_old = analysis_cost("causal", model, args_, args.seqs, args.seq_len, 8).blocks
    finally:
        cost.suffix_support = real
    best_new, best_old = min(times[True]), min(times[False])
    print(f"causal, L={args.layers} d=576 (9/3 heads, MLP 1536), {args.seqs}x{args.seq_len} tokens, "
          f"{args.threads} thread(s); load average {load_before:.1f} before, {load_after:.1f} after")
    print(f"best of {args.rounds}: shared rows {best_new:.1f} s, whole runs {best_old:.1f} s: "
          f"{best_new / best_old:.3f}x (plan: {plan_new:.0f} / {plan_old:.0f} block calls = {plan_new / plan_old:.3f}x)")
    print(f"measured / (planned block calls x one block, {t_block * 1000:.0f} ms): shared rows "
          f"{best_new / (plan_new * t_block):.2f}, whole runs {best_old / (plan_old * t_block):.2f}"
          f" ({'CPU seconds of this process' if args.cpu_time else 'wall'})")
    print(f"max |shared - whole| over every value: {diff:.3g} (bound 1e-6: {'OK' if diff <= 1e-6 else 'EXCEEDED'})")


if __name__ == "__main__":
    main()
