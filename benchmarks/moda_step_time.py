"""CPU training-step time (fwd+bwd+AdamW) of MoDA vs Pre-LN, measured in the same run.

    PYTHONPATH=. python benchmarks/moda_step_time.py [--layers 32 --d-model 64 --heads 4 \
        --batch 8 --seq 128 --steps 8 --threads N]

Steps of the models alternate (preln, moda, preln, ...) so that drifting machine load hits all
alike; prints min and median ms/step of each and the ratio moda / preln (target <= 1.6). --bf16-kv adds a
third model, MoDA with option moda_kv_dtype="bfloat16" (its depth K/V cache stored in bfloat16).
--pieces: also time, per MoDA step, the pieces of its depth attention (the C kernels' forward, backward,
slot gradients and slot stores, PyTorch's flash attention forward and backward) with wall-clock timers
around those calls (medians over the timed steps); the rest of the step is what MoDA shares with Pre-LN
plus kv_proj and the bookkeeping.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from depthtools.arch import DepthModel
from depthtools.config import ModelConfig


def make_step(arch: str, args, **options):
    cfg = ModelConfig(arch=arch, vocab_size=args.vocab, d_model=args.d_model, n_layer=args.layers,
                      n_heads=args.heads, max_seq_len=args.seq, options=options)
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


def time_pieces() -> dict[str, float]:
    """Wrap MoDA's depth-attention calls with wall-clock timers; returns the running totals (seconds)."""
    from depthtools.arch import moda
    from depthtools.arch.ops import moda as moda_ops

    totals: dict[str, float] = {}
    for mod, names in ((moda_ops, ["moda_forward", "moda_backward", "moda_slot_grads", "moda_store_slot"]),
                       (moda, ["cpu_flash_attention", "cpu_flash_attention_backward"])):
        for name in names:
            def timed(*a, _f=getattr(mod, name), _n=name, **k):
                t = time.perf_counter()
                try:
                    return _f(*a, **k)
                finally:
                    totals[_n] = totals.get(_n, 0.0) + time.perf_counter() - t
            setattr(mod, name, timed)
    return totals


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
    p.add_argument("--bf16-kv", dest="bf16_kv", action="store_true", help="also MoDA with moda_kv_dtype='bfloat16'")
    p.add_argument("--pieces", action="store_true", help="time the pieces of MoDA's depth attention per step")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, L={args.layers} d={args.d_model} "
          f"heads={args.heads} batch={args.batch} seq={args.seq}")
    steps = {"preln": make_step("preln", args), "moda": make_step("moda", args)}
    if args.bf16_kv:
        steps["moda-bf16kv"] = make_step("moda", args, moda_kv_dtype="bfloat16")
    times = {name: [] for name in steps}
    totals = time_pieces() if args.pieces else {}
    pieces: dict[str, list[float]] = {}
    for i in range(args.warmup + args.steps):
        for name, step in steps.items():
            totals.clear()
            elapsed = step()
            if i >= args.warmup:
                times[name].append(elapsed)
                if name == "moda":
                    for piece, t in totals.items():
                        pieces.setdefault(piece, []).append(t)
    for name, ts in times.items():
        print(f"{name:11s} min {min(ts) * 1e3:7.1f} ms/step   median {statistics.median(ts) * 1e3:7.1f} ms/step")
    for name in [n for n in times if n != "preln"]:
        print(f"ratio {name}/preln: min {min(times[name]) / min(times['preln']):.2f}x   "
              f"median {statistics.median(times[name]) / statistics.median(times['preln']):.2f}x")
    if pieces:
        print("moda, per step (median ms):", ", ".join(f"{k} {statistics.median(v) * 1e3:.1f}" for k, v in pieces.items()),
              f"| sum {sum(statistics.median(v) for v in pieces.values()) * 1e3:.1f} of {statistics.median(times['moda']) * 1e3:.1f}")


if __name__ == "__main__":
    main()
