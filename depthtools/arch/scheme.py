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

from typing import Any, NamedTuple

import torch
from torch import nn

from depthtools.config import ModelConfig

State = Any  # architecture-specific and opaque to analyses (tensor, stream stack, source bank...)

# What TransformerLens' ActivationCache functions assume of a model (see `ResidualScheme.tl_limits`):
TL_CAPABILITIES = {
    "stream": "blocks.{l}.hook_resid_pre|mid|post carry the depth state and the final norm reads the last "
              "hook_resid_post (accumulated_resid, logit_lens)",
    "sum": "the stream is hook_embed plus every earlier hook_attn_out and hook_mlp_out "
           "(decompose_resid, stack_head_results, stack_neuron_results, get_full_resid_decomposition)",
    "heads": "hook_attn_out is the sum over heads of hook_z · W_O (compute_head_results)",
    "neurons": "hook_mlp_out is the sum over neurons of mlp.hook_post · W_out (get_neuron_results)",
}


class NormSite(NamedTuple):
    """Where a block's pre-norm sits, for TransformerLens' `apply_ln_to_stack(layer=l)`: the cache key of
    the [B,T,d] tensor the norm reads, the RMSNorm (its eps and gain), and a constant factor applied
    after it (LNS' 1/sqrt(l+1); 1 elsewhere)."""

    hook: str
    norm: nn.Module
    factor: float = 1.0


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

    def recorded_config(self) -> ModelConfig:
        """The config a model of this scheme records (`DepthModel.config`, saved in checkpoints): `cfg`,
        plus any option whose default has changed written out, so that an absent key identifies a
        config saved before the change (see `depthtools.arch.hyper.legacy_options`)."""
        return self.cfg

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

    # -- TransformerLens' ActivationCache functions (DepthCache, tl_cache.py) ------------------
    def tl_limits(self) -> dict[str, str]:
        """{capability: why it fails here} for the `TL_CAPABILITIES` this architecture does not meet;
        the cache refuses the functions that rely on one, with this reason. Default: none is met."""
        reason = f"{self.cfg.arch} does not declare how TransformerLens' cache functions read it"
        return dict.fromkeys(TL_CAPABILITIES, reason)

    def tl_norm_site(self, block: nn.Module, sublayer: str) -> "NormSite | str":
        """The pre-norm of `block`'s sublayer ("attn" | "mlp") as a `NormSite`, or why there is none."""
        return f"{self.cfg.arch} does not declare where block {block.index}'s {sublayer} pre-norm reads"

    def tl_branch_scale(self, block: nn.Module, sublayer: str) -> "torch.Tensor | float":
        """The constant (or [d] vector) factor between the sublayer's projection output (attn.w_o /
        mlp.w2) and its hook_{attn,mlp}_out, for per-head and per-neuron results (1 = none)."""
        return 1.0

    # -- parameter bookkeeping ----------------------------------------------------------------
    def no_decay_names(self) -> tuple[str, ...]:
        """Substrings of parameter names excluded from weight decay beyond norms/gains (routing)."""
        return ()
