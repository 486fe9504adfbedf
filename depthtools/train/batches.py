"""Batches from uint16 token memmaps: random training windows indexed by step, fixed eval windows.

The training batch of step s is a pure function of (seed, s): B window offsets drawn from
`numpy.random.default_rng([seed, s])`. Resuming therefore needs only the step — no sampler state —
and the data order does not depend on how often the run was interrupted.
"""

from __future__ import annotations

import numpy as np
import torch

from depthtools.errors import DepthToolsError


def batch_offsets(step: int, seed: int, n_tokens: int, batch_size: int, seq_len: int) -> np.ndarray:
    """Start offsets [B] of the training windows of `step` (each window is seq_len+1 tokens)."""
    return np.random.default_rng([seed, step]).integers(0, n_tokens - seq_len, size=batch_size)


def windows(tokens: np.ndarray, offsets: np.ndarray, seq_len: int) -> torch.Tensor:
    """Token windows [len(offsets), seq_len+1] as int64 (one fancy-index read from the memmap)."""
    index = offsets[:, None] + np.arange(seq_len + 1)[None, :]
    return torch.from_numpy(np.asarray(tokens[index], dtype=np.int64))


class TrainBatches:
    """Training batches of one split; `batch(step)` -> (inputs, targets) [B,T] on `device`."""

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, device: torch.device):
        if len(tokens) < seq_len + 1:
            raise DepthToolsError(
                f"the train split has {len(tokens):,} tokens, fewer than seq_len+1={seq_len + 1}; "
                "use a shorter seq_len or a larger corpus"
            )
        self.tokens, self.batch_size, self.seq_len, self.seed, self.device = tokens, batch_size, seq_len, seed, device

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        offsets = batch_offsets(step, self.seed, len(self.tokens), self.batch_size, self.seq_len)
        data = windows(self.tokens, offsets, self.seq_len)
        if self.device.type == "cuda":
            data = data.pin_memory().to(self.device, non_blocking=True)
        return data[:, :-1], data[:, 1:]


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
