"""Training FLOPs per token, per architecture, for tokens/s -> MFU.

    flops/token = 3 × forward,  forward = 2·N_backbone + 4·L·d·T + scheme extras

N_backbone = the parameters of a Pre-LN model of the same shape without the input-embedding lookup
(= params_total − input embedding − the architecture's extra parameters): its matrices (the
unembedding counts) and its 2L+1 norm gains, the one elementwise term kept (2 FLOPs per token each,
< 1/(6d) of the total). 4·L·d·T is attention's score and value products without causal halving (as
PaLM, Chowdhery et al. 2022, App. B). Scheme extras = `ResidualScheme.extra_flops()`: the matrix
products the architecture adds (its own parameters, counted per use, and its depth mixing: stream
mixing, depth attention, weighted sums over sources), each 2 FLOPs per multiply-add. Model FLOPs,
not hardware FLOPs: a fused path that computes more (AttnRes' key dots with every mixer) counts as
the function it computes. Norms, softmax, activations and other elementwise work are not counted;
tests/test_flops.py checks the formula of every architecture against a counted forward
(torch.utils.flop_counter). Backward = 2 × forward. MFU = flops/token × tokens/s / peak FLOPs.
"""

from __future__ import annotations

import torch

from depthtools.arch import get_arch
from depthtools.arch.backbone import backbone
from depthtools.config import ModelConfig

PEAK_BF16_FLOPS = {  # dense bf16 tensor-core peak, by substring of torch.cuda.get_device_name()
    "H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "L4": 121e12,
    "RTX 4090": 165e12, "RTX 3090": 71e12, "V100": 125e12,
}


def scheme_extra_flops(cfg: ModelConfig) -> float:
    """Forward FLOPs per token the architecture adds to Pre-LN (its scheme's `extra_flops`)."""
    with torch.random.fork_rng(devices=[]):  # building the scheme (no blocks) must not move the RNG
        return float(get_arch(cfg.arch).build_scheme(cfg).extra_flops())


def inactive_expert_params(cfg: ModelConfig) -> int:
    """Parameters of the experts a token is not routed to (a mixture-of-experts MLP runs top-k of E experts
    per token): Σ over MoE blocks of (E − k) × one expert's parameters; 0 for dense models."""
    bb = backbone(cfg)
    if not bb.moe_experts:
        return 0
    width = bb.moe_ff or cfg.d_ff
    matrices = 3 if bb.mlp == "gated" else 2
    expert = matrices * cfg.d_model * width + ((matrices - 1) * width + cfg.d_model if bb.mlp_bias else 0)
    return sum((bb.moe_experts - bb.moe_top_k) * expert for layer in range(cfg.n_layer) if bb.is_moe(layer))


def flops_per_token(cfg: ModelConfig, params_total: int, seq_len: int) -> float:
    """Approximate training (forward + backward) FLOPs per token (see the module docstring); a mixture of
    experts counts the experts a token runs through (`inactive_expert_params` left out)."""
    backbone = params_total - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model) - get_arch(cfg.arch).extra_params(cfg)
    backbone -= inactive_expert_params(cfg)
    return 6.0 * backbone + 12.0 * cfg.n_layer * cfg.d_model * seq_len + 3.0 * scheme_extra_flops(cfg)


def peak_flops(device_name: str) -> float | None:
    """bf16 peak FLOPs/s of a CUDA device by name, or None if unknown (then MFU is not reported)."""
    for key, value in PEAK_BF16_FLOPS.items():
        if key in device_name:
            return value
    return None
