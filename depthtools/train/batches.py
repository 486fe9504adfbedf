"""Batches from uint16 token memmaps: random training windows indexed by step, fixed eval windows.

The training batch of step s is a pure function of (seed, s): B window offsets drawn from
`numpy.random.default_rng([seed, s])`. Resuming therefore needs only the step — no sampler state —
and the data order does not depend on how often the run was interrupted.
"""

from __future__ import annotations

import numpy as np
import torch

from depthtools.data.tasks import TaskMixer
from depthtools.errors import DepthToolsError

IGNORE = -100  # a target the loss skips (F.cross_entropy's default ignore_index): unscored task-row tokens


def batch_offsets(step: int, seed: int, n_tokens: int, batch_size: int, seq_len: int) -> np.ndarray:
    """Start offsets [B] of the training windows of `step` (each window is seq_len+1 tokens)."""
    return np.random.default_rng([seed, step]).integers(0, n_tokens - seq_len, size=batch_size)


def windows(tokens: np.ndarray, offsets: np.ndarray, seq_len: int) -> torch.Tensor:
    """Token windows [len(offsets), seq_len+1] as int64 (one fancy-index read from the memmap)."""
    index = offsets[:, None] + np.arange(seq_len + 1)[None, :]
    return torch.from_numpy(np.asarray(tokens[index], dtype=np.int64))


class TrainBatches:
    """Training batches of one split; `batch(step)` -> (inputs, targets) [B,T] on `device`.

    With an answer-only task mix, targets that are not an answer token or end marker of a task row are
    IGNORE, so the mean cross-entropy covers text rows and task answers only.

    Under data parallelism (world_size > 1) rank r gets rows [r·B/W, (r+1)·B/W) of the GLOBAL batch
    of the step, so the windows a step trains on do not depend on the world size (resume may change it).
    """

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, device: torch.device,
                 rank: int = 0, world_size: int = 1, task_mix=None, tokenizer: str = "byte"):
        if len(tokens) < seq_len + 1:
            raise DepthToolsError(
                f"the train split has {len(tokens):,} tokens, fewer than seq_len+1={seq_len + 1}; "
                "use a shorter seq_len or a larger corpus"
            )
        if batch_size % world_size:
            raise DepthToolsError(f"batch_size={batch_size} must be divisible by the world size {world_size}")
        self.tokens, self.batch_size, self.seq_len, self.seed, self.device = tokens, batch_size, seq_len, seed, device
        self.rank, self.world_size = rank, world_size
        self.mixer = None  # task_mix: a share of rows replaced by synthetic task text, by (seed, step, global row)
        if task_mix is not None:
            self.mixer = TaskMixer(task_mix, seed, batch_size, seq_len, tokenizer)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        offsets = batch_offsets(step, self.seed, len(self.tokens), self.batch_size, self.seq_len)
        if self.world_size > 1:
            rows = self.batch_size // self.world_size
            offsets = offsets[self.rank * rows:(self.rank + 1) * rows]
        data = windows(self.tokens, offsets, self.seq_len)
        targets = None
        if self.mixer is not None:
            first = self.rank * len(offsets)  # global index of this rank's first row
            data, scored = self.mixer.apply_with_answers(data, step, range(first, first + len(offsets)))
            if self.mixer.mix.answer_only:  # unscored targets -> IGNORE (cross_entropy's ignore_index)
                targets = data[:, 1:].masked_fill(torch.from_numpy(~scored[:, 1:]), IGNORE)
        if self.device.type == "cuda":
            data = data.pin_memory().to(self.device, non_blocking=True)
            targets = None if targets is None else targets.pin_memory().to(self.device, non_blocking=True)
        return data[:, :-1], data[:, 1:] if targets is None else targets


def eval_windows(tokens: np.ndarray, seq_len: int, max_tokens: int) -> torch.Tensor | None:
    """Fixed evaluation windows [k, T+1] spread evenly over a split (same every eval); None if empty.

    k = max_tokens // seq_len windows (at least 1, at most what fits without overlap); a split shorter
    than seq_len+1 gives one shorter window.
    """
    n = len(tokens)
    if n < 2:
        return None
    seq_len = min(seq_len, n - 1)
    k = max(1, min(max_tokens // seq_len, (n - 1) // seq_len))
    offsets = np.linspace(0, n - seq_len - 1, k).round().astype(np.int64)
    return windows(tokens, offsets, seq_len)
