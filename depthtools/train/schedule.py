"""Learning-rate schedules as a multiplier of the peak LR, a pure function of the step.

Being a function of the step alone (no scheduler object with hidden state) is what makes resume
exact: a resumed run recomputes the same LR from the step it restarts at.
"""

from __future__ import annotations

import math

from depthtools.config import TrainConfig


def warmup_steps(cfg: TrainConfig, total_steps: int) -> int:
    """Number of linear-warmup steps: warmup_fraction of the run (DepthBench: 10%)."""
    return int(round(cfg.warmup_fraction * total_steps))


def lr_multiplier(step: int, total_steps: int, cfg: TrainConfig) -> float:
    """LR / peak LR for the update made at `step` (0-based).

    cosine: linear warmup from 1/warmup to 1, then cosine from 1 to final_lr_fraction at the last step.
    wsd:    linear warmup, constant 1, then a linear decay to final_lr_fraction over the last
            decay_fraction of the steps (warmup-stable-decay).
    """
    warmup = warmup_steps(cfg, total_steps)
    if step < warmup:
        return (step + 1) / warmup
    floor = cfg.final_lr_fraction
    if cfg.schedule == "wsd":
        decay = max(1, int(round(cfg.decay_fraction * total_steps))) if cfg.decay_fraction > 0 else 0
        start = total_steps - decay
        if decay == 0 or step < start:
            return 1.0
        progress = (step - start + 1) / decay
        return 1.0 - (1.0 - floor) * progress
    span = total_steps - warmup - 1
    progress = 1.0 if span <= 0 else (step - warmup) / span
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
