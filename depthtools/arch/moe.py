"""Mixture-of-experts as a typed MLP option of the Pre-LN block (Mixtral, OLMoE, Qwen2-MoE, Qwen3-MoE).

With `moe_experts` E > 0, a block's MLP (every block, or those marked "m" in `moe_layers`) is

    p = softmax(router(x))                      router: a bias-free [E, d] linear map, softmax in float32
    S = the top-k experts by p (`moe_top_k`), w_e = p_e, renormalised to Σ_S w = 1 when `moe_norm_topk`
    y = Σ_{e ∈ S} w_e · expert_e(x)  [+ σ(g·x) · shared(x)]

each expert a gated (or plain) MLP of width `moe_ff` with the block's activation, and an optional shared
expert of width `moe_shared_ff` that every token passes through, gated by a sigmoid of a [1, d] map
(`moe_shared_gate`; Qwen2-MoE). This is transformers' computation (its `*TopKRouter` and `*Experts`
modules, read as the spec): the top-k weights are cast back to the activations' dtype before they scale
the expert outputs, and ties in the top-k follow torch.topk on the same float32 probabilities. (In half
precision Qwen-MoE and OLMoE do the same cast; transformers' Mixtral multiplies by the float32 weights and
casts the product, a difference of one rounding of the weight that float32 models do not have.)

Hooks: `hook_router` carries the router logits [B, T, E] (the `expert-routing` view reads them);
`hook_post` of each expert is its own hidden activation on the tokens routed to it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from transformer_lens.hook_points import HookPoint

from depthtools.arch.backbone import backbone

if TYPE_CHECKING:
    from depthtools.config import ModelConfig


def route(logits: torch.Tensor, top_k: int, normalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [N, k] float32, experts [N, k]) of router logits [N, E]: softmax in float32, top-k, and the
    top-k weights renormalised to sum 1 when `normalise`."""
    probs = F.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if normalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


class MoE(nn.Module):
    """Top-k routed experts (and an optional shared expert): the MLP of an MoE block (module docstring)."""

    def __init__(self, cfg: ModelConfig, mlp_factory):
        super().__init__()
        bb = backbone(cfg)
        self.n_experts, self.top_k, self.normalise = bb.moe_experts, bb.moe_top_k, bb.moe_norm_topk
        width = bb.moe_ff or cfg.d_ff
        self.router = nn.Linear(cfg.d_model, bb.moe_experts, bias=False)
        self.experts = nn.ModuleList(mlp_factory(cfg, width) for _ in range(bb.moe_experts))
        if bb.moe_shared_ff:
            self.shared = mlp_factory(cfg, bb.moe_shared_ff)
            self.shared_gate = nn.Linear(cfg.d_model, 1, bias=False) if bb.moe_shared_gate else None
        else:
            self.shared, self.shared_gate = None, None
        self.hook_router = HookPoint()  # [B, T, E] router logits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        logits = self.hook_router(self.router(x)).reshape(-1, self.n_experts)
        weights, chosen = route(logits, self.top_k, self.normalise)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(flat)
        for e in torch.unique(chosen).tolist():
            tokens, slot = torch.where(chosen == e)
            y = self.experts[e](flat[tokens]) * weights[tokens, slot, None]
            out = out.index_add(0, tokens, y.to(out.dtype))
        if self.shared is not None:
            shared = self.shared(flat)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(flat)) * shared
            out = out + shared
        return out.reshape(shape)
