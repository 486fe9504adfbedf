"""Benchmark: contrib's Jacobian probes batched (`contrib.jvps`: vmap over the tangents, the primal once) against
one forward-mode JVP per probe (the path before), on the SmolLM-135M-shaped random Llama of bench_real_size.py.

Both run `contributions` on the same tokens in one process, interleaved (--rounds), and the script prints each
run's seconds and whether the saved values are the same bit for bit.

    python benchmarks/bench_contrib_probes.py [--seqs 16 --seq-len 128 --batch 8 --rounds 2]
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_real_size import build_checkpoint  # noqa: E402

import depthtools.analysis.contrib as contrib  # noqa: E402


def one_probe_at_a_time(model, f, x, vs):
    """The path before `jvps`: `contrib.jvp` per probe (the primal each time)."""
    results = [contrib.jvp(model, f, x, v) for v in vs]
    return torch.stack([jv for jv, _ in results]), results[-1][1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batched = contrib.jvps
    with tempfile.TemporaryDirectory() as tmp:
        model, _ = build_checkpoint(Path(tmp), args.seq_len)
        tokens = torch.randint(0, model.config.vocab_size, (args.seqs, args.seq_len + 1),
                               generator=torch.Generator().manual_seed(0))
        contrib.contributions(model, tokens[:2], batch_size=2)  # warm-up: forward AD's first use
        hashes = set()
        for _ in range(args.rounds):
            for name, path in (("one JVP per probe", one_probe_at_a_time), ("probes batched", batched)):
                contrib.jvps = path
                t0 = time.perf_counter()
                df = contrib.contributions(model, tokens, batch_size=args.batch)
                seconds = time.perf_counter() - t0
                hashes.add(hashlib.sha256(df["value"].to_numpy().tobytes()).hexdigest())
                print(f"{name:<18} {seconds:6.1f} s", flush=True)
        contrib.jvps = batched
    print("values bit for bit equal:", len(hashes) == 1)


if __name__ == "__main__":
    main()
