"""Fingerprints of the models a tree builds: same config -> same parameters and logits, checked across two trees.

For every registered architecture (default options), a set of Pre-LN option configs (every RoPE type, MoE, norms,
positions, soft-caps, windows) and every case of tests/test_families.py (config.json -> ModelConfig through
`hf_to_model_config`), it builds `DepthModel(cfg, seed=0)` on the CPU in float32 and prints one JSON line per
model: the config's JSON, a SHA-256 of every parameter and buffer (name, dtype, shape, bytes) and a SHA-256 of the
logits of fixed tokens and of the gradients of their cross-entropy. Run it under two trees and compare the outputs (issue 46 item 2: one form for the options
must change no number):

    PYTHONPATH=/work/wt/base python benchmarks/model_fingerprints.py > /tmp/a.jsonl
    PYTHONPATH=$PWD python benchmarks/model_fingerprints.py > /tmp/b.jsonl
    cmp /tmp/a.jsonl /tmp/b.jsonl && echo identical

Bit-identical is the claim (same code path, same seed, one thread), so the hashes must agree exactly.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

from depthtools.arch import DepthModel, list_archs  # noqa: E402
from depthtools.config import ModelConfig  # noqa: E402

SHAPE = dict(vocab_size=61, d_model=32, n_layer=3, n_heads=4, max_seq_len=32)
PRELN_OPTIONS = {  # one config per group of options, each away from the defaults
    "rope-linear": {"rope_type": "linear", "rope_factor": 2.0},
    "rope-dynamic": {"rope_type": "dynamic", "rope_factor": 2.0, "rope_original_context": 8},
    "rope-yarn": {"rope_type": "yarn", "rope_factor": 4, "rope_original_context": 8, "rope_beta_fast": 16,
                  "rope_truncate": False},
    "rope-longrope": {"rope_type": "longrope", "rope_factor": 4.0, "rope_original_context": 8,
                      "rope_short_factor": [1, 1.5, 2, 2.5], "rope_long_factor": [2, 3, 4, 5]},
    "rope-llama3": {"rope_type": "llama3", "rope_factor": 8.0, "rope_original_context": 16,
                    "rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0},
    "gemma2-like": {"norm_gain": "one_plus", "out_norm": True, "embed_scale": 5.5, "attn_softcap": 0.5,
                    "final_softcap": 2.0, "sliding_window": 4, "layer_types": "sfs", "mlp_act": "gelu_tanh",
                    "head_dim": 16, "rope_theta_sliding": 1000.0},
    "neox-like": {"parallel": True, "rotary_fraction": 0.25, "norm": "layer", "norm_bias": True, "mlp": "plain",
                  "mlp_act": "gelu", "qkv_bias": True, "attn_out_bias": True, "mlp_bias": True},
    "gpt2-like": {"positions": "learned", "norm": "layer", "norm_bias": True, "head_bias": True, "mlp": "plain",
                  "mlp_act": "relu"},
    "olmo2-like": {"pre_norm": False, "out_norm": True, "qk_norm": "full", "qkv_clip": 0.5, "attn_scale": 0.3},
    "moe": {"moe_experts": 4, "moe_top_k": 2, "moe_ff": 24, "moe_shared_ff": 16, "moe_layers": "mdm",
            "qk_norm": "head", "clip_after_norm": True, "qkv_clip": 1.0, "moe_norm_topk": False},
}


def digest(model: DepthModel, tokens: torch.Tensor) -> dict[str, str]:
    """SHA-256 of the state dict (names, dtypes, shapes, bytes), of the logits on `tokens`, and of every parameter's
    gradient of the next-token cross-entropy on `tokens` (one backward)."""
    params = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().contiguous()
        params.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        params.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    with torch.no_grad():
        logits = model(tokens).float().contiguous()
    model.zero_grad(set_to_none=True)
    out = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]).float(), tokens[:, 1:].reshape(-1)).backward()
    grads = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        if p.grad is not None:
            g = p.grad.detach().contiguous()
            grads.update(f"{name}|{tuple(g.shape)}|".encode() + g.reshape(-1).view(torch.uint8).numpy().tobytes())
    return {"params": params.hexdigest(), "logits": hashlib.sha256(logits.numpy().tobytes()).hexdigest(),
            "grads": grads.hexdigest()}


def family_configs() -> dict[str, ModelConfig]:
    """tests/test_families.py's cases as ModelConfigs (through hf_to_model_config); {} without transformers."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    try:
        import test_families as tf
    except Exception as exc:  # pytest.importorskip raises Skipped (not an ImportError) without transformers
        print(f"# no family cases: {type(exc).__name__}", file=sys.stderr)
        return {}
    from depthtools.interop.families import hf_to_model_config

    return {f"family:{case}": hf_to_model_config(tf.hf_config(case).to_dict()) for case in tf.CASES}


def configs() -> dict[str, ModelConfig]:
    out = {f"arch:{spec.name}": ModelConfig(arch=spec.name, **SHAPE) for spec in list_archs()}
    out.update({f"preln:{k}": ModelConfig(arch="preln", options=v, **SHAPE) for k, v in PRELN_OPTIONS.items()})
    out.update(family_configs())
    return out


def main() -> None:
    torch.set_num_threads(1)
    tokens = torch.randint(0, SHAPE["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))
    for name, cfg in configs().items():
        model = DepthModel(cfg, seed=0).eval()
        print(json.dumps({"name": name, "config": cfg.to_json(), **digest(model, tokens)}, sort_keys=True))


if __name__ == "__main__":
    main()
