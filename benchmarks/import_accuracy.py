"""How close an imported Llama's logits are to transformers', by sequence length (issue 18 §2).

A random tiny LlamaForCausalLM (weights moved off their init, built locally: no downloads) is saved
as safetensors and imported with `depthtools.interop.from_hf`; both run in float32 on the same
tokens. Random weights give diffuse attention, which hides RoPE angle errors; scaling q_proj and
k_proj (`--qk-scale`) sharpens attention as training does. Reported per scale and length T: the largest |logit difference| over all positions, and over the last
64 positions only (where RoPE angles are largest). A third column builds our RoPE tables the way
transformers does (inv_freq and angles in float32) to show how much of the gap is the tables: our
float64 tables are the more accurate ones (angles t·θ_i rounded once, at the end), so the residual
gap at long T is transformers' float32 angle rounding, not an error of ours. Two more columns give
each float32 model's distance from the same network run in float64 with float64 tables.

    python benchmarks/import_accuracy.py                 # T = 64, 512, 2048; q/k weights x1, x4, x8
    python benchmarks/import_accuracy.py --d-model 256 --theta 500000 --qk-scale 4
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch


def float32_tables(head_dim: int, max_seq_len: int, theta: float):
    """RoPE cos/sin computed as transformers' LlamaRotaryEmbedding does (float32 throughout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    angles = torch.outer(torch.arange(max_seq_len).float(), inv_freq)
    return angles.cos(), angles.sin()


def float64_model(model):
    """A float64 copy of a DepthModel with RoPE tables kept in float64 (the reference for both): the
    formula of `depthtools.arch.layers.rope_tables` without its final cast to float32."""
    import copy

    ref = copy.deepcopy(model).double()
    cfg = ref.config
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim)
    angles = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float64), inv_freq)
    ref.rope_cos, ref.rope_sin = angles.cos(), angles.sin()
    return ref


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 512, 2048])
    parser.add_argument("--theta", type=float, default=10000.0)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--qk-scale", type=float, nargs="+", default=[1.0, 4.0, 8.0],
                        help="multiply q_proj/k_proj by these (sharper attention: more sensitive to RoPE angles)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)

    from transformers import LlamaConfig, LlamaForCausalLM

    from depthtools.interop import from_hf

    longest = max(args.lengths)
    d, heads = args.d_model, args.heads
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, float32, 1 thread; tiny random "
          f"Llama d={d}, {args.layers} layers, {heads} heads ({max(heads // 2, 1)} kv), theta {args.theta:g}")
    print("| q/k scale | T | max abs logit diff (all positions) | last 64 positions | with float32 RoPE tables "
          "| ours vs float64 | transformers vs float64 | logit scale (max abs) |")
    print("|---|---|---|---|---|---|---|---|")
    for qk in args.qk_scale:
        torch.manual_seed(args.seed)
        cfg = LlamaConfig(vocab_size=256, hidden_size=d, intermediate_size=round(8 * d / 3 / 16 + 0.5) * 16,
                          num_hidden_layers=args.layers, num_attention_heads=heads,
                          num_key_value_heads=max(heads // 2, 1), rope_theta=args.theta,
                          max_position_embeddings=longest, rms_norm_eps=1e-5)
        hf = LlamaForCausalLM(cfg).eval()
        with torch.no_grad():
            for p in hf.parameters():
                p.add_(0.05 * torch.randn_like(p))
            for layer in hf.model.layers:  # sharper attention: more sensitive to the RoPE angles
                layer.self_attn.q_proj.weight.mul_(qk)
                layer.self_attn.k_proj.weight.mul_(qk)
        with tempfile.TemporaryDirectory() as tmp:
            hf.save_pretrained(Path(tmp), safe_serialization=True)
            ours = from_hf(tmp)
        gen = torch.Generator().manual_seed(1)
        for T in args.lengths:
            x = torch.randint(0, 256, (1, T), generator=gen)
            with torch.no_grad():
                theirs = hf(x).logits
                mine = ours(x)
                cos64, sin64 = ours.rope_cos, ours.rope_sin
                ours.rope_cos, ours.rope_sin = float32_tables(ours.config.head_dim, ours.config.max_seq_len, args.theta)
                f32 = ours(x)
                ours.rope_cos, ours.rope_sin = cos64, sin64
                exact = float64_model(ours)(x)  # the same network in float64 with float64 RoPE tables
            diff = (mine - theirs).abs()
            print(f"| {qk:g} | {T} | {diff.max().item():.1e} | {diff[:, -64:].max().item():.1e} | "
                  f"{(f32 - theirs).abs().max().item():.1e} | {(mine - exact).abs().max().item():.1e} | "
                  f"{(theirs - exact).abs().max().item():.1e} | {theirs.abs().max().item():.2f} |", flush=True)


if __name__ == "__main__":
    main()
