"""The residual-scheme protocol: what an architecture must define for the depth-state contract.

A `ResidualScheme` owns everything that differs between architectures: which extra modules each
block carries, what the depth state is, how a block updates it, what the head reads, and how a
block is bypassed. `DepthModel` owns the shared backbone (embedding, blocks' attention/MLP,
final norm, unembedding) and drives the scheme. Analyses only see `DepthModel`'s contract.

Swap convention (DESIGN §3): a block's parameters travel with it; what is tied to a *position*
(structure, position-bound parameters) stays. `step(position, block, state, home)` receives the
block that runs (`block`) and the block that was built for this position (`home`); a tensor the
running block lacks (a structurally mismatched key, e.g. KEEL block 0's missing norm) is taken
from `home`, as DepthBench's swap leaves mismatched tensors in place.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from depthtools.config import ModelConfig

State = Any  # architecture-specific and opaque to analyses (tensor, stream stack, source bank...)


class ResidualScheme(nn.Module):
    """Base class: the identity-free pieces every architecture implements.

    Subclasses set `single_stream` (True when the state is a plain [B,T,d] residual stream that
    TransformerLens tools may read as `hook_resid_*`) and `skip_rules` (names of the skip
    semantics they support; the first is the default).
    """

    single_stream: bool = True
    skip_rules: tuple[str, ...] = ("identity",)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg

    # -- construction -------------------------------------------------------------------------
    def build_block(self, block: nn.Module) -> None:
        """Add this architecture's per-block modules (norms, gains, connectors) to `block`."""
        raise NotImplementedError

    def init_weights(self, model: nn.Module) -> None:
        """Architecture-specific initialisation, applied after the backbone's default init."""

    # -- the depth-state contract -------------------------------------------------------------
    def embed_state(self, x0: torch.Tensor) -> State:
        """z_0 from the embedding output x0 [B,T,d]."""
        return x0

    def step(self, position: int, block: nn.Module, state: State, home: nn.Module, rope) -> State:
        """Apply `block` at `position` to `state`; must not modify `state` in place."""
        raise NotImplementedError

    def skip(self, position: int, state: State, rule: str | None = None) -> State:
        """The state after bypassing the block at `position` (default: identity on the state)."""
        self._check_rule(rule)
        return state

    def readout(self, state: State) -> torch.Tensor:
        """[B,T,d]: what the final norm + unembedding read if the network stopped here."""
        return state

    def geometry(self, state: State) -> torch.Tensor:
        """[B,T,k]: the vector used for similarity/angle metrics."""
        return state

    def _check_rule(self, rule: str | None) -> str:
        rule = rule or self.skip_rules[0]
        if rule not in self.skip_rules:
            from depthtools.errors import DepthToolsError

            raise DepthToolsError(
                f"skip rule {rule!r} is not defined for {self.cfg.arch}; valid: {list(self.skip_rules)}"
            )
        return rule

    # -- parameter bookkeeping ----------------------------------------------------------------
    def no_decay_names(self) -> tuple[str, ...]:
        """Substrings of parameter names excluded from weight decay beyond norms/gains (routing)."""
        return ()
