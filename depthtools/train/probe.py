"""Per-depth forward and backward norms on selected training steps (overhead only on those steps).

Forward norm at depth l: mean over tokens of ‖geometry(z_l)‖₂ (the contract's vector, so HC counts
all streams, AttnRes its readout). Backward norm at depth l: mean over tokens of ‖∂loss/∂z_l‖₂ for
the tensor block l writes, as its scheme names it (`ResidualScheme.written_tensor`: the residual
stream of single-stream schemes and MoDA's h, the stream stack of HC/mHC, the DWA mix of
DenseFormer, the newest source of the AttnRes bank) — via tensor hooks registered only on probe
steps.
"""

from __future__ import annotations

import torch

from depthtools.arch import State


class DepthProbe:
    """Collects forward norms when `watch` is called and gradient norms during backward."""

    def __init__(self, grad_scale: float = 1.0):
        self.grad_scale = grad_scale  # undo the loss scaling of gradient accumulation
        self.forward: torch.Tensor | None = None
        self.grads: dict[int, torch.Tensor] = {}

    def watch(self, model, states: list[State]) -> None:
        with torch.no_grad():
            self.forward = torch.stack([model.geometry(s).float().norm(dim=-1).mean() for s in states])
        for depth, state in enumerate(states):
            tensor = model.scheme.written_tensor(state)
            if tensor is not None and tensor.requires_grad:
                tensor.register_hook(self._grad_hook(depth))

    def _grad_hook(self, depth: int):
        def store(grad: torch.Tensor) -> None:
            self.grads[depth] = grad.detach().float().flatten(2).norm(dim=-1).mean() * self.grad_scale
        return store

    def record(self) -> dict[str, list[float | None]]:
        """{"depth_fwd_norm": [L+1], "depth_grad_norm": [L+1]} as Python floats (one host sync)."""
        n = 0 if self.forward is None else len(self.forward)
        fwd = self.forward.tolist() if self.forward is not None else []
        grads = [self.grads.get(l) for l in range(n)]
        present = [g for g in grads if g is not None]
        values = iter(torch.stack(present).tolist() if present else [])
        return {"depth_fwd_norm": fwd, "depth_grad_norm": [None if g is None else next(values) for g in grads]}
