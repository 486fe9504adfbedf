"""What MoDA's bfloat16 depth K/V cache (option moda_kv_dtype="bfloat16") does to training, measured.

    python benchmarks/moda_kv_dtype_loss.py [--layers 8 --d-model 64 --tokens 400000 --seeds 0 1 2]

Trains the same MoDA cell with the cache in the model's dtype (float32) and in bfloat16, for each seed
(same initialisation and data order per seed: the pairs differ only in the cache's rounding), on the
embedded default corpus (byte tokenizer), with the trainer's recipe. Prints each run's final validation
loss, the paired differences (bfloat16 - float32) and, for scale, the seed-to-seed spread of the
float32 runs: a mean paired difference inside that spread is a tie.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", dest="d_model", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=400_000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    from depthtools.config import ModelConfig, TrainConfig
    from depthtools.data import prepare
    from depthtools.train import train_cell

    root = Path(tempfile.mkdtemp(prefix="depthtools-kvdtype-"))
    data = prepare("default", out_dir=root / "data", tokenizer="byte", log=lambda message: None)
    losses: dict[str, list[float]] = {"model": [], "bfloat16": []}
    for seed in args.seeds:
        for kv in losses:
            model = ModelConfig(arch="moda", vocab_size=256, d_model=args.d_model, n_layer=args.layers, n_heads=4,
                                max_seq_len=128, options={"moda_kv_dtype": kv})
            recipe = TrainConfig(tokens=args.tokens, batch_size=16, seq_len=128, seed=seed, eval_every=0,
                                 depth_stats_every=0, checkpoint_every=0, threads=args.threads, compile="off")
            summary = train_cell(model, recipe, data, root / f"{kv}_s{seed}")
            losses[kv].append(summary["val_loss"])
            print(f"seed {seed} moda_kv_dtype={kv:8s} val_loss {summary['val_loss']:.4f}", flush=True)
    diffs = [b - f for b, f in zip(losses["bfloat16"], losses["model"])]
    spread = statistics.stdev(losses["model"]) if len(args.seeds) > 1 else float("nan")
    print(f"float32 cache:  mean {statistics.mean(losses['model']):.4f}  seed std {spread:.4f}")
    print(f"bfloat16 cache: mean {statistics.mean(losses['bfloat16']):.4f}")
    print(f"paired difference bfloat16 - float32: mean {statistics.mean(diffs):+.4f}  "
          f"per seed {', '.join(f'{d:+.4f}' for d in diffs)}")


if __name__ == "__main__":
    main()
