"""MoDA — Mixture-of-Depths Attention (Zhu et al., arXiv 2603.15619), pure PyTorch.

The residual stream is standard (Pre-LN by default, Post-LN with ``options={"moda_norm": "post"}``).
What changes is attention: the query of head h at position t in block b attends, in ONE softmax
(scale 1/sqrt(head_dim)), to

    sequence keys   k_b[0..t]          (this layer's causal keys, RoPE as usual)
    depth keys      K_s[t], s < 2b     ("depth memories": K/V at the SAME position t written by
                                        every earlier sublayer)

    o_t = sum_j p_j v_b[j] + sum_s p_s V_s[t],   p = softmax([q·k_b[j] ; q_d·K_s[t]] / sqrt(hd))

Depth slots (DepthBench `MoDATransformerBlock`, docs/reference/architectures.md §3.5):
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
keys/values [B,T,n_kv,S,hd] (None while S = 0) and a per-slot validity tuple. States are immutable
from the caller's view, so cached states can be reused by sweeps. Storage (performance): the
keys/values of a run are (permuted) prefix views of ONE preallocated append-only buffer pair
[2(L-1), n_kv, hd, B, T]; a step writes its two slots past the end (never inside anyone's view),
so the per-step O(S) copy of an immutable concatenation (O(L^2) traffic and memory) is gone.
Appending to a state that is not the buffer's newest (a sweep branching from a cached state) or
to foreign tensors copies the prefix into a fresh buffer (copy-on-branch). See `_AppendSlots`.
Attention without pattern hooks is `_DepthAttention`: PyTorch's fused flash attention for the
sequence part, merged with the depth part through the log-sum-exp (no [B,H,T,T] tensor), the depth
part as the custom ops `depthtools::moda_forward` / `moda_backward` (arch/ops/moda.py: C kernels on CPU, their
torch-op twins elsewhere), and depth-slot gradients formed once per slot (`depthtools::moda_slot_grads`) from
what its readers' backwards recorded in the buffer's store. Option fused (True):
False uses neither (the plain-autograd `reference.append_slots` and `reference.depth_attention`).
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

import math
from types import MappingProxyType
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn
from transformer_lens.hook_points import HookPoint

from depthtools.arch import reference
from depthtools.arch.layers import BufferPool, RMSNorm, apply_rope
from depthtools.arch.ops import moda as moda_ops
from depthtools.arch.scheme import ArchSpec, NormSite, Option, ResidualScheme, profile_defaults
from depthtools.arch.torch_private import (
    cpu_flash_attention,
    cpu_flash_attention_backward,
    cpu_flash_attention_ok,
    is_hooked,
    set_tensor_tag,
    tensor_tag,
    untracked,
    view_base,
)

if TYPE_CHECKING:  # annotations only (depthtools.config imports nothing from arch/: no circle either way)
    from depthtools.config import ModelConfig

NORMS = ("pre", "post")
DEPTH_ROPE = ("none", "query")
KV_DTYPES = ("model", "bfloat16")


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
    """(norm placement, depth-RoPE mode), validated (one-line errors) with their defaults by the scheme's schema."""
    opts = MoDAScheme.options_for(cfg)
    return opts.moda_norm, opts.moda_depth_rope


# -- the append-only depth K/V buffer ----------------------------------------------------------
#
# Layout: slots first, tokens last: [cap, n_kv, hd, B, T]. A state's keys are the permuted prefix
# view buffer[:S].permute(3, 4, 1, 0, 2) = [B,T,n_kv,S,hd]. Tokens last because every depth
# operation is a per-token contraction over S or hd, which PyTorch's CPU kernels vectorise well
# along a long contiguous token axis (a batched matmul per token and head is dominated by its
# per-item overhead; measured in benchmarks/RESULTS.md).

_TO_VIEW = (3, 4, 1, 0, 2)  # [S,Hkv,hd,B,T] -> [B,T,Hkv,S,hd]
_TO_BUFFER = (3, 2, 4, 0, 1)  # [B,T,Hkv,S,hd] -> [S,Hkv,hd,B,T]


GROUP_SLOTS = 8  # slot gradients formed ahead, from the readers so far, for this many slots at a time (measured)


class _SlotStore:
    """Bookkeeping of one key/value buffer pair, attached to both buffers (`torch_private.set_tensor_tag`).

    fill: slots written so far (a state whose views end at `fill` is the buffer's newest and may
    append in place). records: what each attention backward that read this buffer left for its slots'
    gradients, (ds [S_r,Hkv,g,N], probs [S_r,Hkv,g,N], qs [Hkv,g,hd,N], dzt [Hkv,g,hd,N], S_r): its score
    gradients, probabilities, scaled depth query and output gradient (tokens last, N = B·T tokens), keyed
    by the reader (its autograd node) with a serial number.

    A slot's gradients are formed when the `_AppendSlots` backward that wrote the slot asks for them
    (`take`; autograd runs it after every reader) from all records at once, never read-modify-written per
    reader. Readers are read once per GROUP_SLOTS slots, not once per append: the first take in a group
    forms the whole group's gradients from the records so far (`partial`); a later take in the group adds
    only the records that came after.

    Several backward passes over one retained graph: a reader that runs again replaces its record (and
    voids a group formed from the old one), so a pass that stopped short of slot 0 (`torch.autograd.grad`
    to an intermediate tensor) leaves nothing that a later pass counts twice; a pass that has taken slot 0
    is complete and drops the records.
    """

    __slots__ = ("fill", "records", "pool", "tokens", "partial", "serial")

    def __init__(self, tokens: tuple[int, int], fill: int = 0, pool: BufferPool | None = None):
        self.tokens = tokens  # (B, T)
        self.fill = fill
        self.records: dict[int, tuple[int, tuple]] = {}  # reader key -> (serial, record)
        self.partial = None  # (lo, hi, {(key, serial)}, gK, gV): slots lo..hi-1 from those records
        self.serial = 0
        self.pool = BufferPool() if pool is None else pool  # the scheme's reusable buffers

    def record(self, reader: int, record: tuple) -> None:
        """Keep (or replace) reader's record for its slots' gradients."""
        self.serial += 1
        self.records[reader] = (self.serial, record)

    def take(self, start: int, stop: int):
        """Gradients (gK, gV) [n,B,T,Hkv,hd] of slots start..stop-1 (None, None if no reader read them)."""
        grads = self._grads(start, stop) if stop > start else (None, None)
        if start == 0:  # the pass is complete
            self.records, self.partial = {}, None
        return grads

    def _grads(self, start: int, stop: int):
        if stop - start >= GROUP_SLOTS:
            readers = [r for _, r in self.records.values() if r[4] > start]
            return _slot_grads(readers, start, stop, self.tokens) if readers else (None, None)
        p = self.partial
        if (p is None or not p[0] <= start < stop <= p[1]
                or any(self.records.get(key, (None,))[0] != serial for key, serial in p[2])):
            lo = max(0, stop - GROUP_SLOTS)
            used = {(key, serial): r for key, (serial, r) in self.records.items() if r[4] > lo}
            if not used:
                return None, None
            p = self.partial = (lo, stop, set(used), *_slot_grads(list(used.values()), lo, stop, self.tokens))
        lo, _, used, gk, gv = p
        grads = gk[start - lo : stop - lo], gv[start - lo : stop - lo]  # views: each slot is taken once
        later = [r for key, (serial, r) in self.records.items() if (key, serial) not in used and r[4] > start]
        return _slot_grads(later, start, stop, self.tokens, out=grads) if later else grads


def _slot_grads(records, start: int, stop: int, tokens: tuple[int, int], out=None):
    """(gK, gV) [stop-start,B,T,Hkv,hd] of slots start..stop-1 from reader records (ds, probs, qs, dzt, S_r) (see
    `_SlotStore`), added to out = (gK, gV) if given: `depthtools::moda_slot_grads`."""
    if out is None:
        Hkv, hd = records[0][2].shape[0], records[0][2].shape[2]
        gk, gv = (records[0][0].new_empty(stop - start, *tokens, Hkv, hd) for _ in range(2))
    else:
        gk, gv = out
    ds, probs, qs, dzt, reads = (list(column) for column in zip(*records))
    moda_ops.moda_slot_grads(ds, probs, qs, dzt, reads, start, stop, gk, gv, out is not None)
    return gk, gv


def _buffer_of(view: torch.Tensor | None):
    """(buffer, store) when `view` is the prefix view of a slot buffer (see _TO_VIEW), else None."""
    if view is None:
        return None
    base = view_base(view)
    store = tensor_tag(base) if base is not None else None
    if store is None or view.dim() != 5 or view.shape[3] > base.shape[0]:
        return None
    expect = base[: view.shape[3]].permute(*_TO_VIEW)
    if view.shape != expect.shape or view.stride() != expect.stride() or view.storage_offset() != base.storage_offset():
        return None
    return base, store


def _shared_store(keys, values):
    """(keys buffer, values buffer, store) for keys/values that are prefix views of one pair, else None."""
    k, v = _buffer_of(keys), _buffer_of(values)
    if k is None or v is None or k[1] is not v[1] or keys.shape != values.shape:
        return None
    return k[0], v[0], k[1]


def _slots_first(t: torch.Tensor) -> torch.Tensor:
    """[B,T,Hkv,S,hd] -> [S,Hkv,hd,B·T] (a view for buffer views, else a copy)."""
    t = t.permute(*_TO_BUFFER)
    S, Hkv, hd, B, T = t.shape
    return t.reshape(S, Hkv, hd, B * T)


class _RoundThrough(torch.autograd.Function):
    """x rounded to `dtype` and back (x's dtype); the gradient passes unchanged, as a cast's does. What a slot
    stored as `dtype` holds, for the reference path (fused=False) of option moda_kv_dtype."""

    @staticmethod
    def forward(ctx, x, dtype):
        return x.to(dtype).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _AppendSlots(torch.autograd.Function):
    """(keys, values) + new slots -> (keys', values'), logically a concatenation on the slot axis.

    In place when `keys`/`values` are the newest prefix of their buffer (the common case: a run
    appends block after block), else a fresh buffer of `capacity` slots gets a copy of the prefix
    (copy-on-branch; also for tensors that are not buffer views). In-place writes do not bump the
    version counter (`torch_private.untracked`), so views saved for backward elsewhere stay valid:
    the slots they cover never change. The outputs are prefix views of the buffer.

    Backward: the gradient of a new slot = what the fast-path attention backwards that read it
    recorded in the store (`_SlotStore.take`) + the slot's part of any ordinary gradient of the outputs
    (explicit attention path, or user code). The previous slots get the ordinary gradient's prefix,
    plus, if this append branched, the gradients the branch's readers recorded in the new buffer.
    """

    @staticmethod
    def forward(ctx, capacity: int, pool: BufferPool | None, kv_dtype: torch.dtype | None, keys, values, *new):
        ctx.set_materialize_grads(False)
        n = len(new) // 2
        S = 0 if keys is None else keys.shape[3]
        shared = _shared_store(keys, values)
        inplace = shared is not None and shared[2].fill == S and shared[0].shape[0] >= S + n
        if inplace:
            kbuf, vbuf, store = shared
        else:
            B, T, Hkv, hd = new[0].shape
            dtype = kv_dtype if kv_dtype is not None else keys.dtype if keys is not None else new[0].dtype
            store = _SlotStore((B, T), pool=pool)
            like = ((max(capacity, S + n), Hkv, hd, B, T), dtype, new[0].device)
            kbuf, vbuf = store.pool.take("keys", *like), store.pool.take("values", *like)
            set_tensor_tag(kbuf, store)
            set_tensor_tag(vbuf, store)
            if S:
                kbuf[:S].copy_(keys.permute(*_TO_BUFFER))
                vbuf[:S].copy_(values.permute(*_TO_BUFFER))
        kraw, vraw = untracked(kbuf), untracked(vbuf)  # no version-counter bump for views saved elsewhere
        for j in range(n):
            for raw, slot in ((kraw, new[2 * j]), (vraw, new[2 * j + 1])):
                moda_ops.moda_store_slot(slot, raw[S + j])  # (the C kernel on CPU: streaming stores)
        store.fill = S + n
        ctx.S, ctx.n, ctx.store, ctx.branched = S, n, store, not inplace
        return kbuf[: S + n].permute(*_TO_VIEW), vbuf[: S + n].permute(*_TO_VIEW)

    @staticmethod
    def backward(ctx, grad_keys, grad_values):
        S, n, store = ctx.S, ctx.n, ctx.store
        side_k, side_v = store.take(S, S + n)  # [n,B,T,Hkv,hd]
        slot_grads = []
        for j in range(n):
            for side, dense in ((side_k, grad_keys), (side_v, grad_values)):
                parts = [] if side is None else [side[j]]
                if dense is not None:
                    parts.append(dense[:, :, :, S + j])
                slot_grads.append(None if not parts else parts[0] if len(parts) == 1 else parts[0] + parts[1])
        prev = [None, None]
        if S:  # (S = 0: there were no previous keys/values)
            branch_k, branch_v = store.take(0, S) if ctx.branched else (None, None)  # [S,B,T,Hkv,hd]
            for i, (branch, dense) in enumerate(((branch_k, grad_keys), (branch_v, grad_values))):
                branch = None if branch is None else branch.permute(1, 2, 3, 0, 4)  # [B,T,Hkv,S,hd]
                g = None if dense is None else dense[:, :, :, :S]
                prev[i] = branch if g is None else g if branch is None else branch + g
        slot_grads = [g if need else None for g, need in zip(slot_grads, ctx.needs_input_grad[5:])]
        return (None, None, None, *prev, *slot_grads)


def append_slots(state: MoDAState, h, keys: list, values: list, valid: tuple[bool, ...],
                 capacity: int = 0, pool: BufferPool | None = None, fused: bool = True,
                 kv_dtype: torch.dtype | None = None) -> MoDAState:
    """A new state with slots appended (keys/values: lists of [B,T,n_kv,hd]); `state` is unchanged.
    fused=False: the plain concatenation (`reference.append_slots`) instead of `_AppendSlots`. kv_dtype:
    the slots are stored in this dtype (rounded once; fused=False rounds them and keeps the model's dtype)."""
    if not keys:
        return MoDAState(h, state.keys, state.values, state.valid)
    new = [t for pair in zip(keys, values) for t in pair]
    if fused:
        new_k, new_v = _AppendSlots.apply(capacity, pool, kv_dtype, state.keys, state.values, *new)
    else:
        if kv_dtype is not None:
            new = [_RoundThrough.apply(t, kv_dtype) for t in new]
        new_k, new_v = reference.append_slots(state.keys, state.values, new)
    return MoDAState(h, new_k, new_v, state.valid + valid)


class MoDAScheme(ResidualScheme):
    """Standard residual stream whose attention also reads same-position depth K/V memories."""

    compile_region = "none"  # measured: compiling its MLP core gains nothing (depthtools.arch.compiled)
    kernel_libraries = ("moda",)

    single_stream = True
    skip_rules = ("mask", "zero")
    # DepthBench's protocol: z_l is the residual stream; a skipped block's depth slots stay zero; its linear
    # replacement and Jacobian scripts take one tensor where a MoDA block passes (hidden, depth keys, depth values)
    depthbench_family, depthbench_skip_rule = "moda", "zero"
    depthbench_undefined = MappingProxyType({
        "usefulness_score": "its linear replacement returns one tensor where a MoDA block passes "
                            "(hidden, depth keys, depth values)",
        "jacobian": "its script differentiates the block's first input, which for MoDA is a (hidden, depth "
                    "keys, depth values) tuple",
    })

    def depthbench_block_output(self, state: MoDAState) -> torch.Tensor:
        """[B,T,d]: the residual stream (the depth K/V cache is not a depth state)."""
        return state.h

    @classmethod
    def option_schema(cls, arch: str) -> dict[str, Option]:
        """moda_norm ("pre" | "post") and moda_depth_rope ("none" | "query"), see the module docstring."""
        schema = {"moda_norm": Option("str", "pre", choices=NORMS), "moda_depth_rope": Option("str", "none", choices=DEPTH_ROPE)}
        schema["moda_kv_dtype"] = Option(
            "str", "model", choices=KV_DTYPES,
            doc="dtype of the stored depth K/V cache: 'model' (the model's own) or 'bfloat16' (half its memory traffic; "
                "a slot is rounded once when written and its gradient passes the rounding unchanged, as a cast's does)")
        schema["fused"] = Option("bool", True, doc="False: the plain-autograd references (reference.py)")
        return schema

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.norm, self.depth_rope = moda_options(cfg)
        self.fused = self.opts.fused  # False: the plain-autograd references throughout
        self.kv_dtype = torch.bfloat16 if self.opts.moda_kv_dtype == "bfloat16" else None  # None: the model's
        self.capacity = 2 * (cfg.n_layer - 1)  # slots of a full run: the preallocated buffer size
        self._slot_pool = BufferPool()  # slot and slot-gradient buffers, reused from step to step

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

    def written_tensor(self, state: MoDAState) -> torch.Tensor:
        """The residual stream h (the depth K/V is side state)."""
        return state.h

    def tl_limits(self) -> dict[str, str]:
        """h is a plain residual stream (the depth K/V is side state); Post-LN placement renormalises it."""
        if self.norm == "pre":
            return {}
        return {"sum": "moda with moda_norm='post' renormalises the stream after every residual add, so it is "
                       "not hook_embed + the sum of hook_attn_out/hook_mlp_out; use depthtools.analysis.contrib"}

    def tl_norm_site(self, block, sublayer: str):
        if self.norm != "pre":
            return f"moda with moda_norm='post' has no pre-norm before block {block.index}'s {sublayer} sublayer"
        return NormSite(f"blocks.{block.index}.hook_resid_{'pre' if sublayer == 'attn' else 'mid'}",
                        getattr(block, f"{sublayer}_norm"))

    def extra_flops(self) -> float:
        """kv_proj on every MLP input but the last ([d] @ [d, 2·n_kv·hd]), and the depth part of the
        joint softmax: block l's H query heads score and read its 2l slots, q·K_s and p_s V_s, 2·d each."""
        cfg = self.cfg
        L = cfg.n_layer
        kv_proj = 2 * cfg.d_model * 2 * cfg.n_kv_heads * cfg.head_dim * (L - 1)
        return float(kv_proj + sum(4 * cfg.d_model * 2 * position for position in range(L)))

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
            z = moda_attend(block, q, k, v, q_depth, state, self.fused)
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
        y = block.hook_mlp_out(block.mlp(x))  # x: the normed input kv_proj read (not normed twice)
        h = h + y if pre else block.mlp_post_norm(h + y)
        h = block.hook_resid_post(h)
        return append_slots(state, h, keys, values, (True,) * len(keys), self.capacity, self._slot_pool, self.fused,
                            self.kv_dtype)

    def skip(self, position: int, state: MoDAState, rule: str | None = None) -> MoDAState:
        """Identity on h; the position's slots are written as zeros ("zero") or masked ("mask")."""
        rule = self._check_rule(rule)
        if not self.writes_slots(position):
            return state
        B, T, _ = state.h.shape
        zero = state.h.new_zeros(B, T, self.cfg.n_kv_heads, self.cfg.head_dim)
        return append_slots(state, state.h, [zero, zero], [zero, zero], (rule == "zero",) * 2, self.capacity,
                            self._slot_pool, self.fused, self.kv_dtype)


def fused_kernel_for(device: torch.device) -> bool:
    """Whether `_DepthAttention` (built on PyTorch's private, CPU-only fused flash-attention op) may run on
    `device` (`torch_private.cpu_flash_attention_ok`). Every other device (CUDA, MPS, meta) takes the
    explicit joint softmax, which is plain device-generic PyTorch (it forms the [B,H,T,T] pattern, so it
    costs memory, never correctness)."""
    return cpu_flash_attention_ok(device)


def moda_attend(block, q, k, v, q_depth, state: MoDAState, fused: bool = True) -> torch.Tensor:
    """One softmax over [causal sequence keys ; same-position depth keys]; returns z [B,T,H,hd].

    q [B,T,H,hd] and k, v [B,T,Hkv,hd] are the sequence part (rotated); q_depth [B,T,H,hd] is the
    query used against the depth keys. On CPU without pattern hooks: `_DepthAttention` (PyTorch's fused
    CPU flash attention for the sequence part, merged with the depth part through log-sum-exp; no
    [B,H,T,T] tensor). With a hook on `attn.hook_pattern` or `hook_moda_depth_pattern`, on any other
    device (`fused_kernel_for`), or with fused=False: the same function formed explicitly
    (`reference.depth_attention`, both pattern parts hooked).
    """
    attn = block.attn
    H, Hkv = q.shape[2], attn.n_kv_heads
    invalid = None
    if not all(state.valid):
        invalid = torch.tensor([not ok for ok in state.valid], device=q.device)
    if H != Hkv:  # GQA: one K/V head per query head
        k, v = k.repeat_interleave(H // Hkv, 2), v.repeat_interleave(H // Hkv, 2)
    keys, values = state.keys, state.values
    # _DepthAttention merges in the flash op's float32 log-sum-exp: float32/float64 queries only (bf16 weights,
    # TrainConfig.param_dtype, take the explicit softmax, as on CUDA)
    explicit = not fused or q.dtype not in (torch.float32, torch.float64) or not fused_kernel_for(q.device)
    if explicit or is_hooked(attn.hook_pattern, block.hook_moda_depth_pattern):
        if keys.dtype != q.dtype:  # (bfloat16 slots: their gradients are rounded to bfloat16 on this path)
            keys, values = keys.to(q.dtype), values.to(q.dtype)
        return attn.hook_z(reference.depth_attention(q, k, v, q_depth, keys, values, invalid,
                                                     attn.hook_pattern, block.hook_moda_depth_pattern))
    z = _DepthAttention.apply(q, k, v, q_depth, keys, values, invalid)
    return attn.hook_z(z)


class _DepthAttention(torch.autograd.Function):
    """z [B,T,H,hd] = one softmax over the causal sequence keys and the S same-position depth keys.

    Forward: (o, lse) = fused flash attention over the sequence (its log-sum-exp per row); depth
    scores s = q_d·K_s/sqrt(hd); lse' = logaddexp(lse, logsumexp_s s); z = exp(lse - lse')·o +
    Σ_s exp(s - lse') V_s. Backward: the fused kernel's backward with the JOINT output and
    log-sum-exp gives the exact sequence-part gradients (its probabilities are exp(score - lse')
    and its row term is Σ dz·z); the depth part is dS = P ⊙ (dz·V - Σ dz·z), dq_d = Σ_s dS K_s / sqrt(hd).
    The depth part runs slots-first / tokens-last (see the buffer layout above) as the custom ops
    `depthtools::moda_forward` / `moda_backward` (arch/ops/moda.py: the C kernels on CPU, else their torch twins).
    Depth-slot gradients (dK_s = Σ dS q_d/sqrt(hd), dV_s = Σ P dz) are left as a record in the buffer's
    store when keys/values are buffer views, formed once per slot by its writer's backward (`_SlotStore`);
    else they are formed here and returned.

    Inputs: q, k, v [B,T,H,hd] (k, v already expanded to H heads), q_depth [B,T,H,hd], keys/values
    [B,T,Hkv,S,hd], invalid [S] bool or None (masked slots).
    """

    @staticmethod
    def forward(ctx, q, k, v, q_depth, keys, values, invalid):
        hd = q.shape[3]
        scale = 1.0 / math.sqrt(hd)
        qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B,H,T,hd] views
        out, lse_seq = cpu_flash_attention(qh, kh, vh, scale)  # [B,H,T,hd], [B,H,T] (token-major in memory)
        K, V = _slots_first(keys), _slots_first(values)  # [S,Hkv,hd,N]
        z, lse, probs, qs = moda_ops.moda_forward(K, V, q_depth, out.transpose(1, 2), lse_seq.transpose(1, 2),
                                                  invalid, scale)  # [B,T,H,hd], [B,T,H]
        # keys/values: views of the slot buffer, whose later appends go past them without a version bump;
        # saved (not kept on ctx) so that autograd frees them after backward and the buffer can be reused
        # (BufferPool), while a retained graph keeps them for another backward
        ctx.save_for_backward(qh, kh, vh, qs, z, lse, probs, keys, values, invalid)
        ctx.scale = scale
        return z

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dz):
        qh, kh, vh, qs, z, lse, probs, keys, values, invalid = ctx.saved_tensors
        scale = ctx.scale
        B, T = z.shape[:2]
        S = keys.shape[3]
        dz = dz.contiguous()
        need_q, need_k, need_v, need_qd, need_keys, need_values = ctx.needs_input_grad[:6]
        dq = dk = dv = None
        if need_q or need_k or need_v:
            dq, dk, dv = cpu_flash_attention_backward(dz.transpose(1, 2), qh, kh, vh, z.transpose(1, 2),
                                                      lse.transpose(1, 2), scale)
            dq, dk, dv = dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
        K, V = _slots_first(keys), _slots_first(values)
        dqd, ds, dzt = moda_ops.moda_backward(K, V, z, dz, probs, invalid, scale)
        dkeys = dvalues = None
        shared = _shared_store(keys, values) if (need_keys or need_values) else None
        record = (ds, probs, qs, dzt, S)
        if shared is not None:  # the writers' backwards form the slot gradients from all readers' records
            shared[2].record(id(ctx), record)  # ctx: this reader's node, the same in every pass over the graph
        elif need_keys or need_values:
            dkeys, dvalues = (t.permute(1, 2, 3, 0, 4) for t in _slot_grads([record], 0, S, (B, T)))  # [B,T,Hkv,S,hd]
        return dq, dk, dv, dqd if need_qd else None, dkeys, dvalues, None


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
        profiles={"depthbench": profile_defaults({"moda_depth_rope": "query"})},  # DepthBench: RoPE-rotated depth query
    ),
]
