"""Which pointer-chasing format does a small model learn? (issue 17, third pass)

A bare training loop, so that nothing but the format differs between rows of the study: one sample per
row (padded with NUL after it, or before it with --pad left), cross-entropy on the answer tokens only,
AdamW (wd 0.1, betas 0.9/0.95) at a constant learning rate, a Pre-LN `DepthModel`, 1 thread. Formats:

  chase   the package's pointer chasing by name:  "S=Z;h=0;Z=3;V=Z;L=q;q=8;L?" -> 8
          (--extra N distractor bindings; the package uses 2; 0 leaves the query chain and its decoy)
  pairs   associative recall, every pair queried and scored: "a5b3c7d1" then "b3a5d1c7" (an induction
          head's task); --separators writes the same as "a=5;b=3;c=7;d=1;b?3;a?5;d?1;c?7;"
  hop     the package's pointer chasing by position: "3947102658;4^2=" -> t^k(s) = t(t(4)) = 9

Every --every steps it prints the held-out accuracy of the first answer at k = 1..--k-max (128 fresh
samples per k; for pairs, the first query's value).

Example (a row of benchmarks/RESULTS.md, "Pointer chasing that is learned"):
  python benchmarks/task_formats.py --format hop --k-max 1 --steps 2000
"""

from __future__ import annotations

import argparse
import random
import string
import time

import numpy as np
import torch
import torch.nn.functional as F

import depthtools.data.tasks as tasks
from depthtools.arch import DepthModel
from depthtools.config import ModelConfig


def package_sample(task: str, k: int, rng: random.Random) -> tuple[str, list[int]]:
    """One sample of the package's generator for `task` (chase or hop): its text and answer offset."""
    text, answer = tasks.GENERATORS[task](k, tasks.Draw(rng.getrandbits(60)))
    return text + answer, [len(text)]


def pairs_sample(n: int, rng: random.Random, separators: bool) -> tuple[str, list[int]]:
    names = rng.sample(string.ascii_letters, n)
    values = [str(rng.randrange(10)) for _ in names]
    bind, ask, end = ("=", "?", ";") if separators else ("", "", "")
    text = "".join(f"{a}{bind}{v}{end}" for a, v in zip(names, values))
    answers = []
    for i in rng.sample(range(n), n):
        text += f"{names[i]}{ask}"
        answers.append(len(text))
        text += f"{values[i]}{end}"
    return text, answers


def batch(make, size: int, width: int, ks: list[int], rng: random.Random, first_only: bool, pad_left: bool):
    """Padded ids [size, width] and targets (-100 except the scored answers)."""
    x = np.zeros((size, width), np.int64)
    y = np.full((size, width), -100, np.int64)
    for row in range(size):
        text, answers = make(rng.choice(ks), rng)
        ids = np.frombuffer(text.encode("ascii"), np.uint8)
        pad = width - len(ids) if pad_left else 0
        x[row, pad:pad + len(ids)] = ids
        for a in answers[:1] if first_only else answers:
            y[row, pad + a - 1] = ids[a]  # logits at a-1 predict token a
    return torch.from_numpy(x), torch.from_numpy(y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--format", choices=["chase", "pairs", "hop"], required=True)
    parser.add_argument("--k-max", type=int, default=1, help="chase/hop: k drawn from 1..K-MAX; pairs: ignored.")
    parser.add_argument("--pairs", type=int, default=4, help="pairs: bindings per sample.")
    parser.add_argument("--separators", action="store_true", help="pairs: write '=', '?' and ';'.")
    parser.add_argument("--extra", type=int, default=tasks.CHASE_EXTRA, help="chase: distractor bindings.")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--every", type=int, default=250)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pad", choices=["right", "left"], default="right",
                        help="NUL padding after the sample (as in the trainer's rows, which start at a sample) or "
                             "before it; it matters: pairs is learned within 6,000 steps padded right, not left.")
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    tasks.CHASE_EXTRA = args.extra  # read by the chase generator at call time
    if args.format == "pairs":
        make = lambda k, rng: pairs_sample(args.pairs, rng, args.separators)  # noqa: E731
        ks = [1]
    else:
        make = lambda k, rng: package_sample(args.format, k, rng)  # noqa: E731
        ks = list(range(1, args.k_max + 1))
    width = max(len(make(k, random.Random(i))[0]) for k in ks for i in range(200)) + 2
    model = DepthModel(ModelConfig(arch="preln", vocab_size=256, d_model=args.d_model, n_layer=args.layers,
                                   n_heads=args.heads, max_seq_len=width))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    train_rng, t0 = random.Random(args.seed), time.perf_counter()
    print(f"{args.format}: {sum(p.numel() for p in model.parameters()):,} params, width {width}")
    for step in range(1, args.steps + 1):
        x, y = batch(make, args.batch_size, width, ks, train_rng, first_only=False, pad_left=args.pad == "left")
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % args.every == 0 or step == args.steps:
            model.eval()
            with torch.no_grad():
                accuracy = []
                for k in ks:
                    x, y = batch(make, 128, width, [k], random.Random(10**9 + k), first_only=True,
                                 pad_left=args.pad == "left")
                    scored = y != -100
                    accuracy.append(round((model(x).argmax(-1)[scored] == y[scored]).float().mean().item(), 3))
            model.train()
            print(f"step {step:>6}  loss {loss.item():.3f}  accuracy k=1..{len(ks)} {accuracy}  "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
