"""Benchmark (issue 47): the logit lens' plan against its measured time, in one process.

A SmolLM-135M-shaped Pre-LN model (d 576, 9/3 heads, MLP 1536, V 49,152; random weights, --layers blocks)
times, per round: one block and the head with the sweep's metrics (`cost.time_parts`, what h is), one lens
depth and the final one (`cost.lens_seconds`), and `lens_analysis` itself with the intact states already shared (so
only the lens' per-depth work is measured); then prints the lens time the two per-depth units predict,
(L+1) x head and the final depth + L x lens depth, beside the measured one.

    python benchmarks/bench_lens_plan.py [--layers 12 --threads 2 --rounds 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from depthtools.analysis.cost import lens_seconds, time_parts  # noqa: E402
from depthtools.analysis.lens import lens_analysis  # noqa: E402
from depthtools.analysis.sweep import intact_states, shared_sweeps  # noqa: E402
from depthtools.analysis.tokens import split_inputs  # noqa: E402
from depthtools.arch import DepthModel  # noqa: E402
from depthtools.config import ModelConfig  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    L = args.layers
    cfg = ModelConfig(arch="preln", vocab_size=49152, d_model=576, n_layer=L, n_heads=9, n_kv_heads=3, d_ff=1536,
                      max_seq_len=128, tie_embeddings=True)
    model = DepthModel(cfg, seed=0).eval()
    tokens = torch.randint(0, cfg.vocab_size, (8, 129), generator=torch.Generator().manual_seed(0))
    for r in range(args.rounds):
        t_block, t_head = time_parts(model, tokens, 8)
        t_final, per_depth = lens_seconds(model, tokens, 8)
        with shared_sweeps():
            with torch.no_grad():
                intact_states(model, split_inputs(tokens)[0])  # the lens then reads them, as in the suite
            t0 = time.perf_counter()
            lens_analysis(model, tokens, batch_size=8)
            lens = time.perf_counter() - t0
        print(f"round {r} (load average {os.getloadavg()[0]:.1f}): block {t_block * 1000:.0f} ms, head + sweep "
              f"metrics {t_head * 1000:.0f} ms, lens depth {per_depth * 1000:.0f} ms; lens measured {lens:.1f} s, "
              f"predicted (L+1) x head {(L + 1) * t_head:.1f} s ({lens / ((L + 1) * t_head):.2f}x), "
              f"final + L x lens depth {t_final + L * per_depth:.1f} s ({lens / (t_final + L * per_depth):.2f}x)",
              flush=True)


if __name__ == "__main__":
    main()
