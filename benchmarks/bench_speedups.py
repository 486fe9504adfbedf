"""Same-run A/B checks of the CPU speed-ups behind issue 3 (each prints a ratio measured in one run).

    optimizer   one AdamW step with random gradients per architecture: PyTorch's CPU default
                (per-tensor loop) vs foreach vs fused (what `build_optimizer` uses)
    bank-kernels  Full AttnRes training step with its depth bank's ops (arch/ops/bank.py: mix, two-phase
                prefix, backward flush) on their C kernels and on their torch twins
    two-phase   Full AttnRes training step with and without the two-phase mix groups
    grad-pool   Full AttnRes training step with and without the reused bank gradient buffers
    moda-pool   MoDA training step with and without the reused depth K/V and gradient buffers
    moda-stream-stores  MoDA training step with its new depth slots written by streaming stores (where the
                rows are whole 64-byte lines) and by plain stores (arch/ops/moda.py's STREAM_STORES)
    tanh        the HC connector's tanh on its [4096, 6] coefficient block vs 2·sigmoid(2x) - 1
    sinkhorn    mHC's Sinkhorn (n = 4, t_max = 20) forward + backward at 1024 tokens: the torch-op
                tokens-last kernel vs the C kernel (arch/ops/sinkhorn.py's op)
    connector   HC's and mHC's connector ops (depthtools::hc_connect, mhc_connect; arch/ops/connector.py)
                forward + backward at 1024 tokens, n = 4, d = 64: their torch twins vs their fused C kernels

The A/B modes time Pre-LN, the model as shipped ("on") and the same model with the feature
switched off ("off") in one process, in shuffled rounds, and print the median per-round ratios
to Pre-LN on process CPU time (the trainer's fused AdamW, L=32, d=64, batch 8 x 128, 1 thread).

    python benchmarks/bench_speedups.py optimizer
    python benchmarks/bench_speedups.py sinkhorn connector
    python benchmarks/bench_speedups.py bank-kernels two-phase grad-pool moda-pool moda-stream-stores --rounds 15
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402

from depthtools.arch import DepthModel, cpu_kernels  # noqa: E402
from depthtools.arch.bankops import MixGroups  # noqa: E402
from depthtools.arch.ops import moda as moda_ops  # noqa: E402
from depthtools.config import ModelConfig  # noqa: E402

from bench_arch_step import build_step  # noqa: E402


def _bank_kernels_off(model):
    """A wrapper of this model's training step: its depth-bank ops take their torch twins instead of the C kernels
    (the ops choose by `cpu_kernels.bank_usable`, switched off for the step: forward and backward)."""

    def wrap(step):
        def without_kernels():
            usable = cpu_kernels.bank_usable
            cpu_kernels.bank_usable = lambda values: False
            try:
                step()
            finally:
                cpu_kernels.bank_usable = usable
        return without_kernels

    return wrap


def _stream_stores_off(model) -> None:
    """This model's forward (where MoDA writes its slots) runs with plain slot stores."""
    forward = model.forward

    def plain_stores(*args, **kwargs):
        moda_ops.STREAM_STORES = False
        try:
            return forward(*args, **kwargs)
        finally:
            moda_ops.STREAM_STORES = True

    model.forward = plain_stores


SWITCH_OFF = {  # mode -> (architecture, how to switch the feature off on a built model)
    "bank-kernels": ("attnres", _bank_kernels_off),
    "two-phase": ("attnres", lambda m: m.scheme.__dict__.__setitem__("_groups", MixGroups([]))),
    "grad-pool": ("attnres", lambda m: setattr(m.scheme, "_grad_pool", None)),
    "moda-pool": ("moda", lambda m: setattr(m.scheme, "_slot_pool", None)),
    "moda-stream-stores": ("moda", _stream_stores_off),
}


def mean_ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return 1000 * (time.perf_counter() - start) / reps


def optimizer_ab(args) -> None:
    print(f"{'arch':10s} {'tensors':>7s} {'loop ms':>8s} {'foreach':>8s} {'fused':>7s} {'loop/fused':>10s}")
    for arch in ("preln", "hc", "mhc", "attnres", "moda"):
        cfg = ModelConfig(arch=arch, vocab_size=256, d_model=64, n_layer=32, n_heads=4, max_seq_len=128)
        model = DepthModel(cfg, seed=0)
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        times = [mean_ms(torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, **kw).step, 10)
                 for kw in ({}, {"foreach": True}, {"fused": True})]
        n = len(list(model.parameters()))
        print(f"{arch:10s} {n:7d} {times[0]:8.1f} {times[1]:8.1f} {times[2]:7.1f} {times[0] / times[2]:10.2f}")


def feature_ab(mode: str, args) -> None:
    arch, switch_off = SWITCH_OFF[mode]
    shape = argparse.Namespace(vocab=256, d_model=64, n_layer=32, n_heads=4, seq=128, batch=8)
    steps = {"preln": build_step("preln", shape)[1], "on": build_step(arch, shape)[1]}
    off_model, steps["off"] = build_step(arch, shape)
    wrap = switch_off(off_model)  # (a switch that acts on the whole step returns a wrapper of it)
    if callable(wrap):
        steps["off"] = wrap(steps["off"])
    for step in steps.values():
        step(), step()
    ratios, rng = {"on": [], "off": []}, random.Random(0)
    for _ in range(args.rounds):
        order = list(steps)
        rng.shuffle(order)
        cpu = {}
        for name in order:
            start = time.process_time()
            steps[name]()
            cpu[name] = time.process_time() - start
        for name in ratios:
            ratios[name].append(cpu[name] / cpu["preln"])
    on, off = (statistics.median(ratios[k]) for k in ("on", "off"))
    print(f"{mode:10s} {arch}: x preln on {on:.3f}, off {off:.3f} (on/off {on / off:.3f}, {args.rounds} rounds)")


def tanh_ab(args) -> None:
    a = torch.randn(4096, 6)
    tanh = mean_ms(lambda: torch.tanh(a), 500)
    via_sigmoid = mean_ms(lambda: torch.sigmoid(a * 2).mul_(2).sub_(1), 500)
    diff = (torch.sigmoid(a * 2) * 2 - 1 - torch.tanh(a)).abs().max().item()
    print(f"tanh       {1000 * tanh:.1f} us, 2σ(2x)-1 {1000 * via_sigmoid:.1f} us (ratio {via_sigmoid / tanh:.2f}); "
          f"max |difference| {diff:.1e}")


def sinkhorn_ab(args) -> None:
    from depthtools.arch import cpu_kernels
    from depthtools.arch.ops import sinkhorn as sinkhorn_ops
    from depthtools.arch.sinkhorn_torch import sinkhorn_backward, sinkhorn_forward

    z, g = torch.randn(4, 4, 1024), torch.randn(4, 4, 1024)
    if not cpu_kernels.usable(z, g):
        print("sinkhorn   the C kernel is unavailable here (no C compiler, or its build failed): nothing to compare")
        return

    def torch_ops():
        _, saved = sinkhorn_forward(z, 20, 1)
        return sinkhorn_backward(saved, g)

    def c_kernel():
        sinkhorn_ops.kernel_forward(z, 20, 1)
        return sinkhorn_ops.kernel_backward(z, g, 20, 1)

    diff = (torch_ops() - c_kernel()).abs().max().item()
    ops_ms, c_ms = mean_ms(torch_ops, 200), mean_ms(c_kernel, 200)
    print(f"sinkhorn   fwd+bwd at 1024 tokens: torch ops {ops_ms:.2f} ms, C kernel {c_ms:.2f} ms "
          f"(ratio {c_ms / ops_ms:.2f}); max |gradient difference| {diff:.1e}")


def connector_ab(args) -> None:
    from depthtools.arch import cpu_kernels
    from depthtools.arch.ops import connector as connector_ops

    if cpu_kernels.library("connector") is None:
        print("connector  the C kernels are unavailable here (no C compiler, or the build failed): nothing to compare")
        return
    gen = torch.Generator().manual_seed(0)
    N, n, d = 1024, 4, 64
    H = torch.randn(N, n, d, generator=gen)
    grads = (torch.randn(N, d, generator=gen), torch.randn(N, n, d, generator=gen), torch.randn(N, n, generator=gen))
    leaves = {
        "hc": [H, 0.1 * torch.randn(d, n + 1, generator=gen), 0.1 * torch.randn(d, generator=gen),
               torch.randn(n, n + 1, generator=gen), torch.randn(n, generator=gen), torch.tensor(0.3), torch.tensor(0.2)],
        "mhc": [H, *(0.05 * torch.randn(n * d, k, generator=gen) for k in (n, n, n * n)), torch.tensor(0.5),
                torch.tensor(0.5), torch.tensor(0.5), torch.randn(n, generator=gen), torch.randn(n, generator=gen),
                torch.randn(n, n, generator=gen)],
    }
    calls = {"hc": lambda xs: connector_ops.hc_connect(*xs, 1e-8),
             "mhc": lambda xs: connector_ops.mhc_connect(*xs, 1e-6, 20, 0)}
    kernel_usable = cpu_kernels.connector_usable

    def run(arch: str, kernel: bool):
        cpu_kernels.connector_usable = kernel_usable if kernel else (lambda *tensors: False)
        try:
            xs = [t.clone().requires_grad_(True) for t in leaves[arch]]
            return torch.autograd.grad(calls[arch](xs), xs, grads)
        finally:
            cpu_kernels.connector_usable = kernel_usable

    for arch in ("hc", "mhc"):
        diff = max((a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)
                   for a, b in zip(run(arch, True), run(arch, False)))
        times = {True: [], False: []}
        for _ in range(args.rounds):
            for kernel in random.Random(len(times[True])).sample([True, False], 2):
                times[kernel].append(mean_ms(lambda: run(arch, kernel), 10))
        ops_ms, c_ms = statistics.median(times[False]), statistics.median(times[True])
        print(f"connector  {arch:4s} fwd+bwd at {N} tokens: torch ops {ops_ms:.2f} ms, C kernel {c_ms:.2f} ms "
              f"(ratio {c_ms / ops_ms:.2f}); largest relative gradient difference {diff:.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("modes", nargs="+", choices=["optimizer", "tanh", "sinkhorn", "connector", *SWITCH_OFF])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for mode in args.modes:
        if mode == "optimizer":
            optimizer_ab(args)
        elif mode == "tanh":
            tanh_ab(args)
        elif mode == "sinkhorn":
            sinkhorn_ab(args)
        elif mode == "connector":
            connector_ab(args)
        else:
            feature_ab(mode, args)


if __name__ == "__main__":
    main()
