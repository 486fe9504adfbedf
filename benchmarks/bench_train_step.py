"""Tokens/s of the trainer's Pre-LN step vs a minimal hand-written GPT step of the same shape.

Ours: `depthtools.train.loop.train_step` on a real `Run` (memmap batch, LR schedule, DepthModel
with hook points, AdamW param groups, grad clip, no depth probe). Baseline: a nanoGPT-style
Llama block written here (RMSNorm, RoPE, SDPA, SwiGLU, untied embeddings; no hooks), same AdamW
groups and clip, its batch already in memory. Timings alternate ours/baseline in rounds so load
from other processes hits both alike; the median per round is reported.

    python benchmarks/bench_train_step.py                 # CPU: (d=256,L=2), (d=64,L=32)
    python benchmarks/bench_train_step.py --device cuda   # bf16 autocast + fused AdamW
Target: ratio ours/baseline >= 0.9.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from depthtools.config import ModelConfig, TrainConfig
from depthtools.data import prepare
from depthtools.train.loop import prepare_run, train_step

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "tiny_corpus"


# -- the baseline: a minimal GPT of the same shape ----------------------------------------------
def rope(x, cos, sin):
    T = x.shape[1]
    cos, sin = cos[:T, None, :], sin[:T, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class MiniBlock(nn.Module):
    def __init__(self, d, heads, d_ff):
        super().__init__()
        self.heads = heads
        self.n1, self.n2 = nn.RMSNorm(d, eps=1e-5), nn.RMSNorm(d, eps=1e-5)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.w1, self.w3 = nn.Linear(d, d_ff, bias=False), nn.Linear(d, d_ff, bias=False)
        self.w2 = nn.Linear(d_ff, d, bias=False)

    def forward(self, x, cos, sin):
        B, T, d = x.shape
        h = self.n1(x)
        q, k, v = (proj(h).view(B, T, self.heads, -1) for proj in (self.q, self.k, self.v))
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        z = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.o(z.transpose(1, 2).reshape(B, T, d))
        h = self.n2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class MiniGPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(MiniBlock(cfg.d_model, cfg.n_heads, cfg.d_ff) for _ in range(cfg.n_layer))
        self.norm = nn.RMSNorm(cfg.d_model, eps=1e-5)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        hd = cfg.head_dim
        inv = 1.0 / 10000.0 ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        ang = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float64), inv)
        self.register_buffer("cos", ang.cos().float(), persistent=False)
        self.register_buffer("sin", ang.sin().float(), persistent=False)

    def forward(self, idx):
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        return self.head(self.norm(x))


def baseline_stepper(cfg: ModelConfig, tcfg: TrainConfig, device, dtype):
    model = MiniGPT(cfg).to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.95), eps=1e-8, fused=device.type in ("cuda", "cpu") or None)  # as build_optimizer
    data = torch.randint(0, cfg.vocab_size, (tcfg.batch_size, tcfg.seq_len + 1), device=device)
    params = list(model.parameters())

    def step():
        ctx = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else torch.autocast(device.type, enabled=False)
        with ctx:
            logits = model(data[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), data[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def ours_stepper(cfg: ModelConfig, tcfg: TrainConfig, data_dir: Path, out_dir: Path):
    run = prepare_run(cfg, tcfg, data_dir, out_dir, None)
    counter = iter(range(10**9))

    def step():
        return train_step(run, next(counter) % run.total_steps, None)[0]

    return step, run.device, run.dtype


def timed(step, n: int, device) -> float:
    """Seconds per step over n steps (synchronised on CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        loss = step()
    float(loss)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


def bench(d_model: int, n_layer: int, args, data_dir: Path, tmp: Path) -> float:
    cfg = ModelConfig(arch="preln", vocab_size=256, d_model=d_model, n_layer=n_layer, n_heads=max(2, d_model // 64),
                      max_seq_len=args.seq_len)
    tcfg = TrainConfig(tokens=10**9, batch_size=args.batch_size, seq_len=args.seq_len, device=args.device,
                       depth_stats_every=0, eval_every=0, checkpoint_every=0, threads=args.threads)
    ours, device, dtype = ours_stepper(cfg, tcfg, data_dir, tmp / f"d{d_model}_L{n_layer}")
    base = baseline_stepper(cfg, tcfg, device, dtype)
    for step in (ours, base):  # warm-up
        timed(step, args.warmup, device)
    rounds_ours, rounds_base = [], []
    for _ in range(args.rounds):
        rounds_ours.append(timed(ours, args.steps, device))
        rounds_base.append(timed(base, args.steps, device))
    tokens = args.batch_size * args.seq_len
    t_ours, t_base = statistics.median(rounds_ours), statistics.median(rounds_base)
    ratio = t_base / t_ours
    print(f"d={d_model:<4} L={n_layer:<3} heads={cfg.n_heads} B={args.batch_size} T={args.seq_len} [{device.type}, {str(dtype)[6:]}]  "
          f"ours {tokens / t_ours:>10,.0f} tok/s   baseline {tokens / t_base:>10,.0f} tok/s   ratio {ratio:.2f}x")
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--shapes", default="256x2,64x32", help="comma-separated d_model x n_layer")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data_dir = prepare("text-dir", out_dir=tmp / "data", text_dir=FIXTURE, val_fraction=0.3)
        print(f"torch {torch.__version__}, threads {args.threads or torch.get_num_threads()}")
        ratios = [bench(*map(int, shape.split("x")), args, data_dir, tmp) for shape in args.shapes.split(",")]
    print("min ratio {:.2f}x (target >= 0.9x)".format(min(ratios)))


if __name__ == "__main__":
    main()
