"""Memory-light operations over a bank of same-shape source tensors (AttnRes, DenseFormer).

Cross-layer schemes mix a growing bank of n sources [B,T,d] at every step. Written naively
(`torch.stack` then `einsum`), autograd keeps each step's stacked copy for backward: O(L²·B·T·d)
activation memory, which at depth dominates the whole model. The two functions here compute the
same contractions source by source (no stacked copy is ever made — copying the bank at every
step costs more than the mixing itself) and save only *references* to the sources (alive anyway)
plus small [B,T,n] tensors. Each source gets its own gradient tensor: views into one [n,...]
gradient would keep it alive until every source's gradient is accumulated. First-order only.

    weighted_sum(w, sources)          = Σ_i w[..., i] · v_i              -> [B,T,d]
    bank_logits(q, sources, inv_rms)  = [ r_i · (v_i · q) ]_i            -> [B,T,n]

With r_i = 1/rms(v_i) and q = query ⊙ gamma, `bank_logits` is query · RMSNorm_gamma(v_i) — the
AttnRes key logits — without materialising the n normalised keys.

These two serve DenseFormer (static weights, ≤ L+1 sources) and AttnRes when its depth-attention
weights are hooked. AttnRes' training path is `DepthBank` (`bank_push` / `bank_mix`, second half
of this file): one append-only buffer per run, key dots precomputed at push time, and source
gradients formed lazily and in bulk — see the comment above `DepthBank`.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from depthtools.arch import cpu_kernels, torch_private
from depthtools.arch.layers import BufferPool, fused_inverse_rms, inverse_rms_derivative
from depthtools.arch.ops import bank as bank_ops


def inv_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """1/sqrt(mean(x²) + eps) over the last dimension: [B,T,d] -> [B,T] (what RMSNorm divides by)."""
    return x.pow(2).mean(-1).add(eps).rsqrt()


class _WeightedSum(torch.autograd.Function):
    """out = Σ_i w[..., i] v_i; w is [n] (one scalar per source) or [*lead, n] (per token)."""

    @staticmethod
    def forward(ctx, weights: torch.Tensor, *sources: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(weights, *sources)  # references, not copies
        w = _per_source(weights)
        out = sources[0] * w[0]
        for i in range(1, len(sources)):
            out.addcmul_(sources[i], w[i])
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        weights, *sources = ctx.saved_tensors
        grad_w = None
        if ctx.needs_input_grad[0]:  # d out / d w_i = <grad_out, v_i> (per token, or summed)
            if weights.dim() == 1:
                grad_w = torch.stack([torch.dot(grad_out.flatten(), v.flatten()) for v in sources])
            else:
                grad_w = torch.stack([torch.linalg.vecdot(grad_out, v) for v in sources], -1)
        w = _per_source(weights)
        grad_sources = tuple(grad_out * w[i] if ctx.needs_input_grad[1 + i] else None for i in range(len(sources)))
        return (grad_w, *grad_sources)


def _per_source(weights: torch.Tensor) -> list[torch.Tensor]:
    """Weight of each source, broadcastable against a source [*lead,d]: scalar, or [*lead,1]."""
    return list(weights.unbind(0)) if weights.dim() == 1 else list(weights.unsqueeze(-1).unbind(-2))


class _BankLogits(torch.autograd.Function):
    """logits[..., i] = r_i · (v_i · q) for sources v_i [*lead,d], scales r_i [*lead], q [d]."""

    @staticmethod
    def forward(ctx, query: torch.Tensor, n: int, *tensors: torch.Tensor) -> torch.Tensor:
        sources, scales = tensors[:n], tensors[n:]
        dots = torch.stack([v @ query for v in sources], -1)  # [*lead,n]
        ctx.n = n
        ctx.save_for_backward(query, dots, *tensors)  # dots is small: [*lead,n]
        return dots * torch.stack(scales, -1)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        query, dots, *tensors = ctx.saved_tensors
        n = ctx.n
        sources, scales = tensors[:n], tensors[n:]
        grad_dots = grad_out * torch.stack(scales, -1)  # [*lead,n]
        g = grad_dots.unbind(-1)
        acc = sources[0] * g[0].unsqueeze(-1)  # Σ_i g_i v_i per token, then summed: dL/dq
        for i in range(1, n):
            acc.addcmul_(sources[i], g[i].unsqueeze(-1))
        grad_q = acc.flatten(0, -2).sum(0)
        grad_sources = tuple(g[i].unsqueeze(-1) * query for i in range(n))  # separate tensors
        grad_scales = (grad_out * dots).unbind(-1)
        return (grad_q, None, *grad_sources, *grad_scales)


def weighted_sum(weights: torch.Tensor, sources: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Σ_i weights[..., i] · sources[i]; weights [n] or [B,T,n], sources n × [B,T,d] -> [B,T,d]."""
    return _WeightedSum.apply(weights, *sources)


def bank_logits(query: torch.Tensor, sources: tuple[torch.Tensor, ...], scales: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """[B,T,n] logits r_i · (v_i · query) for sources n × [B,T,d] and scales n × [B,T]."""
    return _BankLogits.apply(query, len(sources), *sources, *scales)


# -- the depth-attention bank (AttnRes fast path) ----------------------------------------------
#
# AttnRes mixes, at each of 2L sublayers, all n earlier sources: per step the work is O(n·B·T·d),
# O(L²·B·T·d) per pass, and on CPU at d = 64 it is memory traffic and per-source call overhead.
# `DepthBank` keeps the sources of one run in ONE append-only buffer and organises the
# arithmetic so that the O(L²) part is as few passes over that buffer as possible (slot-major
# [cap,N,d]: appends are contiguous, and CPU bmm reads a token's slots at a fixed stride well):
#
#   * key logits: logit_{m,i} = r_i · (v_i · q_m) with q_m = w_m ⊙ gamma_m. The dots v_i · q_m are
#     formed for ALL M mixers when v_i is pushed (one [N,d]x[d,M] GEMM), so a mix reads n stored
#     numbers per token instead of the n sources: O(L) instead of O(L²) (`_Push`).
#   * forward mix: h = Σ_i α_i v_i is one batched matmul over the buffer (`_Mix`).
#   * backward: a mix only records its output gradient g (and ρ = g·h). The gradient of source j
#     is formed in j's `_Push` backward, which autograd runs after every mix that read v_j (all of
#     them hold a later handle of the chain). There the recorded mixes are flushed: with K or more
#     pending, in bulk, for ALL sources ≤ j at once (two batched matmuls with K rows: one read of
#     the buffer, one read-modify-write of its gradient, shared by K mixes); else only for v_j.
#     dα_i = g·v_i, dlogit_i = α_i (dα_i - ρ) (softmax backward: ρ = Σ α g·v = g·h).
#
# Buffers (N = B·T tokens, cap slots, M mixers): values [cap,N,d], inverse RMS [cap,N], dots
# [cap,M,N]; gradient accumulators of the same shapes. A bank is append-only: a run that branches
# from a cached state that is not the bank's newest (a sweep) re-pushes that state's sources into
# a fresh bank (copy-on-branch), so every state stays valid and immutable from the caller's view.
#
#   * forward mix, two-phase (AttnRes paper §5, "two-phase computation"): the queries are
#     parameters, so the mixes of a group of G mixers over the sources that exist when the first
#     of them runs can be formed together, in ONE batched matmul that reads each source once for
#     all G: P_m = Σ_{i<n0} exp(l_{m,i} - μ_m) v_i, μ_m = max_{i<n0} l_{m,i} (`prefix_mix`).
#     Mixer m's mix over n ≥ n0 sources is then exact by the log-sum-exp merge
#     h = exp(μ_m - lse) P_m + Σ_{n0≤i<n} α_i v_i, lse = log Σ_{i<n} exp(l_{m,i}).
#     The groups are fixed by the scheme from the intact model (`MixGroups`: G consecutive mixers
#     of the intact order, n0 = the sources its first one reads), never by a run's history, so a
#     mix gives bit-identical results whatever ran before it (a run from a cached state equals the
#     full run exactly; sweeps rely on that). A mix outside its group's range (a swapped plan) takes
#     the one-mix path.
#
# The three O(L²) loops -- a mix's logits, softmax and weighted sum, a group's two-phase prefix, and a flush --
# are the custom ops `depthtools::bank_mix_forward`, `bank_prefix`, `bank_flush` (arch/ops/bank.py): on CPU
# (float32/float64) C kernels (library "bank": one pass over each tile of tokens, four sources or mixes per
# read-modify-write), elsewhere their torch-op twins; the op chooses, the bank never does. Their autograd is
# `_Push` / `_Mix` below (the deferred, bulk source gradients), not registered on the ops. Slot j's key dots are
# formed at push time only for the columns its intact readers use (`column_floor`; the scheme numbers columns
# in sublayer order); a mix with a lower column forms the ones it lacks (`ensure_dots`).
#
# First-order only; the mixes' weights are not hookable here (the scheme uses the per-source
# functions above when a weights hook is attached).

FLUSH_AT = 12  # pending mixes that trigger a bulk flush (tuned with the C kernels: RESULTS.md, "Fourth pass")
TWO_PHASE_FROM = 6  # mixes over fewer banked sources are not grouped (tuned: RESULTS.md)
TWO_PHASE_GROUP = 16  # mixers per group, their prefixes formed in one pass over the sources (tuned: RESULTS.md)
GROUPS_KEPT = 2  # computed groups a bank keeps (a lens readout and the next step share one)


class MixGroups:
    """The two-phase groups of a model: mixer column -> (group id, row in the group), and per group
    its columns and n0, built from the intact model's mixes as (column, banked sources) in order."""

    def __init__(self, intact_mixes: list[tuple[int, int]]):
        grouped = [(col, n) for col, n in intact_mixes if n >= TWO_PHASE_FROM]
        groups = [grouped[i : i + TWO_PHASE_GROUP] for i in range(0, len(grouped), TWO_PHASE_GROUP)]
        self.columns = [[col for col, _ in g] for g in groups]
        self.n0 = [g[0][1] for g in groups]
        self.of = {col: (gid, row) for gid, cols in enumerate(self.columns) for row, col in enumerate(cols)}


class _MixRecord:
    """A mix that read sources 0..n-1 of a bank: what the sources' gradients need from it."""

    __slots__ = ("col", "n", "weights", "grad", "rho", "flushed_to")

    def __init__(self, col: int, n: int, weights: torch.Tensor):
        self.col, self.n, self.weights = col, n, weights  # weights [n, N] (tokens last)
        self.grad = self.rho = None  # [N,d], [N] once its backward ran
        self.flushed_to = n  # sources >= flushed_to already hold this mix's contribution


class DepthBank:
    """One run's sources v_0..v_{fill-1} in append-only buffers (see the section comment)."""

    def __init__(self, first: torch.Tensor, queries: torch.Tensor, capacity: int, eps: float, fingerprint,
                 groups: MixGroups | None = None, pool: BufferPool | None = None, column_floor: int = 0):
        N, d = first.numel() // first.shape[-1], first.shape[-1]
        M = queries.shape[0]
        self.shape, self.eps, self.fingerprint = first.shape, eps, fingerprint
        self.groups = groups  # two-phase groups (None: every mix on its own)
        # slot j's key dots are formed at push time for columns >= max(0, j * column_floor - 1) only: in the
        # scheme's sublayer-ordered columns (S = column_floor sublayers per source) the intact model's mixers
        # that read slot j; a mix with a lower column (a swapped plan) forms the dots it lacks (`ensure_dots`)
        self.column_floor = column_floor
        self.pool = BufferPool() if pool is None else pool  # the scheme's reusable gradient buffers
        self.prefix: dict[int, tuple] = {}  # group id -> (μ [G,N], P [N,G,d]), the newest GROUPS_KEPT
        self.queries = queries  # [M,d]: w_m ⊙ gamma_m of every mixer (part of the graph)
        self.values = first.new_empty(capacity, N, d)
        self.inv_rms = first.new_empty(capacity, N)
        self.dots = first.new_empty(capacity, M, N)
        self.fill = 0
        self.records: list[_MixRecord] = []
        self.grad_values = self.grad_dots = self.grad_inv_rms = None
        self.pass_id = None  # the backward pass whose gradients the records and accumulators hold

    def enter_pass(self, record: _MixRecord | None = None) -> None:
        """Forget a previous backward pass's deferred gradients when a new pass reaches this bank.

        A pass over a retained graph that does not reach slot 0 (a gradient with respect to a later
        source, as in a Jacobian) never runs the cleanup in `source_grad`; without this, the next pass
        would add the old pass's mix gradients to its own (wrong input gradients, measured 3e-2)."""
        task = torch_private.backward_pass_id()
        stale = (task != self.pass_id) if task is not None else (record is not None and record.grad is not None)
        if stale:
            self.end_pass()
        self.pass_id = task

    def end_pass(self) -> None:
        """Drop every mix's recorded gradient and the accumulators (a pass is complete or abandoned)."""
        for rec in self.records:
            rec.grad = rec.rho = None
            rec.flushed_to = rec.n
        self.grad_values = self.grad_dots = self.grad_inv_rms = None

    @property
    def kernel(self) -> bool:
        """Whether the bank ops take their C kernels for this bank's buffers (informational: the ops decide,
        by `cpu_kernels.bank_usable`)."""
        return cpu_kernels.bank_usable(self.values)

    @property
    def capacity(self) -> int:
        return self.values.shape[0]

    def prefix_mix(self, col: int, n: int):
        """(n0, μ [N], P [N,d]): mixer `col`'s unnormalised mix over the first n0 ≤ n sources (see the
        section comment), or None when `col` is in no group or n lies outside its group's range."""
        where = None if self.groups is None else self.groups.of.get(col)
        if where is None:
            return None
        gid, row = where
        n0 = self.groups.n0[gid]
        if not n0 <= n < n0 + TWO_PHASE_GROUP:
            return None
        if gid not in self.prefix:
            self.prefix[gid] = self._group_prefix(n0, self.groups.columns[gid])
            while len(self.prefix) > GROUPS_KEPT:
                del self.prefix[next(iter(self.prefix))]
        mu, P = self.prefix[gid]
        return n0, mu[row], P[:, row]

    def _group_prefix(self, n0: int, cols: list[int]):
        """(μ [G,N], P [N,G,d]) of the mixers `cols` over the first n0 sources (see the section comment)."""
        for c in cols:
            self.ensure_dots(c, n0)
        return bank_ops.bank_prefix(self.values, self.inv_rms, self.dots, n0, cols)

    def dots_from(self, j: int) -> int:
        """The lowest column whose key dots slot j got at push time (see `column_floor`)."""
        return max(0, j * self.column_floor - 1)

    def ensure_dots(self, col: int, n: int) -> None:
        """Form the key dots of column `col` for the slots below n that did not get them at push time."""
        if not self.column_floor:
            return
        first = (col + 1) // self.column_floor + 1  # the lowest slot with dots_from(slot) > col
        if first < n:
            q = self.queries[col].detach().to(self.values.dtype)
            self.dots[first:n, col] = self.values[first:n] @ q

    def _grads(self):
        """The gradient accumulators, zeroed (the scheme's buffers from the last backward pass when
        nothing holds them any more: `BufferPool`)."""
        if self.grad_values is None:
            dtype, device = self.values.dtype, self.values.device
            self.grad_values = self.pool.take("grad_values", self.values.shape, dtype, device).zero_()
            self.grad_dots = self.pool.take("grad_dots", self.dots.shape, dtype, device).zero_()
            self.grad_inv_rms = self.pool.take("grad_inv_rms", self.inv_rms.shape, dtype, device).zero_()
        return self.grad_values, self.grad_dots, self.grad_inv_rms

    def flush(self, j: int) -> None:
        """Add every pending mix's contribution to source j (and, in bulk, to all sources < j)."""
        pending = [r for r in self.records if r.grad is not None and r.flushed_to > j]
        if not pending:
            return
        gv, gdots, ginv = self._grads()
        lo = j if len(pending) < FLUSH_AT else 0  # only source j, or in bulk: sources 0..j at once
        bank_ops.bank_flush(self.values, self.inv_rms, self.dots, lo, j + 1, [r.grad for r in pending],
                            [r.weights for r in pending], [r.rho for r in pending], [r.col for r in pending],
                            gv, gdots, ginv)
        for rec in pending:
            rec.flushed_to = lo

    def source_grad(self, j: int, v: torch.Tensor):
        """(dL/dv_j [N,d], dL/dqueries [M,d]) once every mix that read v_j has been flushed."""
        self.enter_pass()
        self.flush(j)
        if self.grad_values is None:
            return None, None
        gv, gdots, ginv = self.grad_values[j], self.grad_dots[j], self.grad_inv_rms[j]
        vf = v.reshape(-1, v.shape[-1]).to(gv.dtype)
        r = self.inv_rms[j]
        # only the columns of mixes that read v_j have dot gradients: from the lowest on (the scheme numbers
        # columns in sublayer order, so in the intact model that is a suffix, about half the columns)
        lo = min((rec.col for rec in self.records if rec.n > j and rec.grad is not None), default=len(gdots))
        queries = self.queries.to(gv.dtype)
        grad = torch.addmm(gv, gdots[lo:].t(), queries[lo:])  # through the dots v · q_m
        grad.addcmul_(vf, inverse_rms_derivative(ginv, r, vf.shape[-1]).unsqueeze(1))  # through r = 1/rms(v)
        grad_q = queries.new_zeros(queries.shape)  # [M,d]
        torch.mm(gdots[lo:], vf, out=grad_q[lo:])
        if j == 0:  # the backward pass is complete: forget the mixes' gradients
            self.end_pass()
        return grad, grad_q


class _Push(torch.autograd.Function):
    """Append source v [B,T,d] to a bank (slot j): returns the new handle (an empty tensor whose
    autograd node orders the bank's backward; see the section comment)."""

    @staticmethod
    def forward(ctx, handle, v, queries, bank: DepthBank):
        j = bank.fill
        vf = v.reshape(-1, v.shape[-1])
        bank.values[j] = vf
        fused_inverse_rms(vf, bank.eps, out=bank.inv_rms[j])
        lo = bank.dots_from(j)
        torch.mm(queries[lo:].to(vf.dtype), vf.t(), out=bank.dots[j, lo:])  # [M-lo,N]
        bank.fill = j + 1
        ctx.bank, ctx.j = bank, j
        ctx.save_for_backward(v)
        return v.new_empty(0)

    @staticmethod
    @once_differentiable
    def backward(ctx, _):
        (v,) = ctx.saved_tensors
        grad, grad_q = ctx.bank.source_grad(ctx.j, v)
        if grad is not None:
            grad = grad.view(v.shape).to(v.dtype)
        return None, grad, grad_q, None


def bank_push(bank: DepthBank, handle, v: torch.Tensor):
    """Append v to `bank` (must be the bank's newest state) and return the new handle."""
    if bank.fill >= bank.capacity:
        raise RuntimeError("depth bank is full")  # capacity is sized from the model; a bug if hit
    return _Push.apply(handle, v, bank.queries, bank)


class _Mix(torch.autograd.Function):
    """h = Σ_{i<n} α_i v_i (+ α_p p) with α = softmax over the sources of logit_i = r_i (v_i·q_m)
    (+ the partial source p's own logit); the banked sources' gradients are deferred to the bank."""

    @staticmethod
    def forward(ctx, handle, queries, partial, bank: DepthBank, n: int, col: int):
        N = bank.values.shape[1]
        q = queries[col].to(bank.values.dtype)
        pf = p_logit = None
        if partial is not None:
            pf = partial.reshape(N, -1).to(bank.values.dtype).contiguous()
            p_dot = pf @ q  # [N]
            p_inv = fused_inverse_rms(pf, bank.eps)
            p_logit = p_dot * p_inv
        bank.ensure_dots(col, n)
        n0, mu, P = bank.prefix_mix(col, n) or (0, None, None)
        h, alpha = bank_ops.bank_mix_forward(bank.values, bank.inv_rms, bank.dots, n, col, pf, p_logit, n0, mu, P)
        if partial is not None:
            ctx.save_for_backward(pf, p_dot, p_inv, q)
            ctx.partial_shape, ctx.partial_dtype = partial.shape, partial.dtype
        ctx.bank, ctx.n, ctx.col, ctx.has_partial = bank, n, col, partial is not None
        ctx.shape, ctx.q_dtype = queries.shape, queries.dtype
        ctx.record = None
        if any(ctx.needs_input_grad):  # (False when run without gradients)
            ctx.record = _MixRecord(col, n, alpha[:n])
            bank.records.append(ctx.record)
        ctx.alpha, ctx.h = alpha, h
        return h.view(*bank.shape[:-1], h.shape[-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        g = grad.reshape(ctx.h.shape).to(ctx.h.dtype).contiguous()
        rho = torch.linalg.vecdot(g, ctx.h)  # [N] = Σ_i α_i g·v_i
        ctx.bank.enter_pass(ctx.record)
        if ctx.record is not None:
            ctx.record.grad, ctx.record.rho = g, rho
        grad_partial = grad_q = None
        if ctx.has_partial:
            pf, p_dot, p_inv, q = ctx.saved_tensors
            a_p = ctx.alpha[ctx.n]
            dl = (torch.linalg.vecdot(g, pf) - rho) * a_p  # d logit_p
            gp = g * a_p.unsqueeze(1)
            gp.addmm_(dl.mul(p_inv).unsqueeze(1), q.unsqueeze(0))  # through p·q
            gp.addcmul_(pf, inverse_rms_derivative(dl * p_dot, p_inv, pf.shape[-1]).unsqueeze(1))  # through r_p
            grad_partial = gp.view(ctx.partial_shape).to(ctx.partial_dtype)
            if ctx.needs_input_grad[1]:
                grad_q = q.new_zeros(ctx.shape)
                grad_q[ctx.col] = (dl * p_inv) @ pf
                grad_q = grad_q.to(ctx.q_dtype)
        return None, grad_q, grad_partial, None, None, None


def bank_mix(bank: DepthBank, handle, n: int, col: int, partial: torch.Tensor | None) -> torch.Tensor:
    """Depth attention of mixer column `col` over the first n banked sources (+ a partial source)."""
    return _Mix.apply(handle, bank.queries, partial, bank, n, col)
