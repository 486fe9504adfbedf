"""Train one task cell (task stream only, answer-only loss, k curriculum) and report what it learned.

The design study of issue 17: does a model at the demo's scale learn the serial tasks, and how fast?
The cell trains through the real trainer (`train_cell`) on the task stream alone (fraction 1), so its
metrics.jsonl records the curriculum's level and held-out accuracy every `--every` steps; afterwards
`task_eval` scores every k in 1..k_max on 200 fresh samples (accuracy, first logit-lens depth).

Example (one row of the study in benchmarks/RESULTS.md):
  python benchmarks/task_training.py --arch preln --d-model 64 --layers 2 --heads 2 --steps 300 --tasks s5 --k-max 3
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from depthtools.analysis.tasks import task_eval, wide
from depthtools.checkpoint import load
from depthtools.config import ModelConfig, TrainConfig
from depthtools.data import prepare
from depthtools.train import train_cell


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="preln")
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--d-ff", type=int, default=None, help="SwiGLU width (default: the model's 8/3 d rule).")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--tasks", default="chase")
    parser.add_argument("--k-max", type=int, default=4)
    parser.add_argument("--k-eval", type=int, default=None, help="Evaluate k = 1..K-EVAL (default: k-max).")
    parser.add_argument("--no-curriculum", action="store_true", help="Draw k uniformly from 1..k-max from the start.")
    parser.add_argument("--warmup", type=float, default=0.1, help="Warmup share of the steps.")
    parser.add_argument("--full-loss", action="store_true", help="Score every token of a task row, not only answers.")
    parser.add_argument("--threshold", type=float, default=0.9)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", type=Path, default=Path("data/default"), help="A prepared byte-level corpus "
                        "(the trainer needs one; a task-only run reads none of it). Prepared if missing.")
    parser.add_argument("--out", type=Path, default=Path("/tmp/task_training"))
    args = parser.parse_args()

    if not (args.data / "meta.json").exists():
        prepare("default", out_dir=args.data.parent, name=args.data.name)
    tasks = args.tasks.split(",")
    mix = {"fraction": 1.0, "tasks": tasks, "k_min": 1, "k_max": args.k_max, "answer_only": not args.full_loss,
           "curriculum": None if args.no_curriculum else {"threshold": args.threshold, "every": args.every, "n": 64}}
    recipe = TrainConfig(tokens=args.steps * args.batch_size * args.seq_len, batch_size=args.batch_size,
                         seq_len=args.seq_len, lr=args.lr, eval_tokens=2048, eval_every=0, log_every=args.every,
                         depth_stats_every=0, checkpoint_every=500, threads=1, task_mix=mix, seed=args.seed,
                         warmup_fraction=args.warmup)
    model = ModelConfig(arch=args.arch, vocab_size=256, d_model=args.d_model, n_layer=args.layers, n_heads=args.heads,
                        d_ff=args.d_ff, max_seq_len=args.seq_len)
    name = f"{args.arch}_d{args.d_model}_L{args.layers}_h{args.heads}_{'-'.join(tasks)}_s{args.seed}"
    out = args.out / name
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    summary = train_cell(model, recipe, args.data, out)
    trained = time.perf_counter() - t0
    print(f"{name}: {summary['params']:,} params, {args.steps} steps, trained in {trained:.0f} s")
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        levels = {k[len("task_level_"):]: v for k, v in record.items() if k.startswith("task_level_")}
        if levels:
            acc = {t: record[f"task_acc_{t}"] for t in levels}
            print(f"  step {record['step']:>5}  loss {record['train_loss']:.3f}  level {levels}  held-out acc {acc}")
    table = wide(task_eval(load(out), tasks=tasks, ks=f"1-{args.k_eval or args.k_max}", n=200))
    print(table[["task", "k", "accuracy", "lens_first_depth"]].to_string(index=False))
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
