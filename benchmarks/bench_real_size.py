"""Benchmark: the probes at a real model's size — a random-weight SmolLM-135M-like Llama, imported exactly.

Built locally (nothing downloads): transformers' own `LlamaConfig` with SmolLM-135M's shape (30 layers,
d 576, 9 heads / 3 kv heads, MLP 1536, vocab 49152, tied embeddings), `LlamaForCausalLM` with random
weights, `save_pretrained` into a temporary folder, then depthtools' `import_hf` and `checkpoint.load`
— the path a user's real folder takes. On one fixed token set (random ids, --seqs × --seq-len) it
times, in the same process:

    forward      one plain forward pass of the batch(es) (best of --reps): the unit of every ratio
    lens         the logit lens at all 31 depths (`lens_analysis`, chunked over tokens)
    skip cached  the single-skip sweep with prefix reuse (`sweep`, 30 plans) — what `ablate --mode skip` runs
    skip naive   the same 30 plans, each re-running all 30 blocks (`reuse_prefix=False`)

and prints seconds, the ratio of each to the plain forward, the cached/naive ratio (target <= 0.6x),
the cost plan's predicted forward-pass equivalents (`depthtools.analysis.cost`) beside the measured
ones, and the peak RSS of the process after each stage.

Usage: python benchmarks/bench_real_size.py [--seqs 8 --seq-len 64 --batch 8 --threads 2 --reps 2]
"""

from __future__ import annotations

import argparse
import math
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from depthtools.analysis.cost import analysis_cost, head_ratio, time_parts  # noqa: E402
from depthtools.analysis.lens import lens_analysis  # noqa: E402
from depthtools.analysis.suite import analysis_args  # noqa: E402
from depthtools.analysis.sweep import sweep  # noqa: E402
from depthtools.arch import Plan  # noqa: E402

SMOLLM_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                   num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                   rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True, hidden_act="silu")


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def best(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def build_checkpoint(folder: Path, seq_len: int):
    """The random-weight Llama folder (transformers' save_pretrained), imported and loaded by depthtools."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from depthtools.checkpoint import load
    from depthtools.interop.llama import import_hf

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**SMOLLM_135M)).eval()
    n_params = sum(p.numel() for p in hf.parameters())
    hf.save_pretrained(folder / "hf", safe_serialization=True)
    del hf
    import_hf(folder / "hf", out=folder / "ckpt", max_seq_len=max(seq_len, 128))
    return load(folder / "ckpt"), n_params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    stages = []

    def done(name: str, seconds: float) -> None:
        stages.append((name, seconds, peak_rss_mib()))
        print(f"  [{name}: {seconds:.2f} s, peak RSS {stages[-1][2]:.0f} MiB]", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        model, n_params = build_checkpoint(Path(tmp), args.seq_len)
        done("build + save_pretrained + import + load", time.perf_counter() - t0)
    L, V = model.n_layer, model.config.vocab_size
    tokens = torch.randint(0, V, (args.seqs, args.seq_len + 1), generator=torch.Generator().manual_seed(0))
    inputs = tokens[:, :-1]
    plans = [Plan.skipping(l) for l in range(L)]

    @torch.no_grad()
    def forward():
        for lo in range(0, args.seqs, args.batch):
            model.run(inputs[lo:lo + args.batch])

    forward()  # warm-up (allocator, kernels)
    t_fwd = best(forward, args.reps)
    done("plain forward", t_fwd)
    t_lens = best(lambda: lens_analysis(model, tokens, batch_size=args.batch), 1)
    done("logit lens (31 depths)", t_lens)
    t_cached = best(lambda: sweep(model, tokens, plans, batch_size=args.batch, reuse_prefix=True), 1)
    done("skip sweep, prefix-cached (30 plans)", t_cached)
    t_naive = best(lambda: sweep(model, tokens, plans, batch_size=args.batch, reuse_prefix=False), 1)
    done("skip sweep, naive re-runs (30 plans)", t_naive)

    n_seqs, T = args.seqs, args.seq_len
    t_block, t_head = time_parts(model, tokens, args.batch)
    h = t_head / t_block

    def predicted(h_: float) -> dict[str, float]:  # sequence_profile: the cost of one skip rule's sweep
        return {name: analysis_cost(name, model, analysis_args(name, batch_size=args.batch), n_seqs, T,
                                    args.batch, h_).forwards / math.ceil(n_seqs / args.batch)
                for name in ("lens_logit", "sequence_profile")}
    print(f"SmolLM-135M-like Llama (random weights, {n_params / 1e6:.1f}M parameters, L={L}, d=576, V={V}), "
          f"{n_seqs}x{T} tokens, batch {args.batch}, {args.threads} thread(s), float32, CPU")
    for name, seconds, rss in stages:
        ratio = f"{seconds / t_fwd:7.2f}x forward" if name != stages[0][0] else " " * 16
        print(f"  {name:<42} {seconds:8.2f} s  {ratio}   peak RSS {rss:7.0f} MiB")
    print(f"skip sweep cached / naive = {t_cached / t_naive:.3f}x (target <= 0.6x)")
    for label, h_ in (("timed head+metrics", h), ("parameter ratio", head_ratio(model))):
        p = predicted(h_)
        print(f"cost plan ({label}, h = {h_:.1f} blocks): lens {p['lens_logit']:.1f} forward equivalents "
              f"(measured {t_lens / t_fwd:.1f}), skip sweep {p['sequence_profile']:.1f} (measured {t_cached / t_fwd:.1f})")


if __name__ == "__main__":
    main()
