"""What a preset's training really costs on this machine: measured step time per cell × its steps.

For every distinct (arch, shape) of a preset (seeds share a shape), build the model and the trainer's
own AdamW (`build_optimizer`), time `--steps` training steps (forward + cross-entropy + backward +
optimizer step) at the preset's batch × seq_len on `--threads` threads after one warm-up step, and
multiply the median by the cell's planned steps (`TrainConfig.total_steps`). Cells train `--workers`
at a time (the local launcher), so the wall estimate is the sum over cells ÷ workers. Evaluation,
checkpoints and the probe suite come on top.

Usage: python benchmarks/preset_cost.py --preset cpu-small [--workers 2] [--threads 1] [--steps 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def step_seconds(cell, train_cfg, steps: int) -> float:
    """Median wall seconds of one training step of `cell` (after one warm-up step)."""
    import torch

    from depthtools.arch import DepthModel
    from depthtools.train.optim import build_optimizer

    model = DepthModel(cell.model_config(), seed=0).train()
    optimizer, _ = build_optimizer(model, train_cfg, torch.device("cpu"))
    tokens = torch.randint(0, cell.model["vocab_size"], (train_cfg.batch_size, train_cfg.seq_len + 1))
    times = []
    for i in range(steps + 1):
        start = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    import torch

    from depthtools.config import TrainConfig
    from depthtools.presets import get_preset
    from depthtools.train.sweep import load_spec

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="cpu-small")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    preset = get_preset(args.preset)
    spec = load_spec(preset.grid_spec())
    recipe = {k: v for k, v in (spec["train"] or {}).items() if k != "task_mix"}
    train_cfg = TrainConfig.from_dict(recipe)
    measured: dict[tuple, float] = {}
    total = 0.0
    print(f"# preset {args.preset}: {len(spec['cells'])} cells, batch {train_cfg.batch_size} x seq {train_cfg.seq_len}, "
          f"{args.threads} thread(s) per cell, {args.workers} worker(s)")
    print("| cell | d_model | params | steps | s/step | cell hours |")
    print("|---|---|---|---|---|---|")
    for cell in spec["cells"]:
        key = (cell.arch, cell.n_layer, cell.d_model)
        if key not in measured:
            measured[key] = step_seconds(cell, train_cfg, args.steps)
        steps = train_cfg.total_steps(cell.params_total)
        seconds = measured[key] * steps
        total += seconds
        print(f"| {cell.name} | {cell.d_model} | {cell.params_total:,} | {steps:,} | {measured[key]:.3f} | "
              f"{seconds / 3600:.2f} |")
    print(f"# training alone: {total / 3600:.1f} cell-hours = {total / 3600 / args.workers:.1f} h wall "
          f"with {args.workers} workers")


if __name__ == "__main__":
    main()
