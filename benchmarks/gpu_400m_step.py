"""Training throughput of the depthbench-400m shapes on one GPU: tokens/s and MFU for preln and hc.

The trainer's step maths (`forward_loss`, AdamW groups from `build_optimizer` with fused kernels,
gradient clipping) under bf16 autocast and `torch.compile`, on synthetic tokens (no data loading
in the timing), for the Pre-LN cell (the baseline) and the HC cell of the same depth, planned by
the preset's iso-parameter rules (V=50280, 16 heads, d_ff multiple 16, ~405M parameters).
MFU = flops_per_token (depthtools.train.flops) x tokens/s / the device's bf16 peak.

    python benchmarks/gpu_400m_step.py                        # L=24, 20 timed steps, micro-batch 8 x 2048
    python benchmarks/gpu_400m_step.py --layers 32 --micro-batch 4 --compile off   # (--no-compile = off)
    python benchmarks/gpu_400m_step.py --compile whole        # torch.compile(model) instead of the regions
--compile: "regional" (default; what the trainer's --compile on does, depthtools.arch.compiled), "whole"
(the whole model, the trainer's behaviour before issue 20) or "off" (eager).
    python benchmarks/gpu_400m_step.py --plan-only            # shapes and FLOPs/token, no GPU needed
Prints one row per architecture and the ratio hc/preln measured in the same run. Needs CUDA.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

import torch

from depthtools.arch import DepthModel
from depthtools.config import TrainConfig
from depthtools.grid import Cell, plan_grid
from depthtools.presets import get_preset
from depthtools.train.flops import flops_per_token, peak_flops
from depthtools.train.loop import forward_loss
from depthtools.train.optim import build_optimizer

ARCHS = ("preln", "hc")


def plan_cells(layers: int, seq_len: int) -> list[Cell]:
    """The preset's preln and hc cells at this depth (exact parameter counts, planned on `meta`)."""
    plan = dict(get_preset("depthbench-400m").plan)
    plan.update(arch=list(ARCHS), layers=[layers], max_seq_len=max(seq_len, plan.get("max_seq_len", seq_len)))
    return plan_grid(**plan)


def time_cell(cell: Cell, steps: int, warmup: int, micro: int, seq_len: int, compile: str) -> dict:
    """Warm up, then time `steps` optimizer steps of one micro-batch each; returns tokens/s and MFU."""
    device = torch.device("cuda")
    gc.collect()  # the previous cell's model and optimizer are gone once its call returned
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    cfg = cell.model_config()
    recipe = TrainConfig(tokens=1, batch_size=micro, seq_len=seq_len, lr=2e-3)
    model = DepthModel(cfg, seed=0).to(device)
    optimizer, _ = build_optimizer(model, recipe, device)  # fused AdamW on CUDA
    step_model = torch.compile(model) if compile == "whole" else model
    if compile == "regional":
        from depthtools.arch import compiled

        compiled.enable(model, device)
    data = torch.randint(0, cfg.vocab_size, (micro, seq_len + 1), device=device)
    inputs, targets = data[:, :-1], data[:, 1:]
    params = list(model.parameters())

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = forward_loss(step_model, inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):  # includes compilation
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    tokens_per_s = steps * micro * seq_len / elapsed
    fpt = flops_per_token(cfg, cell.params_total, seq_len)
    peak = peak_flops(torch.cuda.get_device_name(device))
    result = {"cell": cell.name, "d_model": cell.d_model, "params": cell.params_total, "tokens_per_s": tokens_per_s,
              "step_ms": 1000 * elapsed / steps, "flops_per_token": fpt, "mfu": fpt * tokens_per_s / peak if peak else None,
              "max_mem_gb": torch.cuda.max_memory_allocated(device) / 2**30}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24, help="depth of both cells (preset: 16..32)")
    parser.add_argument("--steps", type=int, default=20, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation happens here)")
    parser.add_argument("--micro-batch", type=int, default=8, help="rows per step (the preset's micro-batch is 16)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--compile", choices=("regional", "whole", "off"), default="regional",
                        help="regional (the trainer's --compile on), whole (torch.compile(model)) or off")
    parser.add_argument("--no-compile", dest="compile", action="store_const", const="off", help="= --compile off")
    parser.add_argument("--plan-only", action="store_true", help="print the shapes and FLOPs/token, then stop")
    args = parser.parse_args(argv)
    if not args.plan_only and not torch.cuda.is_available():
        print("gpu_400m_step.py needs a CUDA GPU (torch sees none); --plan-only prints the shapes without one",
              file=sys.stderr)
        return 2
    cells = plan_cells(args.layers, args.seq_len)
    if args.plan_only:
        for cell in cells:
            fpt = flops_per_token(cell.model_config(), cell.params_total, args.seq_len)
            print(f"{cell.name:10s} d_model={cell.d_model} d_ff={cell.d_ff} params={cell.params_total:,} "
                  f"flops/token={fpt:.3e}")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = True
    print(f"{torch.cuda.get_device_name()}: micro-batch {args.micro_batch} x {args.seq_len}, bf16 autocast, "
          f"compile={args.compile}, {args.steps} timed steps")
    results = [time_cell(c, args.steps, args.warmup, args.micro_batch, args.seq_len, args.compile) for c in cells]
    for r in results:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a (unknown peak)"
        print(f"{r['cell']:10s} d={r['d_model']} {r['params'] / 1e6:.1f}M  {r['tokens_per_s']:,.0f} tok/s  "
              f"{r['step_ms']:.1f} ms/step  MFU {mfu}  peak mem {r['max_mem_gb']:.1f} GiB")
    base, hc = results
    print(f"ratio hc/preln tokens/s: {hc['tokens_per_s'] / base['tokens_per_s']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
