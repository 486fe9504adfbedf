"""Same-run A/B of two builds of the CPU kernel libraries (depthtools/arch/csrc): the libraries this checkout builds
("new") against shared objects from another build ("old": a folder of <name>.so, e.g. built from an earlier
commit), on the same inputs, in shuffled rounds; prints per workload the median times and the median per-round
ratio new/old of process CPU time (1 thread).

    python benchmarks/bench_kernel_libs.py --old /tmp/old_kernels --rounds 11

Issue 36 used it to check that moving the kernels into csrc/ and building them through torch.utils.cpp_extension
changed no kernel's speed (benchmarks/RESULTS.md, "Kernels as sources").
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

from depthtools.arch import cpu_kernels as ck  # noqa: E402
from depthtools.arch.ops import bank as bank_ops, connector as connector_ops, moda as moda_ops, sinkhorn as sinkhorn_ops  # noqa: E402


def load(name: str, old: Path | None):
    """Library `name` as this checkout builds it (old=None), or from old/<name>.so, with the same ctypes signatures."""
    if old is None:
        return ck._build(name)
    real = ck._compile
    ck._compile = lambda n, cc, flags, folder=None: old / f"{n}.so"
    try:
        return ck._build(name)
    finally:
        ck._compile = real


def workloads() -> dict:
    """{label: (library, callable)}: one forward + backward (or a mix sweep) of each library's kernels."""
    gen = torch.Generator().manual_seed(0)
    z, g = torch.randn(4, 4, 1024, generator=gen), torch.randn(4, 4, 1024, generator=gen)
    N, n, d = 1024, 4, 64
    H, Pt = torch.randn(N, n, d, generator=gen), 0.1 * torch.randn(n + 2, d, generator=gen)
    S, scale = torch.randn(n, n + 2, generator=gen), torch.rand(n + 2, generator=gen)
    g_out, g_depth = torch.randn(N, n + 1, d, generator=gen), torch.randn(N, n, generator=gen)
    values, inv_rms = torch.randn(33, 2048, 64, generator=gen), torch.rand(33, 2048, generator=gen)
    dots = torch.randn(33, 4, 2048, generator=gen)
    K, V = torch.randn(16, 2, 16, 1024, generator=gen), torch.randn(16, 2, 16, 1024, generator=gen)
    q, o, dz = (torch.randn(8, 128, 4, 16, generator=gen) for _ in range(3))
    lse_seq = torch.randn(8, 128, 4, generator=gen)

    def sinkhorn():
        sinkhorn_ops.kernel_forward(z, 20, 1)
        sinkhorn_ops.kernel_backward(z, g, 20, 1)

    def hc():
        _, _, raw, inv, t = connector_ops.hc_kernel_forward(H, Pt, S, scale, 1e-8)
        connector_ops.hc_kernel_backward(H, Pt, S, scale, raw, inv, t, g_out, g_depth)

    def bank():
        for sources in range(1, 33, 4):
            bank_ops.bank_mix_forward(values, inv_rms, dots, sources, 1, None, None, 0, None, None)

    def moda():
        out, _, probs, _ = moda_ops.moda_forward(K, V, q, o, lse_seq, None, 0.25)
        moda_ops.moda_backward(K, V, out, dz, probs, None, 0.25)

    return {"sinkhorn fwd+bwd": ("sinkhorn", sinkhorn), "hc connector fwd+bwd": ("connector", hc),
            "bank mixes": ("bank", bank), "moda fwd+bwd": ("moda", moda)}


def cpu_ms(fn, reps: int) -> float:
    start = time.process_time()
    for _ in range(reps):
        fn()
    return 1000 * (time.process_time() - start) / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", type=Path, required=True, help="folder of <name>.so from the other build")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for label, (name, fn) in workloads().items():
        libs = {"old": load(name, args.old), "new": load(name, None)}
        times, ratios = {"old": [], "new": []}, []
        for r in range(args.rounds):
            for which in random.Random(r).sample(["old", "new"], 2):
                ck._libs[name] = libs[which]
                times[which].append(cpu_ms(fn, args.reps))
            ratios.append(times["new"][-1] / times["old"][-1])
        print(f"{label:22s} old {statistics.median(times['old']):.3f} ms, new {statistics.median(times['new']):.3f} ms,"
              f" median new/old {statistics.median(ratios):.3f} (rounds {min(ratios):.3f}-{max(ratios):.3f})",
              flush=True)


if __name__ == "__main__":
    main()
