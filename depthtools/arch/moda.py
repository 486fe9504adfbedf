"""MoDA — Mixture-of-Depths Attention (Zhu et al., arXiv 2603.15619), pure PyTorch.

The residual stream is standard (Pre-LN by default, Post-LN with ``options={"moda_norm": "post"}``).
What changes is attention: the query of head h at position t in block b attends, in ONE softmax
(scale 1/sqrt(head_dim)), to

    sequence keys   k_b[0..t]          (this layer's causal keys, RoPE as usual)
    depth keys      K_s[t], s < 2b     ("depth memories": K/V at the SAME position t written by
                                        every earlier sublayer)

    o_t = sum_j p_j v_b[j] + sum_s p_s V_s[t],   p = softmax([q·k_b[j] ; q_d·K_s[t]] / sqrt(hd))

Depth slots (DepthBench `MoDATransformerBlock`, reference/architectures.md §3.5):
  slot 2b   = attention of block b: its own K, V (raw, before RoPE; hook_k / hook_v values),
  slot 2b+1 = MLP of block b: an extra ``kv_proj: d -> 2·n_kv·hd`` on the MLP's (normed) input.
Block 0 therefore attends plainly (fused SDPA when no hook is attached). Nothing reads the slots
of the last block, so block L-1 has no ``kv_proj`` and writes no slots: the final state holds
2(L-1) slots and the model has exactly 2·d·n_kv·hd·(L-1) parameters more than Pre-LN.

RoPE and the depth keys (option ``moda_depth_rope``). A depth key sits at the query's own position,
so its relative offset is 0. "none" (default) scores depth keys with the *un-rotated* query q·K,
which equals rotating both q and K by position t (R_t is orthogonal): translation-invariant, like
every other RoPE score. "query" scores them with the rotated query (R_t q)·K against raw keys —
what DepthBench's call of the official kernel computes (rotated q, pre-RoPE cache) — so the depth
score depends on the absolute position t. Use "query" to load DepthBench-trained weights.

State = `MoDAState(h, keys, values, valid)`: the residual stream h [B,T,d] plus the depth cache
keys/values [B,T,n_kv,S,hd] (None while S = 0) and a per-slot validity tuple. Steps never modify
a state in place (they concatenate into new tensors), so cached states can be reused by sweeps.
Readout = geometry = h; the blocks are single-stream (hook_resid_* carry h; TransformerLens'
logit lens accepts them). The depth cache is side state, invisible to the lens.

Hooks beyond the backbone's: ``blocks.{l}.attn.hook_pattern`` is the *sequence part* [B,H,T,T] of
the joint softmax (rows sum to 1 minus the depth mass); ``blocks.{l}.hook_moda_depth_pattern``
[B,H,T,S] the depth part; ``blocks.{l}.hook_moda_k`` / ``hook_moda_v`` [B,T,n_kv,hd] the MLP's
depth K/V. Editing a pattern hook edits the output (the split weights are used as returned).

Skip (rules in ``skip_rules``): the block is the identity on h and writes no depth K/V.
  "mask" (default): its slots are appended but invalid, i.e. absent from every later softmax —
         exactly a network that never had them.
  "zero": DepthBench's literal rule: the slots stay zero but still count, so a later query gives
         each a score of 0 (weight exp(0)/Z) and a zero value: they dilute the softmax.
Swap: the running block brings all its weights, kv_proj included. Slot indices follow the
*position* (the block running at position p writes slots 2p, 2p+1), and whether a position
writes an MLP slot is structure tied to the position: a block without kv_proj (block L-1) run
at an earlier position uses that position's own kv_proj (DepthBench leaves mismatched tensors in
place), and any block run at position L-1 writes no slots.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformer_lens.hook_points import HookPoint

from depthtools.arch.layers import RMSNorm, apply_rope
from depthtools.arch.registry import ArchSpec
from depthtools.arch.scheme import ResidualScheme
from depthtools.config import ModelConfig
from depthtools.errors import DepthToolsError

NORMS = ("pre", "post")
DEPTH_ROPE = ("none", "query")


class MoDAState(NamedTuple):
    """(residual stream, depth K/V cache). Immutable: steps return new tuples."""

    h: torch.Tensor  # [B,T,d]
    keys: torch.Tensor | None  # [B,T,n_kv,S,hd]; None when no slot is written yet
    values: torch.Tensor | None  # [B,T,n_kv,S,hd]
    valid: tuple[bool, ...] = ()  # per slot: False = masked out (skipped under rule "mask")

    @property
    def n_slots(self) -> int:
        return len(self.valid)


def moda_extra_params(cfg: ModelConfig) -> int:
    """kv_proj (d -> 2·n_kv·hd, no bias) on every MLP but the last."""
    return 2 * cfg.d_model * cfg.n_kv_heads * cfg.head_dim * (cfg.n_layer - 1)


def moda_options(cfg: ModelConfig) -> tuple[str, str]:
    """(norm placement, depth-RoPE mode), validated with a one-line error."""
    norm = cfg.options.get("moda_norm", "pre")
    depth_rope = cfg.options.get("moda_depth_rope", "none")
    if norm not in NORMS:
        raise DepthToolsError(f"option moda_norm={norm!r} is not valid; use one of {list(NORMS)}")
    if depth_rope not in DEPTH_ROPE:
        raise DepthToolsError(f"option moda_depth_rope={depth_rope!r} is not valid; use one of {list(DEPTH_ROPE)}")
    return norm, depth_rope


def append_slots(state: MoDAState, h, keys: list, values: list, valid: tuple[bool, ...]) -> MoDAState:
    """A new state with slots appended (keys/values: lists of [B,T,n_kv,hd])."""
    if not keys:
        return MoDAState(h, state.keys, state.values, state.valid)
    new_k = torch.stack(keys, dim=3)  # [B,T,n_kv,n_new,hd]
    new_v = torch.stack(values, dim=3)
    if state.keys is not None:
        new_k = torch.cat([state.keys, new_k], dim=3)
        new_v = torch.cat([state.values, new_v], dim=3)
    return MoDAState(h, new_k, new_v, state.valid + valid)


class MoDAScheme(ResidualScheme):
    """Standard residual stream whose attention also reads same-position depth K/V memories."""

    single_stream = True
    skip_rules = ("mask", "zero")

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.norm, self.depth_rope = moda_options(cfg)

    # -- construction -------------------------------------------------------------------------
    def build_block(self, block: nn.Module) -> None:
        cfg = self.cfg
        d, eps = cfg.d_model, cfg.norm_eps
        suffix = "_norm" if self.norm == "pre" else "_post_norm"  # names as in the norm family
        block.add_module("attn" + suffix, RMSNorm(d, eps))
        block.add_module("mlp" + suffix, RMSNorm(d, eps))
        if block.index < cfg.n_layer - 1:  # the last MLP's slot would never be read
            block.kv_proj = nn.Linear(d, 2 * cfg.n_kv_heads * cfg.head_dim, bias=False)
        block.hook_moda_depth_pattern = HookPoint()  # [B,H,T,S]
        block.hook_moda_k, block.hook_moda_v = HookPoint(), HookPoint()  # [B,T,n_kv,hd]

    # -- the depth-state contract -------------------------------------------------------------
    def embed_state(self, x0: torch.Tensor) -> MoDAState:
        return MoDAState(x0, None, None, ())

    def readout(self, state: MoDAState) -> torch.Tensor:
        return state.h

    def geometry(self, state: MoDAState) -> torch.Tensor:
        return state.h

    def writes_slots(self, position: int) -> bool:
        """Whether the block at `position` writes depth slots (all but the last position)."""
        return position < self.cfg.n_layer - 1

    def step(self, position, block, state: MoDAState, home, rope) -> MoDAState:
        cos, sin = rope
        pre = self.norm == "pre"
        h = block.hook_resid_pre(state.h)

        # attention sublayer: sequence keys + depth slots 0..S-1
        x = block.attn_norm(h) if pre else h
        attn = block.attn
        B, T, _ = x.shape
        q_raw = attn.hook_q(attn.w_q(x).view(B, T, attn.n_heads, attn.head_dim))  # [B,T,H,hd]
        k_raw = attn.hook_k(attn.w_k(x).view(B, T, attn.n_kv_heads, attn.head_dim))  # [B,T,Hkv,hd]
        v = attn.hook_v(attn.w_v(x).view(B, T, attn.n_kv_heads, attn.head_dim))
        q, k = apply_rope(q_raw, cos, sin), apply_rope(k_raw, cos, sin)
        if state.keys is None:
            z = attn.attend(q, k, v)  # block 0: plain causal attention
        else:
            q_depth = q_raw if self.depth_rope == "none" else q
            z = moda_attend(block, q, k, v, q_depth, state)
        y = block.hook_attn_out(attn.out(z))
        h = h + y if pre else block.attn_post_norm(h + y)
        h = block.hook_resid_mid(h)

        # MLP sublayer (+ its depth slot)
        x = block.mlp_norm(h) if pre else h
        keys, values = [], []
        if self.writes_slots(position):
            kv_proj = block.kv_proj if hasattr(block, "kv_proj") else home.kv_proj
            k_mlp, v_mlp = kv_proj(x).view(B, T, 2, attn.n_kv_heads, attn.head_dim).unbind(2)
            keys, values = [k_raw, block.hook_moda_k(k_mlp)], [v, block.hook_moda_v(v_mlp)]
        y = block.hook_mlp_out(block.mlp(x))
        h = h + y if pre else block.mlp_post_norm(h + y)
        h = block.hook_resid_post(h)
        return append_slots(state, h, keys, values, (True,) * len(keys))

    def skip(self, position: int, state: MoDAState, rule: str | None = None) -> MoDAState:
        """Identity on h; the position's slots are written as zeros ("zero") or masked ("mask")."""
        rule = self._check_rule(rule)
        if not self.writes_slots(position):
            return state
        B, T, _ = state.h.shape
        zero = state.h.new_zeros(B, T, self.cfg.n_kv_heads, self.cfg.head_dim)
        return append_slots(state, state.h, [zero, zero], [zero, zero], (rule == "zero",) * 2)


def moda_attend(block, q, k, v, q_depth, state: MoDAState) -> torch.Tensor:
    """One softmax over [causal sequence keys ; same-position depth keys]; returns z [B,T,H,hd].

    q [B,T,H,hd] and k, v [B,T,Hkv,hd] are the sequence part (rotated); q_depth [B,T,H,hd] is the
    query used against the depth keys. Never materialises T x T x S: sequence scores [B,H,T,T]
    and depth scores [B,H,T,S] are concatenated on the key axis for one softmax, then split.
    Cost: the depth part is a memory-bound batched mat-vec over S slots per position, and the
    immutable cache is re-concatenated per block (O(L²·B·T·d) traffic per pass); on CPU a training
    step is ~3x Pre-LN's at L=32, d=64 (benchmarks/moda_step_time.py). A shared copy-on-write
    slot buffer with a custom autograd Function is the next step if that matters.
    """
    attn = block.attn
    B, T, H, hd = q.shape
    Hkv, S = attn.n_kv_heads, state.n_slots
    groups = H // Hkv
    scale = hd**-0.5

    # sequence scores [B,H,T,T] (causal)
    qh = q.transpose(1, 2)  # [B,H,T,hd]
    kh = k.transpose(1, 2).repeat_interleave(groups, 1)  # [B,H,T,hd]
    vh = v.transpose(1, 2).repeat_interleave(groups, 1)
    seq_scores = (qh @ kh.transpose(-1, -2)) * scale
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    seq_scores = seq_scores.masked_fill(~causal, float("-inf"))

    # depth scores [B,H,T,S]: per position t, its query against its own S depth keys (a batched
    # mat-vec per (b,t,kv-head); measured a little faster in the full model than multiply+sum)
    qd = q_depth.reshape(B, T, Hkv, groups, hd)  # q head = kv head * groups + g (as GQA)
    depth_scores = (qd @ state.keys.transpose(-1, -2)) * scale  # [B,T,Hkv,g,S]
    depth_scores = depth_scores.reshape(B, T, H, S).transpose(1, 2)  # [B,H,T,S]
    if not all(state.valid):
        invalid = torch.tensor([not ok for ok in state.valid], device=q.device)
        depth_scores = depth_scores.masked_fill(invalid, float("-inf"))

    probs = torch.cat([seq_scores, depth_scores], dim=-1).softmax(-1)  # [B,H,T,T+S]
    seq_pattern, depth_pattern = probs.split([T, S], dim=-1)
    seq_pattern = attn.hook_pattern(seq_pattern)  # [B,H,T,T]
    depth_pattern = block.hook_moda_depth_pattern(depth_pattern)  # [B,H,T,S]

    z = (seq_pattern @ vh).transpose(1, 2)  # [B,T,H,hd]
    depth_p = depth_pattern.transpose(1, 2).reshape(B, T, Hkv, groups, S)
    z_depth = (depth_p @ state.values).reshape(B, T, H, hd)  # [B,T,Hkv,g,hd] -> [B,T,H,hd]
    return attn.hook_z(z + z_depth)


ARCH_SPECS = [
    ArchSpec(
        name="moda",
        family="cross-layer",
        description="MoDA: attention also reads same-position K/V of all earlier sublayers (depth KV cache)",
        extra_formula="2·d·n_kv·head_dim·(L−1)  (MHA: 2·d²·(L−1))",
        extra_params=moda_extra_params,
        paper="Zhu et al. 2026, Mixture-of-Depths Attention, arXiv 2603.15619",
        scheme=MoDAScheme,
        in_depthbench=True,
    ),
]
