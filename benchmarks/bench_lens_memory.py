"""Benchmark: peak memory of the logit lens over all depths, chunked vs naive (materialise all).

Setting (defaults): Pre-LN, L = 16 blocks (17 depths), d = 64, vocab 2048, 32 sequences × 128
tokens, float32, one thread.

* chunked: `depthtools.analysis.logit_lens` — one batch of 8 sequences at a time, depths one after
  another, rows in chunks of 4096 tokens, each depth decoded over vocabulary chunks (`headmetrics`): the
  final output's [rows, V] log-probs (the reference) and one [256, 8192] logit block are alive.
* full-vocab: the same with `chunked_head=False`: each depth's full [rows, V] log-probs (the code before
  the vocabulary-chunked head, `depthtools.analysis.headmetrics`).
* naive: all states of all tokens, then the lens logits of every depth stacked into one
  [depths, tokens, V] tensor, then the same metrics (CE, both KLs, entropy, top-1/top-5, rank)
  vectorised over it.

Measurement: each method runs in its own child process. On CPU the peak resident set is read
from /proc/self/status (VmHWM) after resetting it (`echo 5 > /proc/self/clear_refs`) once the
model and tokens are built, so the figure is the method's own peak above that baseline. On CUDA
(`--device cuda`) it is torch.cuda.max_memory_allocated above the allocation before the run.
The parent checks that both methods give the same per-depth metrics.

Usage: ``python benchmarks/bench_lens_memory.py [--layers 16 --vocab 2048 --seqs 32 --seq-len 128 --device cpu]``
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from depthtools.analysis.lens import LENS_METRICS, logit_lens  # noqa: E402
from depthtools.arch import DepthModel  # noqa: E402
from depthtools.config import ModelConfig  # noqa: E402


def rss_kib(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


@torch.no_grad()
def naive_lens(model, tokens: torch.Tensor) -> list[list[float]]:
    """Materialise lens logits [depths, tokens, V] for every depth at once, then reduce."""
    inputs, targets = tokens[:, :-1], tokens[:, 2:].flatten()
    states = model.run_states(inputs)
    logits = torch.stack([model.head(s)[:, 1:].flatten(0, 1) for s in states])  # [D, n, V]
    lp = F.log_softmax(logits.float(), dim=-1)
    final = lp[-1:]
    p, p_final = lp.exp(), final.exp()
    target_lp = lp.gather(-1, targets.view(1, -1, 1).expand(lp.shape[0], -1, 1))
    top5, top5_final = lp.topk(5, dim=-1).indices, final.topk(5, dim=-1).indices
    values = [
        -target_lp.squeeze(-1),
        (p_final * (final - lp)).sum(-1),
        (p * (lp - final)).sum(-1),
        -(p * lp).sum(-1),
        (top5[..., 0] == top5_final[..., 0]).float(),
        (top5.unsqueeze(-1) == top5_final.unsqueeze(-2)).any(-1).sum(-1).float() / 5,
        (lp > target_lp).sum(-1).float() + 1,
    ]
    return torch.stack([v.double().mean(-1) for v in values], dim=1).tolist()  # [D, metrics]


def child(args) -> None:
    torch.set_num_threads(args.threads)
    cfg = ModelConfig(arch=args.arch, vocab_size=args.vocab, d_model=args.width, n_layer=args.layers,
                      n_heads=max(1, args.width // 16), max_seq_len=args.seq_len)
    model = DepthModel(cfg, seed=0).to(args.device).eval()
    tokens = torch.randint(0, args.vocab, (args.seqs, args.seq_len + 1), generator=torch.Generator().manual_seed(0))
    tokens = tokens.to(args.device)
    logit_lens(model, tokens[:1], batch_size=1)  # warm-up (imports, kernels) before the baseline
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        base = rss_kib("VmRSS") * 1024
    start = time.perf_counter()
    if args.child in ("chunked", "full-vocab"):
        df = logit_lens(model, tokens, batch_size=args.batch, chunked_head=args.child == "chunked")
        metrics = df[list(LENS_METRICS)].to_numpy().tolist()
    else:
        metrics = naive_lens(model, tokens)
    elapsed = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() if cuda else rss_kib("VmHWM") * 1024
    print(json.dumps({"peak_bytes": peak - base, "seconds": elapsed, "metrics": metrics}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="preln")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--child", choices=["chunked", "full-vocab", "naive"])
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    results = {}
    for method in ("chunked", "full-vocab", "naive"):
        proc = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--child", method],
                              capture_output=True, text=True, check=True)
        results[method] = json.loads(proc.stdout.strip().splitlines()[-1])
    a, b = (torch.tensor(results[m]["metrics"], dtype=torch.float64) for m in ("chunked", "naive"))
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    c = torch.tensor(results["full-vocab"]["metrics"], dtype=torch.float64)
    worst = (a - c).abs().max(0).values.tolist()
    print("max |chunked − full-vocab| per metric: "
          + ", ".join(f"{name} {value:.1e}" for name, value in zip(LENS_METRICS, worst)))
    depths, n = args.layers + 1, args.seqs * (args.seq_len - 1)
    print(f"{args.arch} L={args.layers} ({depths} depths) d={args.width} V={args.vocab}, {n} scored tokens, "
          f"{args.device}; one [depths, tokens, V] float32 tensor = {depths * n * args.vocab * 4 / 2**20:.0f} MiB")
    for method, r in results.items():
        print(f"{method:8s} peak +{r['peak_bytes'] / 2**20:8.1f} MiB   {r['seconds']:.2f} s")
    ratio = results["chunked"]["peak_bytes"] / max(results["naive"]["peak_bytes"], 1)
    print(f"peak memory ratio chunked / naive: {ratio:.3f}x (metrics agree)")
    ratio = results["chunked"]["peak_bytes"] / max(results["full-vocab"]["peak_bytes"], 1)
    print(f"peak memory ratio vocabulary-chunked head / full-vocabulary log-probs per depth (before): {ratio:.3f}x")


if __name__ == "__main__":
    main()
