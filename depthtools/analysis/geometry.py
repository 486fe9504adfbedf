"""Similarity and geometry of the depth states z_0..z_L (docs/reference/metrics.md §3), on the contract only.

Every statistic is computed on `model.geometry(z_l)` ([B,T,k]: the residual stream, HC's
concatenated streams, AttnRes' next-consumer mix, ...), streamed over token batches with float64
accumulators, so no activations are held beyond one batch (docs/design.md §7):

* angular distance d(i,j) = mean_t arccos(cos(z_i, z_j))/π for all pairs (and the adjacent diagonal);
* minibatch linear CKA (Nguyen et al. 2021) for all (L+1)² pairs in one matmul per minibatch, via
  `similarity.CKAAccumulator`: debiased (the default estimate), biased (plug-in, for comparison)
  and outlier-controlled (features z-scored per minibatch, docs/reference/metrics.md §3.3);
* effective rank (Roy & Vetterli) and participation ratio per depth, from a streamed float64
  covariance (exactly `similarity.effective_rank` / `participation_ratio` of all rows), also with
  the top-`outlier_k` massive dimensions removed; while the rows are no more than the width k, from
  the kept rows' n×n Gram matrix instead (`_Moments`: less memory than k×k, the same spectrum);
* DepthBench token collapse per depth (`similarity.token_collapse`, per sequence, uncentred).

Position 0 (BOS / attention sink) and optionally the first k positions are excluded
(`exclude_first`, docs/reference/metrics.md §0). Summaries: mean adjacent CKA, CKA block fraction (longest run of
depths with all pairwise CKA > 0.9, over L) and N_rep = (L+1)²/Σ C_ij².

Token sets follow `depthtools.analysis.tokens`: [N, T+1] windows of which the model reads the
first T. Also home to the helpers the analyses of this package share: `tidy_frame` (the long
table schema), `model_inputs`, `check_positions`.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

import pandas as pd
import torch

from depthtools.analysis.similarity import (
    CKAAccumulator,
    adjacent_cka,
    angular_distance_matrix,
    block_fraction,
    n_rep,
    token_collapse,
)
from depthtools.analysis.sweep import intact_states
from depthtools.analysis.tables import model_columns
from depthtools.analysis.tokens import batches, check_tokens, split_inputs, token_fingerprint
from depthtools.errors import DepthToolsError

F64 = torch.float64
CKA_VARIANTS = {  # name -> CKAAccumulator settings
    "debiased": dict(debiased=True),
    "biased": dict(debiased=False),
    "zscore": dict(debiased=True, outlier_mode="zscore"),
}
COLUMNS = ["model", "arch", "n_layer", "d_model", "metric", "unit", "layer", "layer_j", "rel_depth", "rel_depth_j", "value"]


# -- shared helpers ---------------------------------------------------------------------------

def _rel(layer, unit: str, n_layer: int) -> float:
    """Relative depth: depth state i -> i/L; block b (0-based) -> (b+1)/L; sublayer s -> (s+1)/(2L)."""
    if layer is None or (isinstance(layer, float) and math.isnan(layer)):
        return math.nan
    if unit == "state":
        return layer / n_layer
    if unit == "block":
        return (layer + 1) / n_layer
    if unit == "sublayer":
        return (layer + 1) / (2 * n_layer)
    if unit == "sublayer_depth":
        return layer / (2 * n_layer)
    return math.nan


def tidy_frame(model, rows: Iterable[dict[str, Any]], settings: dict[str, Any] | None = None,
               notes: Sequence[str] = ()) -> pd.DataFrame:
    """A tidy table (docs/design.md §6): one row per model × layer(s) × metric.

    Columns: model (cell name), arch, n_layer, d_model, metric, unit, layer, layer_j (the second
    index of a pair metric, else empty), rel_depth / rel_depth_j, value, plus any extra keys the
    rows carry. Units: "state" = depth index 0..L (rel i/L); "block" = block index 0..L-1 (rel
    (b+1)/L); "sublayer" = 0..2L-1; "sublayer_depth" = sublayers completed, 0..2L (rel c/2L);
    "model" = a one-number summary (layer empty). `settings` and `notes` go to `df.attrs`.
    """
    info = model_columns(model)
    L = info["n_layer"]
    out = []
    for row in rows:
        unit = row.get("unit", "model")
        layer, layer_j = row.get("layer"), row.get("layer_j")
        out.append({
            **info, "unit": unit, "layer": layer, "layer_j": layer_j,
            "rel_depth": _rel(layer, unit, L), "rel_depth_j": _rel(layer_j, unit, L), **row,
        })
    df = pd.DataFrame(out)
    if df.empty:
        df = pd.DataFrame(columns=COLUMNS)
    extra = [c for c in df.columns if c not in COLUMNS]
    df = df[COLUMNS + extra]
    for col in ("layer", "layer_j"):
        df[col] = df[col].astype("Int64")
    df["value"] = df["value"].astype(float)
    df.attrs["settings"] = dict(settings or {})
    df.attrs["notes"] = list(notes)
    return df


def model_inputs(model, tokens: torch.Tensor) -> torch.Tensor:
    """The model inputs [N,T] of a token set [N,T+1] (`tokens.check_tokens`, then drop the last column)."""
    return split_inputs(check_tokens(model, tokens))[0]


def check_positions(tokens: torch.Tensor, exclude_first: int, need: int = 1) -> None:
    """At least `need` positions must remain after excluding the first `exclude_first` (inputs [N,T])."""
    if exclude_first < 0:
        raise DepthToolsError(f"exclude_first must be >= 0, got {exclude_first}")
    if tokens.shape[1] - exclude_first < need:
        raise DepthToolsError(
            f"sequence length {tokens.shape[1]} leaves fewer than {need} position(s) after excluding "
            f"the first {exclude_first}; use longer sequences or a smaller --exclude-first"
        )


def geometry_states(model, tokens: torch.Tensor) -> list[torch.Tensor]:
    """geometry(z_l) for l = 0..L, each [B,T,k] float32 (one forward, no plan; shared within
    `sweep.shared_sweeps`)."""
    return [model.geometry(s).float() for s in intact_states(model, tokens)]


# -- spectral statistics from a streamed covariance ----------------------------------------------

GRAM_SPECTRA = True  # keep the rows while n <= k (tests set it False to force the k x k path)


class _Moments:
    """Streaming float64 moments of rows [n,k] (for erank / PR of all rows), in whichever form is smaller.

    While the total rows n <= k the rows themselves are kept (a list of [n_i,k] float64 blocks: no more
    memory than one k x k matrix, and at a 3072-wide state streamed on a few tokens ~100x less, issue 45)
    and the spectrum is that of their n x n Gram matrix; the first time n would exceed k they are folded
    into s2 = XᵀX [k,k] and dropped, and s2 accumulates from then on. s1 (column sums) and abs1 (column
    |x| sums, which pick the outlier dims) are kept either way."""

    def __init__(self, k: int, keep_rows: bool | None = None):
        self.k, self.n = k, 0
        self.s1 = torch.zeros(k, dtype=F64)
        self.abs1 = torch.zeros(k, dtype=F64)
        keep = GRAM_SPECTRA if keep_rows is None else keep_rows
        self.rows: list[torch.Tensor] | None = [] if keep else None  # None once in the s2 form
        self.s2: torch.Tensor | None = None if keep else torch.zeros(k, k, dtype=F64)

    def update(self, X: torch.Tensor) -> None:
        """Add rows X [n_i,k] (any float dtype; accumulated in float64)."""
        X = X.detach().to(F64, copy=True)  # a copy even when X is float64: the rows may be kept
        self.n += X.shape[0]
        self.s1 += X.sum(0)
        self.abs1 += X.abs().sum(0)
        if self.rows is not None and self.n <= self.k:
            self.rows.append(X)
            return
        self.fold()
        self.s2 += X.T @ X

    def fold(self) -> None:
        """Switch to the k x k form: s2 = XᵀX of the kept rows, which are dropped (a no-op once switched)."""
        if self.rows is None:
            return
        self.s2 = torch.zeros(self.k, self.k, dtype=F64)
        for X in self.rows:
            self.s2 += X.T @ X
        self.rows = None

    def _kept(self, drop_top: int) -> torch.Tensor | None:
        """The columns kept without the top-`drop_top` |mean| dims (by abs1; None: all of them)."""
        if drop_top <= 0:
            return None
        keep = torch.ones(self.k, dtype=torch.bool)
        keep[self.abs1.topk(min(drop_top, self.k - 1)).indices] = False
        return keep

    def spectrum(self, drop_top: int = 0) -> torch.Tensor:
        """Eigenvalues (>= 0) of the centred scatter matrix, optionally without the top-|mean| dims.

        k x k form: eigvalsh of s2 − s1 s1ᵀ/n (k values). Rows form: eigvalsh of the n x n Gram Xc Xcᵀ of
        the centred rows (n values): the same nonzero eigenvalues, without the k − n zeros, which change
        neither `spectral_stats` (a zero σ adds 0 to the entropy, 0 to both PR sums)."""
        keep = self._kept(drop_top)
        if self.rows is None:
            scatter = self.s2 - torch.outer(self.s1, self.s1) / self.n
            if keep is not None:
                scatter = scatter[keep][:, keep]
            return torch.linalg.eigvalsh(scatter).clamp_min(0.0)
        if self.n == 0:
            return torch.zeros(self.k, dtype=F64)
        Xc = torch.cat(self.rows) - self.s1 / self.n
        if keep is not None:
            Xc = Xc[:, keep]
        return torch.linalg.eigvalsh(Xc @ Xc.T).clamp_min(0.0)


def spectral_stats(eigenvalues: torch.Tensor) -> tuple[float, float]:
    """(effective rank, participation ratio) from covariance eigenvalues λ (σ ∝ √λ)."""
    sigma = eigenvalues.sqrt()
    if float(sigma.sum()) <= 0:
        return math.nan, math.nan
    p = sigma / sigma.sum()
    logp = torch.where(p > 0, p.log(), torch.zeros_like(p))
    erank = float(torch.exp(-(p * logp).sum()))
    pr = float(eigenvalues.sum().square() / eigenvalues.square().sum())
    return erank, pr


# -- the analysis --------------------------------------------------------------------------------

class SimilarityStats:
    """The float64 sums `depth_similarity` accumulates over batches of geometry states (angular distances,
    moments for the spectra, token collapse, CKA minibatches), one `add` per batch. A class of its own so
    the cost plan can time `add` on a slice of one batch (`cost.similarity_seconds`): at a 576-wide state
    these statistics cost more than the forward pass that produces them."""

    def __init__(self, n_layer: int, cka_batch: int, variants: Sequence[str], seed: int = 0,
                 keep_rows: bool | None = None):
        self.cka_batch, self.keep_rows = cka_batch, keep_rows  # keep_rows: `_Moments`' (None: GRAM_SPECTRA)
        self.gen = torch.Generator().manual_seed(seed)
        self.accs = {v: CKAAccumulator(n_layer + 1, **CKA_VARIANTS[v]) for v in variants}
        self.angular_sum = torch.zeros(n_layer + 1, n_layer + 1, dtype=F64)
        self.moments: list[_Moments] | None = None
        self.collapse_sum = torch.zeros(n_layer + 1, 4, dtype=F64)
        self.n_tokens = self.n_seqs = 0

    def add(self, states: list[torch.Tensor]) -> None:
        """Accumulate one batch: L+1 geometry states [B,T',k] of the measured positions."""
        B, T, k = states[0].shape
        rows = [s.reshape(B * T, k) for s in states]  # L+1 x [n,k]
        n = rows[0].shape[0]
        self.angular_sum += angular_distance_matrix(rows) * n
        if self.moments is None:
            self.moments = [_Moments(k, self.keep_rows) for _ in range(len(states))]
        for depth, (m, s) in enumerate(zip(self.moments, states)):
            m.update(rows[depth])
            tc = token_collapse(s)
            self.collapse_sum[depth] += B * torch.stack([tc.stable_rank, tc.effective_rank, tc.l1_over_l2,
                                                         tc.mean_cosine])
        order = torch.randperm(n, generator=self.gen)
        for start in range(0, n, self.cka_batch):
            idx = order[start : start + self.cka_batch]
            if len(idx) < 8:
                continue
            chunk = [r[idx] for r in rows]
            for acc in self.accs.values():
                acc.update(chunk)
        self.n_tokens += n
        self.n_seqs += B


@torch.no_grad()
def depth_similarity(
    model,
    tokens: torch.Tensor,
    batch_size: int = 8,
    exclude_first: int = 1,
    cka_batch: int = 256,
    outlier_k: int = 1,
    block_threshold: float = 0.9,
    variants: Sequence[str] = tuple(CKA_VARIANTS),
    seed: int = 0,
) -> pd.DataFrame:
    """Angular distance, CKA (debiased / biased / zscore), effective rank, PR and token collapse.

    tokens: a token set [N,T+1] (the model reads the first T); positions < `exclude_first` are
    dropped from every statistic. CKA minibatches:
    each model batch's rows (B·(T−exclude_first) tokens) are shuffled with a seeded generator and
    cut into chunks of `cka_batch` tokens (chunks under 8 tokens are dropped). Returns a tidy table
    (`tidy_frame`) with pair rows (unit "state", layer/layer_j), per-depth rows and model summaries
    (cka_block_fraction_<v>, n_rep_<v>, adjacent_cka_mean_<v>, adjacent_angular_distance_mean).
    """
    inputs = model_inputs(model, tokens)
    check_positions(inputs, exclude_first, need=2)
    unknown = [v for v in variants if v not in CKA_VARIANTS]
    if unknown:
        raise DepthToolsError(f"unknown CKA variant(s) {unknown}; valid: {list(CKA_VARIANTS)}")
    if cka_batch < 8:
        raise DepthToolsError(f"cka_batch must be >= 8 tokens, got {cka_batch}")
    model.eval()
    L = model.n_layer
    stats = SimilarityStats(L, cka_batch, variants, seed)
    for batch in batches(inputs, batch_size):
        stats.add([g[:, exclude_first:] for g in geometry_states(model, batch)])  # L+1 x [B,T',k]
    accs, moments, collapse_sum = stats.accs, stats.moments, stats.collapse_sum
    n_tokens, n_seqs, angular_sum = stats.n_tokens, stats.n_seqs, stats.angular_sum
    out: list[dict[str, Any]] = []
    A = angular_sum / n_tokens
    for i in range(L + 1):
        for j in range(L + 1):
            out.append({"metric": "angular_distance", "unit": "state", "layer": i, "layer_j": j, "value": float(A[i, j])})
    adjacent_angle = A.diagonal(offset=1)
    for l in range(1, L + 1):
        out.append({"metric": "adjacent_angular_distance", "unit": "state", "layer": l, "value": float(adjacent_angle[l - 1])})
    out.append({"metric": "adjacent_angular_distance_mean", "value": float(adjacent_angle.mean())})
    for variant, acc in accs.items():
        if acc.n_batches == 0:
            raise DepthToolsError(f"no CKA minibatch of >= 8 tokens; pass more tokens (got {n_tokens})")
        C = acc.result()
        for i in range(L + 1):
            for j in range(L + 1):
                out.append({"metric": f"cka_{variant}", "unit": "state", "layer": i, "layer_j": j, "value": float(C[i, j])})
        adj = adjacent_cka(C)
        for l in range(1, L + 1):
            out.append({"metric": f"adjacent_cka_{variant}", "unit": "state", "layer": l, "value": float(adj[l - 1])})
        out.append({"metric": f"adjacent_cka_mean_{variant}", "value": float(adj.mean())})
        out.append({"metric": f"cka_block_fraction_{variant}", "value": float(block_fraction(C, block_threshold))})
        out.append({"metric": f"n_rep_{variant}", "value": float(n_rep(C))})
    collapse_names = ("collapse_stable_rank", "collapse_effective_rank", "collapse_l1_over_l2", "collapse_mean_cosine")
    for depth, m in enumerate(moments):
        erank, pr = spectral_stats(m.spectrum())
        erank_o, pr_o = spectral_stats(m.spectrum(drop_top=outlier_k)) if outlier_k > 0 else (math.nan, math.nan)
        for name, value in (("effective_rank", erank), ("participation_ratio", pr),
                            ("effective_rank_no_outlier", erank_o), ("participation_ratio_no_outlier", pr_o)):
            out.append({"metric": name, "unit": "state", "layer": depth, "value": value})
        for name, value in zip(collapse_names, (collapse_sum[depth] / n_seqs).tolist()):
            out.append({"metric": name, "unit": "state", "layer": depth, "value": value})
    out.append({"metric": "n_tokens", "value": float(n_tokens)})
    settings = dict(batch_size=batch_size, exclude_first=exclude_first, cka_batch=cka_batch, outlier_k=outlier_k,
                    block_threshold=block_threshold, variants=list(variants), seed=seed,
                    n_sequences=int(inputs.shape[0]), seq_len=int(inputs.shape[1]),
                    tokens=token_fingerprint(tokens))
    return tidy_frame(model, out, settings)


def pair_matrix(df: pd.DataFrame, metric: str) -> torch.Tensor:
    """The (L+1)×(L+1) (or L×L) matrix of a pair metric from a tidy table (NaN where absent)."""
    sub = df[df["metric"] == metric]
    if sub.empty:
        raise DepthToolsError(f"no rows for metric {metric!r}; available: {sorted(df['metric'].unique())}")
    size = int(max(sub["layer"].max(), sub["layer_j"].max())) + 1
    M = torch.full((size, size), math.nan, dtype=F64)
    for i, j, v in zip(sub["layer"], sub["layer_j"], sub["value"]):
        M[int(i), int(j)] = v
    return M
