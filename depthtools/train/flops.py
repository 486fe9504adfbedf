"""Training FLOPs per token, per architecture, for tokens/s -> MFU.

    flops/token ≈ 6·N_matmul + 12·L·d·T + scheme extras

N_matmul = parameters used in matrix products (all but the input-embedding lookup; the unembedding
counts). 12·L·d·T is attention's score and value products, forward + backward, without causal
halving (as PaLM, Chowdhery et al. 2022, App. B). Scheme extras are the depth-mixing products that
are not parameter matmuls (×3 for forward + backward):
    hc/mhc:        per sublayer 2·d·(n² + 2n)      (stream mixing, branch input, branch output)
    attnres:       sublayer i mixes i+1 sources, 4·d per source (logits + weighted sum), plus final
    blockattnres:  as attnres with ≤ blocks+2 sources per mix
    denseformer:   DWA after block b mixes b+2 sources, 2·d per source
    moda:          depth attention of block l over l slots, 4·d per slot
An approximation (norms, softmax, activations are ignored), good to a few percent for matmul-bound
shapes; MFU = flops/token × tokens/s / peak FLOPs of the device.
"""

from __future__ import annotations

import math

from depthtools.config import ModelConfig

PEAK_BF16_FLOPS = {  # dense bf16 tensor-core peak, by substring of torch.cuda.get_device_name()
    "H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "L4": 121e12,
    "RTX 4090": 165e12, "RTX 3090": 71e12, "V100": 125e12,
}


def scheme_extra_flops(cfg: ModelConfig) -> float:
    """Forward FLOPs per token of the scheme's depth mixing (see the module docstring)."""
    d, L = cfg.d_model, cfg.n_layer
    if cfg.arch in ("hc", "mhc"):
        n = int(cfg.options.get("n_streams", 4))
        return 2 * L * 2 * d * (n * n + 2 * n)
    if cfg.arch == "attnres":
        return sum(4 * d * (i + 1) for i in range(2 * L + 1))
    if cfg.arch == "blockattnres":  # S in sublayers, the model's own default: <= ceil(2L/S) blocks + embedding + partial
        from depthtools.arch.attnres import default_block_size

        size = int(cfg.options.get("attnres_block_size", default_block_size(L)))
        return (2 * L + 1) * 4 * d * (math.ceil(2 * L / size) + 2)
    if cfg.arch == "denseformer":
        return sum(2 * d * (b + 2) for b in range(L))
    if cfg.arch == "moda":
        return sum(4 * d * position for position in range(L))
    return 0.0


def flops_per_token(cfg: ModelConfig, params_total: int, seq_len: int) -> float:
    """Approximate training (forward + backward) FLOPs per token."""
    matmul_params = params_total - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model)
    return 6.0 * matmul_params + 12.0 * cfg.n_layer * cfg.d_model * seq_len + 3.0 * scheme_extra_flops(cfg)


def peak_flops(device_name: str) -> float | None:
    """bf16 peak FLOPs/s of a CUDA device by name, or None if unknown (then MFU is not reported)."""
    for key, value in PEAK_BF16_FLOPS.items():
        if key in device_name:
            return value
    return None
