"""DenseFormer (Pagliardini et al. 2024, arXiv 2402.02622): Depth-Weighted Averaging (DWA).

Every block is a full Pre-LN block (with its own residual); after it, a DWA module replaces the
stream by a learned linear combination of all retained block outputs:

    X_0 = x_0 (embedding),  X_{b+1} = PreLNBlock_b(Xt_b),  Xt_0 = X_0
    Xt_{b+1} = Σ_j a_{b,j} X_j       over j ≡ b+1 (mod k), j ≤ b+1        (if (b+1) mod p == 0)
    Xt_{b+1} = X_{b+1}                                                     (otherwise)

with dilation k (`dwa_dilation`) and period p (`dwa_period`), both default 1 (epfml/DenseFormer
`DWAModules`). Weights init 1 on the newest state X_{b+1}, 0 elsewhere, so at init the network is
exactly Pre-LN. Extra parameters: Σ_{m = p, 2p, … ≤ L} (⌊m/k⌋ + 1), = L(L+3)/2 for k = p = 1.

Depth state (`DenseState`, immutable): the retained X_0..X_l and the mixed Xt_l. Readout and
geometry = Xt_l (what the next block reads; at l = L what the final norm reads). The DWA rows
`scheme.dwa.{b}` are tied to the position (they stay in place on a swap; the block's norms,
attention and MLP travel). Skip l: X_{l+1} := Xt_l (the block is the identity), the DWA after
position l still applies unchanged.

Hooks: the within-block stream is additive, so `hook_resid_pre` (= Xt_b) + `hook_attn_out` =
`hook_resid_mid`, + `hook_mlp_out` = `hook_resid_post` (= X_{b+1}, the raw block output); the
position's `hook_dwa_out` carries Xt_{b+1} (what the next block reads; not fired for a skipped
position). Since resid_post is not the depth state's readout, blocks are not marked single-stream.
DWA weights are excluded from weight decay (routing parameters). Option fused (True): False forms
the DWA with plain autograd (reference.weighted_sum) instead of bankops' `_WeightedSum`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformer_lens.hook_points import HookPoint

from depthtools.arch import reference
from depthtools.arch.bankops import weighted_sum
from depthtools.arch.layers import RMSNorm
from depthtools.arch.scheme import ArchSpec, DepthRouting, NormSite, Option, ResidualScheme

if TYPE_CHECKING:  # annotations only (depthtools.config imports nothing from arch/: no circle either way)
    from depthtools.config import ModelConfig


@dataclass(frozen=True)
class DenseState:
    """DenseFormer depth state: retained block outputs X_0..X_l and the current mix Xt_l [B,T,d]."""

    retained: tuple[torch.Tensor, ...]
    mixed: torch.Tensor


def dwa_settings(cfg: ModelConfig) -> tuple[int, int]:
    """(dilation k, period p) from the options (validated, with their defaults, by the scheme's schema)."""
    opts = DenseFormerScheme.options_for(cfg)
    return opts.dwa_dilation, opts.dwa_period


def dwa_sizes(n_layer: int, dilation: int, period: int) -> dict[int, int]:
    """position b -> number of DWA weights after block b (only positions that have a DWA)."""
    return {b: (b + 1) // dilation + 1 for b in range(n_layer) if (b + 1) % period == 0}


def _denseformer_extra(cfg: ModelConfig) -> int:
    return sum(dwa_sizes(cfg.n_layer, *dwa_settings(cfg)).values())


class DenseFormerScheme(ResidualScheme):
    """Pre-LN blocks + position-bound depth-weighted averages of all retained block outputs."""

    single_stream = False
    compile_region = "sublayer"  # the DWA mix keeps its fused kernel (its source count grows with depth)
    skip_rules = ("identity",)

    @classmethod
    def option_schema(cls, arch: str) -> dict[str, Option]:
        """dwa_dilation k and dwa_period p (positive integers, default 1)."""
        schema = {"dwa_dilation": Option("int", 1, low=1), "dwa_period": Option("int", 1, low=1)}
        schema["fused"] = Option("bool", True, doc="False: the plain-autograd references (reference.py)")
        return schema

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.dilation, self.period = dwa_settings(cfg)
        self.fused = self.opts.fused  # False: the DWA as reference.weighted_sum (plain autograd)
        sizes = dwa_sizes(cfg.n_layer, self.dilation, self.period)
        self.dwa = nn.ParameterDict({str(b): nn.Parameter(self._dwa_init(n)) for b, n in sizes.items()})

    @staticmethod
    def _dwa_init(n: int) -> torch.Tensor:
        weights = torch.zeros(n)
        weights[-1] = 1.0  # the newest state X_{b+1}
        return weights

    def build_block(self, block: nn.Module) -> None:
        d, eps = self.cfg.d_model, self.cfg.norm_eps
        block.attn_norm, block.mlp_norm = RMSNorm(d, eps), RMSNorm(d, eps)
        block.hook_dwa_out = HookPoint()  # [B,T,d] Xt_{b+1}

    def no_decay_names(self) -> tuple[str, ...]:
        return ("dwa.",)

    def extra_flops(self) -> float:
        """Each DWA: Σ_j a_j X_j over its group of retained states, 2d per weight."""
        return 2.0 * self.cfg.d_model * sum(w.numel() for w in self.dwa.values())

    # -- the depth-state contract -------------------------------------------------------------
    def embed_state(self, x0: torch.Tensor) -> DenseState:
        return DenseState(retained=(x0,), mixed=x0)

    def step(self, position, block, state: DenseState, home, rope) -> DenseState:
        x = block.hook_resid_pre(state.mixed)
        x = block.hook_resid_mid(x + block.hook_attn_out(self.run_attn(block.attn_norm, block.attn, x, rope)))
        x = block.hook_resid_post(x + block.hook_mlp_out(self.run_mlp(block.mlp_norm, block.mlp, x)))
        new = self._after_block(position, state.retained + (x,))
        return DenseState(new.retained, home.hook_dwa_out(new.mixed))

    def skip(self, position: int, state: DenseState, rule: str | None = None) -> DenseState:
        self._check_rule(rule)
        return self._after_block(position, state.retained + (state.mixed,))  # X_{l+1} := Xt_l

    def readout(self, state: DenseState) -> torch.Tensor:
        return state.mixed

    def geometry(self, state: DenseState) -> torch.Tensor:
        return state.mixed

    def depth_routing(self, model, tokens, exclude_first):
        """The static DWA weights `dwa.{b}`: consumer = the input of block b+1 (depth 2(b+1); "final" after
        the last block), sources the retained block outputs X_j at depth 2j."""
        S = 2 * self.cfg.n_layer
        W = torch.full((S + 1, S + 1), float("nan"), dtype=torch.float64)
        consumers = []
        for key, weights in self.dwa.items():
            b = int(key)
            group = list(range(b + 2))[(b + 1) % self.dilation :: self.dilation]  # X_j, j ≡ b+1 (mod k)
            for j, value in zip(group, weights.detach().to(torch.float64).tolist()):
                W[2 * (b + 1), 2 * j] = value
            consumers.append((2 * (b + 1), "final" if b == self.cfg.n_layer - 1 else "dwa"))
        return DepthRouting(sorted(consumers), W)

    def written_tensor(self, state: DenseState) -> torch.Tensor:
        """The DWA mix Xt_l (what the next block reads)."""
        return state.mixed

    # -- TransformerLens' cache functions ------------------------------------------------------
    def tl_limits(self) -> dict[str, str]:
        """Per-sublayer head/neuron results are exact; the stream functions are not (see the docstring)."""
        reason = ("denseformer replaces the stream after every block by a depth-weighted average of all block "
                  "outputs (hook_dwa_out): hook_resid_post is the raw block output, not what the next block or "
                  "the final norm reads, and the stream is not a sum of hook_attn_out/hook_mlp_out; read depths "
                  "with model.readout / run_states (depthtools.analysis.lens) and decompose with "
                  "depthtools.analysis.contrib")
        return {"stream": reason, "sum": reason}

    def tl_norm_site(self, block, sublayer: str):
        return NormSite(f"blocks.{block.index}.hook_resid_{'pre' if sublayer == 'attn' else 'mid'}",
                        getattr(block, f"{sublayer}_norm"))

    def _after_block(self, position: int, retained: tuple[torch.Tensor, ...]) -> DenseState:
        """Apply the DWA that follows `position` (if any) to the retained states."""
        key = str(position)
        if key not in self.dwa:
            return DenseState(retained, retained[-1])
        group = retained[(position + 1) % self.dilation :: self.dilation]  # X_j, j ≡ b+1 (mod k)
        return DenseState(retained, (weighted_sum if self.fused else reference.weighted_sum)(self.dwa[key], group))


ARCH_SPECS = [
    ArchSpec(
        "denseformer", "cross-layer",
        "DenseFormer: Pre-LN blocks + depth-weighted average of all retained block outputs after each block "
        "(options dwa_dilation k, dwa_period p)",
        "Σ_{m=p,2p,…≤L} (⌊m/k⌋+1); k=p=1: L(L+3)/2", _denseformer_extra,
        "Pagliardini et al. 2024, DenseFormer, arXiv 2402.02622", DenseFormerScheme, False, (),
    ),
]
