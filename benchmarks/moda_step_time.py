"""CPU training-step time (fwd+bwd+AdamW) of MoDA vs Pre-LN, measured in the same run.

    PYTHONPATH=. python benchmarks/moda_step_time.py [--layers 32 --d-model 64 --heads 4 \
        --batch 8 --seq 128 --steps 8 --threads N]

Steps of the two models alternate (preln, moda, preln, ...) so that drifting machine load hits
both alike; prints min and median ms/step of each and the ratio moda / preln (target <= 1.6).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from depthtools.arch import DepthModel
from depthtools.config import ModelConfig


def make_step(arch: str, args):
    cfg = ModelConfig(arch=arch, vocab_size=args.vocab, d_model=args.d_model, n_layer=args.layers,
                      n_heads=args.heads, max_seq_len=args.seq)
    model = DepthModel(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    toks = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))

    def step() -> float:
        t0 = time.perf_counter()
        logits = model(toks[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), toks[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, L={args.layers} d={args.d_model} "
          f"heads={args.heads} batch={args.batch} seq={args.seq}")
    steps = {"preln": make_step("preln", args), "moda": make_step("moda", args)}
    times = {name: [] for name in steps}
    for i in range(args.warmup + args.steps):
        for name, step in steps.items():
            elapsed = step()
            if i >= args.warmup:
                times[name].append(elapsed)
    for name, ts in times.items():
        print(f"{name:6s} min {min(ts) * 1e3:7.1f} ms/step   median {statistics.median(ts) * 1e3:7.1f} ms/step")
    print(f"ratio moda/preln: min {min(times['moda']) / min(times['preln']):.2f}x   "
          f"median {statistics.median(times['moda']) / statistics.median(times['preln']):.2f}x")


if __name__ == "__main__":
    main()
