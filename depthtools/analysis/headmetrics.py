"""The head fused with its metrics, over vocabulary chunks: no [rows, V] log-probs per depth or plan.

A probe that decodes rows x [n, d] with the model's head (logits = softcap(unembed(x))) and keeps only
per-row metrics — the lens at every depth, each sweep plan — needs no [n, V] log-probs. `row_metrics`
computes the logits `chunk` vocabulary columns and `ROW_TILE` rows at a time and keeps, per row and chunk,
the chunk's log-sum-exp ℓ_c (from its fused log-softmax) and sums under the chunk's softmax q_c, combined
in float64 with the chunks' weights w_c = exp(ℓ_c − lse):

    lse        log Σ_c exp ℓ_c
    ce         lse − z_target
    entropy    lse − Σ_c w_c Σ q_c z
    kl_ref     KL(p_ref || p) = Σ p_ref log p_ref − Σ p_ref z + lse   (Σ p_ref z = x · (p_ref W) + p_ref · b
               without a soft-cap: one product per reference; with one, per chunk)
    kl_rev     KL(p || p_ref) = −entropy − Σ_c w_c Σ q_c log p_ref
    top        the k largest logits' ids (block maxima, then a top-k over the best blocks; merged over chunks)
    rank       1 + #{v : lp_v > lp_target} under a full float32 log-softmax, as every saved rank counted it

Precision: a chunk's logits are in the model's dtype and are widened to float32 (float64 stays float64);
row sums within a chunk are a product and torch's cascade sum in float32, across chunks float64; Σ p_ref log
p_ref is float64. Against a float64 log-softmax the metrics agree to float32 rounding, and against the full
float32 path within 3.2e-7 at a 49k vocabulary (tests/test_headmetrics.py; benchmarks/RESULTS.md, issue 45).

Rank: the count of logits above the target's (its logit taken from a [n, n] GEMM of the same rows, which
rounds as the chunk's); a row with another logit within a few ulps of the target's log-prob — where the
float32 log-softmax can round both to one value — or whose target logit rounded otherwise is re-ranked on a
full row (`_tie_rows`, `_full_ranks`).

The reference distribution (`Reference`: the intact model for a sweep, the final output for the lens) is
computed once per batch with a full float32 log-softmax; only the rows compared against it stream.
`chunked_head` picks, per probe, this head or whole logit rows (faster on CPU while they fit).

Whole rows (`fused_metrics`, the bottom of this file): when a probe's float32 logit block fits, the same
RowMetrics come from the C kernel csrc/rowmetrics.c on CPU -- per row, one pass for the maximum, the block
maxima (top ids), the rank count and the nearest logit above the target, one for S0 = Σ e, S1 = Σ e (z − m),
S2 = Σ e log p_ref, S3 = Σ p_ref (z − m), S4 = Σ p_ref log p_ref and S5 = Σ p_ref with e = exp(z − m) --
instead of a log-softmax and ~5-10 torch passes over [rows, V] (the logit lens at L30/V49k, idle: 9.7 vs 28.3
forward equivalents, benchmarks/RESULTS.md "Fused row metrics"; 8.0 with the logits decoded into one reused block,
`LogitsBuffer`). Rows whose top ids or rank a float32 log-softmax could decide otherwise (logits within
TIE_ULPS ulps) take those from torch's own log-softmax of the row; rows with a non-finite logit take the
whole full path, so both are the full path's exactly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from depthtools.arch import cpu_kernels

CHUNK = 8192  # vocabulary columns per logit block
# A probe's head path by default: full [rows, V] float32 log-probs while one such block is at most this many
# bytes (fewer, longer passes: faster on CPU, benchmarks/RESULTS.md issue 45), the chunked head above it.
# DEPTHTOOLS_FULL_HEAD_BYTES overrides it (0: always chunked; the same-run benchmarks use it).
FULL_HEAD_BYTES = int(os.environ.get("DEPTHTOOLS_FULL_HEAD_BYTES", 2**29))
ROW_TILE = 256  # rows per logit block: a [256, 8192] float32 block is 8 MiB


def chunked_head(model, rows: int, choice: bool | None = None) -> "Head | None":
    """The head a probe decodes `rows` rows at a time with: the chunked `Head` (choice True; None: when a
    float32 [rows, V] block would exceed FULL_HEAD_BYTES), or None for the full log-softmax (choice False,
    or a model without an nn.Linear unembedding)."""
    if choice is False or not isinstance(getattr(model, "unembed", None), torch.nn.Linear):
        return None
    if choice is None and rows * model.unembed.weight.shape[0] * 4 <= FULL_HEAD_BYTES:
        return None
    return Head.of(model)


# Decode a probe's plans and depths into one reused block of memory (`LogitsBuffer`); False: a fresh tensor per
# call (what benchmarks/bench_logits_buffer.py compares against).
REUSE_LOGITS = True


class LogitsBuffer:
    """One block of CPU memory that a probe decodes its [rows, V] logits into, call after call.

    A fresh [1016, 49152] float32 result (200 MB) per sweep plan or lens depth is larger than glibc's mmap
    threshold, so it comes as new pages that the kernel faults in and zeroes every time and unmaps on free:
    ~60 ms of system time per head evaluation at the SmolLM-135M shape, a quarter of its cost
    (benchmarks/bench_logits_buffer.py). The logits returned alias the buffer: each decode overwrites the
    previous one, so a caller consumes them before decoding again (the sweep's and the lens' loops do).
    `DepthModel.hidden_logits` writes into it only where that gives its own numbers bit for bit; elsewhere
    (a streamed or hooked head, a bias, another device) it returns a fresh tensor as before."""

    def __init__(self) -> None:
        self._flat: torch.Tensor | None = None

    def decode(self, model, x: torch.Tensor) -> torch.Tensor:
        """`model.hidden_logits(x)` [..., V], in this buffer where it may be."""
        unembed = getattr(model, "unembed", None)
        if not REUSE_LOGITS or x.device.type != "cpu" or not isinstance(unembed, torch.nn.Linear) or \
                torch.is_grad_enabled():  # the probes decode under no_grad; autograd needs fresh outputs
            return model.hidden_logits(x)
        shape = (*x.shape[:-1], unembed.out_features)
        n = x.shape[:-1].numel() * unembed.out_features
        if self._flat is None or self._flat.numel() < n or self._flat.dtype != x.dtype:
            self._flat = None  # the old block is freed before the new one is taken
            self._flat = torch.empty(n, dtype=x.dtype)
        return model.hidden_logits(x, out=self._flat[:n].view(shape))


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise Σ a·b of two [n, c] blocks (in the wider dtype), as float64 [n]. A product then torch's
    cascade sum: a batched BLAS dot accumulates one long float32 chain, biased by ~2e-7 over 8k terms."""
    dtype = torch.promote_types(a.dtype, b.dtype)
    return torch.mul(a.to(dtype), b.to(dtype)).sum(1, dtype=torch.float64 if dtype == torch.float64 else None).double()


def _widen(z: torch.Tensor) -> torch.Tensor:
    """Logits in float32 at least (a bfloat16/float16 model's are widened before any sum)."""
    return z.to(torch.promote_types(z.dtype, torch.float32))


@dataclass(frozen=True)
class Head:
    """The model's unembedding as the chunked head reads it: logits = softcap(x Wᵀ + b)."""

    weight: torch.Tensor  # [V, d]
    bias: torch.Tensor | None  # [V]
    cap: float  # final soft-cap (0: off)

    @classmethod
    def of(cls, model) -> "Head":
        """The head of a DepthModel (`model.hidden_logits`: softcap(unembed(x)))."""
        unembed = model.unembed
        return cls(unembed.weight, unembed.bias, float(getattr(model.backbone, "final_softcap", 0.0) or 0.0))

    @property
    def vocab(self) -> int:
        return self.weight.shape[0]

    def logits(self, x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """[n, hi−lo] logits (float32, or float64 for a float64 model) of rows x [n, d], ids lo..hi−1."""
        bias = None if self.bias is None else self.bias[lo:hi]
        return _widen(self._cap(F.linear(x, self.weight[lo:hi], bias)))

    def target_logits(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """[n] logit of each row's target, computed as a [n, n] GEMM like a chunk's (its diagonal)."""
        bias = None if self.bias is None else self.bias[targets]
        return _widen(self._cap(F.linear(x, self.weight[targets], bias))).diagonal()

    def ref_logit_mean(self, x: torch.Tensor, ref: "Reference") -> torch.Tensor:
        """[n] float64 Σ_v p_ref,v z_v for uncapped logits z = x Wᵀ + b, as x · (p_ref W) + p_ref · b:
        a [n, V] × [V, d] product instead of a pass over every chunk (float64 from float32 products)."""
        u = ref.p_weight if ref.p_weight is not None else ref.p @ self.weight.to(ref.p.dtype)
        x = x.to(u.dtype) if x.dtype != u.dtype else x
        out = (x.double() * u.double()).sum(1)
        return out if self.bias is None else out + (ref.p.double() @ self.bias.double())

    def _cap(self, z: torch.Tensor) -> torch.Tensor:
        return z if not self.cap else torch.tanh(z / self.cap) * self.cap


def _plogp(p: torch.Tensor, logp: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """[n] float64 Σ_v p_v log p_v, in float64 (KL = Σ p log p − Σ p z + lse cancels down to the KL), over
    vocabulary chunks so no float64 [n, V] copy is made."""
    out = torch.zeros(p.shape[0], dtype=torch.float64, device=p.device)
    for lo in range(0, p.shape[1], chunk):
        out += (p[:, lo:lo + chunk].double() * logp[:, lo:lo + chunk].double()).sum(1)
    return out


@dataclass(frozen=True)
class Reference:
    """The distribution the rows are compared with, on the same rows: float32 log-probs, their
    probabilities, Σ p log p (float64) and the top-k ids (computed once per batch, a full log-softmax)."""

    logp: torch.Tensor  # [n, V] float32
    p: torch.Tensor  # [n, V]
    plogp: torch.Tensor | None  # [n] float64: Σ_v p_v log p_v (None: not computed; `fused_metrics` sums its own)
    top: torch.Tensor  # [n, k]
    p_weight: torch.Tensor | None = None  # [n, d] p Wᵀ... = Σ_v p_v W_v, for `Head.ref_logit_mean`

    @classmethod
    def of(cls, logp: torch.Tensor, k: int = 1, head: Head | None = None, p: torch.Tensor | None = None,
           top: torch.Tensor | None = None, sums: bool = True) -> "Reference":
        """The reference of float32 log-probs [n, V] (p = exp(logp) and its top ids when already computed);
        with `head`, also Σ_v p_v W_v (once, shared by every depth or plan compared against it). sums=False
        leaves Σ p log p out (the fused path sums it with each row's other sums)."""
        p = logp.exp() if p is None else p
        plogp = _plogp(p, logp) if sums else None
        if top is None:
            top = logp.topk(min(k, logp.shape[-1]), dim=-1).indices if k > 1 else logp.argmax(-1, keepdim=True)
        p_weight = None if head is None or head.cap else p @ head.weight.to(p.dtype)
        return cls(logp, p, plogp, top, p_weight)

    def rows(self, sl: slice | torch.Tensor) -> "Reference":
        """The same on rows `sl` (a slice, or row indices)."""
        def part(t):
            return None if t is None else t[sl]
        return Reference(self.logp[sl], self.p[sl], part(self.plogp), self.top[sl], part(self.p_weight))


@dataclass(frozen=True)
class RowMetrics:
    """Per-row metrics of a head evaluation (float64 unless noted; see the module docstring)."""

    lse: torch.Tensor
    ce: torch.Tensor
    entropy: torch.Tensor
    kl_ref: torch.Tensor | None  # KL(p_ref || p), with a reference
    kl_rev: torch.Tensor | None  # KL(p || p_ref), with a reference and reverse=True
    top: torch.Tensor  # [n, k] int64 ids, largest first
    rank: torch.Tensor | None  # [n] int64 (1 = top), with rank=True

    @staticmethod
    def cat(parts: list["RowMetrics"]) -> "RowMetrics":
        def join(name):
            values = [getattr(p, name) for p in parts]
            return None if values[0] is None else torch.cat(values)
        return RowMetrics(*(join(name) for name in RowMetrics.__dataclass_fields__))


BLOCK = 128  # columns per block maximum: the top-k candidates are in the k blocks with the largest maxima


def _chunk_top(z: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ids) of the k largest logits of each row of z [n, c], largest first: through the
    block maxima (one cheap pass) and a top-k over the k best blocks' columns (exact: each of the k
    largest values lies in a block whose maximum is at least it)."""
    n, c = z.shape
    if c % BLOCK or c // BLOCK <= k:
        return z.topk(k, dim=1)
    blocks = z.view(n, c // BLOCK, BLOCK)
    best = blocks.amax(2).topk(k, dim=1).indices.sort(dim=1).values  # [n, k] block ids, in column order
    cand = blocks.gather(1, best.unsqueeze(2).expand(n, k, BLOCK)).reshape(n, k * BLOCK)
    cols = (best.unsqueeze(2) * BLOCK + torch.arange(BLOCK, device=z.device)).reshape(n, k * BLOCK)
    v, i = cand.topk(k, dim=1)
    return v, cols.gather(1, i)


class _Online:
    """The per-row partial results of one row tile over the vocabulary chunks (combined in `finish`)."""

    def __init__(self, n: int, k: int, device, ref: "Reference | None", reverse: bool, linear_ref: bool):
        self.k, self.ref, self.reverse, self.linear_ref = k, ref, reverse, linear_ref
        self.lse, self.pz, self.plf = [], [], []  # per chunk: lse_c, Σ q z, Σ q log p_ref (q: the chunk softmax)
        self.refz = torch.zeros(n, dtype=torch.float64, device=device)  # Σ p_ref z (per chunk, if not linear)
        self.top_v = torch.full((n, k), -torch.inf, dtype=torch.float32, device=device)
        self.top_i = torch.zeros((n, k), dtype=torch.long, device=device)
        self.target = torch.zeros(n, dtype=torch.float64, device=device)
        self.above = torch.zeros(n, dtype=torch.long, device=device)
        self.gap = torch.full((n,), torch.inf, dtype=torch.float64, device=device)

    def add(self, z: torch.Tensor, lo: int, targets: torch.Tensor, est: torch.Tensor | None) -> None:
        """Fold in one logit block z [n, c] (float32) of vocabulary ids lo..lo+c−1."""
        hi = lo + z.shape[1]
        v, i = _chunk_top(z, self.k)
        lp = F.log_softmax(z, dim=1)  # the chunk's own log-softmax: one fused pass, lp = z − ℓ (ℓ rounded)
        ell = v[:, 0].double() - lp.gather(1, i[:, :1]).squeeze(1).double()
        q = lp.exp()
        mass = q.sum(1).double()  # Σ q = 1 up to ℓ's rounding: the chunk's softmax is q / mass
        self.lse.append(ell + mass.log())
        self.pz.append(ell + _dot(q, lp) / mass)  # Σ q z / mass = ℓ + Σ q lp / mass
        if self.reverse:
            self.plf.append(_dot(q, self.ref.logp[:, lo:hi]) / mass)
        if self.ref is not None and not self.linear_ref:
            self.refz += _dot(self.ref.p[:, lo:hi], z)
        del lp, q
        vals, pos = torch.cat([self.top_v, v], 1).topk(self.k, dim=1)  # earlier chunks first
        self.top_v, self.top_i = vals, torch.cat([self.top_i, i + lo], 1).gather(1, pos)
        inside = ((targets >= lo) & (targets < hi)).nonzero().squeeze(1)
        if inside.numel():
            self.target[inside] = z[inside, targets[inside] - lo].double()
        if est is not None:  # count z > z_target, and the smallest |z − z_target| of another id (`_tie_rows`)
            d = torch.sub(z, est.unsqueeze(1))
            self.above += (d > 0).sum(1)
            if inside.numel():
                d[inside, targets[inside] - lo] = torch.inf
            self.gap = torch.minimum(self.gap, d.abs_().amin(1).double())

    def finish(self, refz: torch.Tensor | None) -> tuple:
        """(lse, Σ p z, Σ p log p_ref or None, Σ p_ref z or None) of whole rows, float64."""
        lse_c = torch.stack(self.lse, 1)  # [n, chunks]
        lse = torch.logsumexp(lse_c, 1)
        w = (lse_c - lse.unsqueeze(1)).exp()  # each chunk's share of the probability
        pz = (w * torch.stack(self.pz, 1)).sum(1)
        plf = (w * torch.stack(self.plf, 1)).sum(1) if self.reverse else None
        if self.ref is None:
            return lse, pz, plf, None
        return lse, pz, plf, refz if self.linear_ref else self.refz


MIN_GEMM_ROWS = 16  # fewer rows take another BLAS path, whose logits can round otherwise


def _tie_rows(state: "_Online", est: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Rows whose rank a full float32 log-softmax could count otherwise: another logit within a few float32
    ulps of log-prob of the target's (there lp = z − max − log Σ rounds two logits to one value, so
    `lp > lp_target` — the definition every saved rank used — does not count it), or a target logit that
    a [n, n] GEMM rounded differently from the chunk's."""
    eps = torch.finfo(state.top_v.dtype).eps  # of the logits: float32 (widened low precision) or float64
    m = state.top_v[:, 0].double()
    scale = (state.target - m).abs() + (lse - m).abs() + (lse - state.target).abs()
    close = state.gap <= 8 * eps * scale + 1e-30
    return (close | (state.target != est.double())).nonzero().squeeze(1)


def _full_ranks(head: Head, x: torch.Tensor, targets: torch.Tensor, rows: torch.Tensor, chunk: int) -> torch.Tensor:
    """1 + #{v : lp_v > lp_target} from a full float32 log-softmax of `rows` (a few; padded to MIN_GEMM_ROWS
    rows of the tile so their logits are the ones a whole-batch head computes, bit for bit)."""
    pad = [r for r in range(x.shape[0]) if r not in set(rows.tolist())][:max(0, MIN_GEMM_ROWS - rows.numel())]
    take = torch.cat([rows, torch.tensor(pad, dtype=rows.dtype, device=rows.device)])
    z = torch.cat([head.logits(x[take], lo, min(lo + chunk, head.vocab)) for lo in range(0, head.vocab, chunk)], 1)
    lp = F.log_softmax(z[:rows.numel()], dim=-1)
    target_lp = lp.gather(1, targets[rows].unsqueeze(1))
    return (lp > target_lp).sum(1) + 1


def _tile_metrics(head: Head, x: torch.Tensor, targets: torch.Tensor, ref: Reference | None, k: int,
                  rank: bool, reverse: bool, chunk: int) -> RowMetrics:
    """`row_metrics` on one row tile."""
    linear_ref = ref is not None and not head.cap  # Σ_v p_ref,v z_v = x · (p_ref W) + p_ref · b
    state = _Online(x.shape[0], min(k, head.vocab), x.device, ref, reverse and ref is not None, linear_ref)
    est = head.target_logits(x, targets) if rank else None
    for lo in range(0, head.vocab, chunk):
        state.add(head.logits(x, lo, min(lo + chunk, head.vocab)), lo, targets, est)
    refz = head.ref_logit_mean(x, ref) if linear_ref else None
    lse, pz, plf, refz = state.finish(refz)
    entropy = lse - pz
    kl_ref = None if ref is None else ref.plogp - refz + lse
    kl_rev = None if plf is None else -entropy - plf
    ranks = None
    if rank:
        ranks = state.above + 1
        redo = _tie_rows(state, est, lse)
        if redo.numel():
            ranks[redo] = _full_ranks(head, x, targets, redo, chunk)
    return RowMetrics(lse, lse - state.target.double(), entropy, kl_ref, kl_rev, state.top_i, ranks)


@torch.no_grad()
def row_metrics(head: Head, x: torch.Tensor, targets: torch.Tensor, ref: Reference | None = None, k: int = 1,
                rank: bool = False, reverse: bool = False, chunk: int | None = None) -> RowMetrics:
    """Per-row metrics of the head on rows x [n, d] with targets [n] (see the module docstring), computed
    over vocabulary chunks of `chunk` columns and row tiles of ROW_TILE rows: never an [n, V] block.
    `ref` (on the same rows) adds kl_ref (and kl_rev with reverse=True); k top ids; rank=True the rank.
    chunk: vocabulary columns per block (default CHUNK, read at the call)."""
    chunk = CHUNK if chunk is None else chunk
    parts = []
    for lo in range(0, x.shape[0], ROW_TILE):
        sl = slice(lo, lo + ROW_TILE)
        parts.append(_tile_metrics(head, x[sl], targets[sl], None if ref is None else ref.rows(sl), k, rank,
                                   reverse, chunk))
    return RowMetrics.cat(parts)


# -- the fused path: the metrics of whole logit rows in two passes (C kernel "rowmetrics") ----------------------------

# DEPTHTOOLS_FUSED_METRICS=0 turns the fused path off (the full log-softmax instead): same-run A/B benchmarks use it
FUSED = os.environ.get("DEPTHTOOLS_FUSED_METRICS", "1") != "0"
_ROW_METRICS = cpu_kernels.Kernel(
    "rowmetrics", "row_metrics", "z n_rows rows_per_group group_stride row_stride V targets ref_logp ref_p k threads "
    "row_max target_z sums top_vals top_ids above gap", generic=False)
_COUNT_GREATER = cpu_kernels.Kernel("rowmetrics", "count_greater", "lp n_rows V targets threads out", generic=False)
TOP_MAX = 9  # TOPMAX in csrc/rowmetrics.c: k + 1 top logits at most (one past the k asked for, to see a tie)
TIE_ULPS = 1.25  # logits closer than this many float32 ulps (of z − m plus of lp) may share a log-prob


def fused_usable(z: torch.Tensor, k: int = 1) -> bool:
    """Whether `fused_metrics` takes logits z and k top ids (float32 CPU rows, k + 1 <= TOP_MAX, kernel built;
    FUSED on)."""
    return FUSED and k + 1 <= TOP_MAX and cpu_kernels.rowmetrics_usable(z)


def _kernel_sums(z: torch.Tensor, targets: torch.Tensor, ref: "Reference | None", k: int) -> dict:
    """The kernel's per-row outputs on logits z ([n, V], or [B, T', V] rows in order) with k top logits."""
    V = z.shape[-1]
    rows_per_group, group_stride = (z.shape[0], 0) if z.dim() == 2 else (z.shape[1], z.stride(0))
    n = targets.numel()
    out = {"row_max": z.new_empty(n), "target_z": z.new_empty(n), "sums": torch.empty(n, 6, dtype=torch.float64),
           "top_vals": z.new_empty(n, k), "top_ids": torch.empty(n, k, dtype=torch.long),
           "above": torch.empty(n, dtype=torch.long), "gap": z.new_empty(n)}
    ref_p = None if ref is None else ref.p.contiguous()
    ref_logp = None if ref is None else ref.logp.contiguous()
    status = _ROW_METRICS(None, z, n, rows_per_group, group_stride, z.stride(-2), V, targets.contiguous(),
                          ref_logp, ref_p, k, torch.get_num_threads(), *out.values())
    if status:
        raise MemoryError("row-metrics CPU kernel: out of memory")
    return out


def _near(gap: torch.Tensor, value: torch.Tensor, m: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Rows where a logit `gap` above `value` may share its float32 log-prob: lp = fl(fl(z − m) − log S) rounds
    twice, at the magnitudes of z − m and of lp (the same log S for both: its own rounding moves both alike), so
    two logits collapse only when less than an ulp of each magnitude apart (an ulp of x is at most eps·|x|; the
    25% margin covers a magnitude on the other side of a power of two than torch's)."""
    eps = torch.finfo(torch.float32).eps
    scale = (value - m).abs() + (lse - value).abs()
    return gap.double() <= TIE_ULPS * eps * scale + 1e-30


def _torch_rows(z: torch.Tensor, targets: torch.Tensor, ref: "Reference | None", k: int) -> tuple:
    """(ce, kl_ref, kl_rev, entropy, top ids, rank) of rows z [r, V] through torch's float32 log-softmax, the
    sums as the full path (lens `_DepthSums.add`, sweep `_Sums.add`) computes them (float64 out)."""
    lp = F.log_softmax(z, dim=-1)
    p = lp.exp()
    target_lp = lp.gather(-1, targets.unsqueeze(-1))
    kl_ref = kl_rev = None
    if ref is not None:
        kl_ref = (ref.p * (ref.logp - lp)).sum(-1).double()
        kl_rev = (p * (lp - ref.logp)).sum(-1).double()
    return (-target_lp.squeeze(-1).double(), kl_ref, kl_rev, -(p * lp).sum(-1).double(), _torch_top(lp, k),
            (lp > target_lp).sum(-1) + 1)


def _torch_top(lp: torch.Tensor, k: int) -> torch.Tensor:
    """The k top ids of log-probs lp as the full path takes them (argmax for one: the first among equals)."""
    return lp.topk(k, dim=-1).indices if k > 1 else lp.argmax(-1, keepdim=True)


def _count_greater(lp: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[r] #{v : lp_v > lp_target} of contiguous float32 log-prob rows lp [r, V] (the C kernel's count)."""
    out = torch.empty(lp.shape[0], dtype=torch.long)
    _COUNT_GREATER(None, lp, lp.shape[0], lp.shape[1], targets.contiguous(), torch.get_num_threads(), out)
    return out


def _take_rows(z: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows `rows` of z ([n, V], or [B, T', V] with rows in order) as an [r, V] tensor (no copy of the rest)."""
    return z[rows] if z.dim() == 2 else z[rows // z.shape[1], rows % z.shape[1]]


@torch.no_grad()
def fused_metrics(z: torch.Tensor, targets: torch.Tensor, ref: Reference | None = None, k: int = 1,
                  rank: bool = False, reverse: bool = False) -> RowMetrics:
    """Per-row metrics (`RowMetrics`: lse, ce, entropy, kl_ref, kl_rev with reverse=True, k top ids, rank) of
    whole logit rows z ([n, V], or [B, T', V] whose rows are taken in order; float32 CPU, `fused_usable`) against
    targets [n] and an optional reference on the same rows (rank=True: the target's rank too), from the C
    kernel's two passes per row (csrc/rowmetrics.c): float64 combinations of float32 block sums, within float32 rounding of the full
    float32 log-softmax path. Rows where that path's float32 log-probs could order the top ids or count the rank
    otherwise (logits within TIE_ULPS ulps of each other), or with a non-finite logit, are recomputed by that
    path itself (`_torch_rows`), so the top ids and ranks are the full path's exactly."""
    K = min(k + 1, z.shape[-1])
    out = _kernel_sums(z, targets, ref, K)
    S = out["sums"]
    m, zt, log_s0 = out["row_max"].double(), out["target_z"].double(), S[:, 0].log()
    lse = m + log_s0
    mean_rel = S[:, 1] / S[:, 0]  # Σ p (z − m)
    entropy = log_s0 - mean_rel
    kl_ref = None if ref is None else S[:, 4] - S[:, 3] + log_s0 * S[:, 5]  # Σ p_ref log p_ref − Σ p_ref lp
    kl_rev = None if ref is None or not reverse else mean_rel - log_s0 - S[:, 2] / S[:, 0]
    top, vals, ranks = out["top_ids"][:, :k].clone(), out["top_vals"].double(), out["above"] + 1
    bad = ~(torch.isfinite(S).all(1) & torch.isfinite(m))  # a NaN or infinite logit (csrc/rowmetrics.c)
    rank_tie = _near(out["gap"], zt, m, lse) & ~bad if rank else torch.zeros_like(bad)
    top_tie = torch.zeros_like(bad)
    for j in range(K - 1):
        top_tie |= _near(vals[:, j] - vals[:, j + 1], vals[:, j + 1], m, lse)
    top_tie &= ~bad
    rows = (rank_tie | top_tie).nonzero().squeeze(1)
    if rows.numel():  # near ties: the top ids and rank from the full path's own log-probs of these rows
        lp = F.log_softmax(_take_rows(z, rows), dim=-1)  # bit for bit the whole block's rows
        at = top_tie[rows].nonzero().squeeze(1)
        top[rows[at]] = _torch_top(lp[at], k)
        at = rank_tie[rows].nonzero().squeeze(1)
        ranks[rows[at]] = _count_greater(lp[at].contiguous(), targets[rows[at]]) + 1
    ce = lse - zt
    rows = bad.nonzero().squeeze(1)
    if rows.numel():
        sub = None if ref is None else ref.rows(rows)
        r_ce, r_kl, r_rev, r_ent, r_top, r_rank = _torch_rows(_take_rows(z, rows), targets[rows], sub, k)
        ce[rows], entropy[rows], top[rows], ranks[rows] = r_ce, r_ent, r_top, r_rank
        lse[rows] = torch.logsumexp(_take_rows(z, rows).double(), -1)
        if kl_ref is not None:
            kl_ref[rows] = r_kl
        if kl_rev is not None:
            kl_rev[rows] = r_rev
    return RowMetrics(lse, ce, entropy, kl_ref, kl_rev, top, ranks if rank else None)
