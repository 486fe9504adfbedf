"""Model-independent representation-similarity math (docs/reference/metrics.md §3).

Every function takes plain torch tensors with rows = tokens and columns = features
(``[n, d]``); nothing here knows about models. Statistics are computed in float64
(docs/reference/metrics.md §0: "accumulate all Gram/covariance/CKA/rank statistics in fp64") and
features are centred *before* any Gram matrix is formed, because centring a
large-norm Gram matrix loses precision (§3.2).

Contents
* Linear CKA, biased (Kornblith et al. 2019) and debiased (Song et al. 2012 HSIC₁),
  in feature-space form for n ≫ d and Gram form otherwise: :func:`linear_cka`.
* U-centring (Székely & Rizzo 2014) and unbiased HSIC: :func:`u_centre`, :func:`hsic_unbiased`.
* Minibatch (L+1)×(L+1) CKA with one matmul per batch (Nguyen et al. 2021):
  :class:`CKAAccumulator`, with optional outlier-dimension control.
* Angular distance between depth states (Gromov et al.): :func:`angular_distance_matrix`,
  :func:`adjacent_angular_distance`.
* Spectral geometry: :func:`effective_rank`, :func:`participation_ratio`, :func:`token_collapse`.
* Summaries of a CKA matrix: :func:`adjacent_cka`, :func:`block_fraction`, :func:`n_rep`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from depthtools.errors import DepthToolsError

F64 = torch.float64

__all__ = [
    "centre_features",
    "gram_linear",
    "u_centre",
    "hsic_biased",
    "hsic_unbiased",
    "linear_cka",
    "top_outlier_dims",
    "remove_dims",
    "zscore_features",
    "CKAAccumulator",
    "angular_distance_matrix",
    "adjacent_angular_distance",
    "effective_rank",
    "participation_ratio",
    "TokenCollapse",
    "token_collapse",
    "adjacent_cka",
    "block_fraction",
    "n_rep",
]


# --------------------------------------------------------------------------------------
# Basic building blocks
# --------------------------------------------------------------------------------------


def _check_2d(X: torch.Tensor, name: str) -> None:
    """Reject anything that is not a [n, d] matrix (rows = tokens, cols = features)."""
    if X.ndim != 2:
        raise DepthToolsError(f"{name} must be a 2-D [tokens, features] tensor, got shape {tuple(X.shape)}")


def centre_features(X: torch.Tensor) -> torch.Tensor:
    """Cast to float64 and subtract the per-feature (column) mean.

    Centring the features first makes ``X Xᵀ`` equal to ``H K H`` without ever forming
    the n×n centring matrix, and keeps precision when activations have large norms.
    """
    # X: [n, d] -> [n, d] float64, column means 0
    X = X.to(F64)
    return X - X.mean(dim=0, keepdim=True)


def gram_linear(X: torch.Tensor) -> torch.Tensor:
    """Linear-kernel Gram matrix ``K = X Xᵀ`` of the float64-centred features ([n, n])."""
    Xc = centre_features(X)  # [n, d]
    return Xc @ Xc.T  # [n, n]


def u_centre(K: torch.Tensor) -> torch.Tensor:
    """U-centre Gram matrices (Székely & Rizzo 2014); works on ``[n, n]`` or batched ``[..., n, n]``.

    Zero the diagonal, then ``K^u_ij = K_ij − r_i/(n−2) − r_j/(n−2) + S/((n−1)(n−2))`` with
    ``r`` the row sums and ``S`` the total, then zero the diagonal again. With this,
    ``HSIC₁(K, L) = ⟨K^u, L^u⟩ / (n(n−3))`` is the unbiased estimator of Song et al. 2012,
    and the inner product makes many pairs a single matmul. Needs n ≥ 4.
    """
    return _u_centre_(K.to(F64).clone())


def _u_centre_(K: torch.Tensor) -> torch.Tensor:
    """In-place U-centring of a float64 ``[..., n, n]`` tensor (saves a copy of a fresh Gram stack)."""
    n = K.shape[-1]
    if n < 4:
        raise DepthToolsError(f"unbiased HSIC needs at least 4 tokens per batch, got {n}")
    K.diagonal(dim1=-2, dim2=-1).zero_()
    r = K.sum(dim=-1) / (n - 2)  # [..., n] row sums / (n−2)
    c = r.sum(dim=-1) / (n - 1)  # [...] S/((n−1)(n−2))
    K -= r.unsqueeze(-1)
    K -= r.unsqueeze(-2) - c[..., None, None]
    K.diagonal(dim1=-2, dim2=-1).zero_()
    return K


def hsic_biased(K: torch.Tensor, L: torch.Tensor) -> torch.Tensor:
    """Plug-in HSIC ``tr(K H L H)/(n−1)²`` of two Gram matrices (centred here, in float64)."""
    n = K.shape[0]
    Kc = _double_centre(K.to(F64))
    return (Kc * L.to(F64)).sum() / (n - 1) ** 2


def _double_centre(K: torch.Tensor) -> torch.Tensor:
    """``H K H`` for a symmetric [n, n] matrix without forming H (subtract row/col means)."""
    return K - K.mean(0, keepdim=True) - K.mean(1, keepdim=True) + K.mean()


def hsic_unbiased(K: torch.Tensor, L: torch.Tensor) -> torch.Tensor:
    """Unbiased HSIC₁ (Song et al. 2012) via U-centring: ``⟨K^u, L^u⟩ / (n(n−3))``."""
    n = K.shape[0]
    return (u_centre(K) * u_centre(L)).sum() / (n * (n - 3))


# --------------------------------------------------------------------------------------
# Pairwise linear CKA
# --------------------------------------------------------------------------------------


def _use_feature_form(n: int, d1: int, d2: int) -> bool:
    """Pick the cheaper form: feature-space costs ~n(d1·d2+d1²+d2²), Gram form ~n²(d1+d2)."""
    return d1 * d2 + d1 * d1 + d2 * d2 <= n * (d1 + d2)


def _hsic_terms_feature(Xc: torch.Tensor, Yc: torch.Tensor, debiased: bool) -> torch.Tensor:
    """HSIC of linear kernels from centred features without forming n×n matrices.

    Biased: ``‖YᵀX‖²_F/(n−1)²``. Debiased: the Song et al. closed form, each term
    rewritten in O(n·d): with k, l = row squared norms (the Gram diagonals),
    ``tr(K̃L̃) = ‖XᵀY‖²_F − Σ k_i l_i``, ``1ᵀK̃1 = ‖Xᵀ1‖² − Σk``, ``K̃1 = X(Xᵀ1) − k``.
    """
    n = Xc.shape[0]
    cross = (Xc.T @ Yc).square().sum()  # ‖XᵀY‖²_F = tr(KL)
    if not debiased:
        return cross / (n - 1) ** 2
    k = Xc.square().sum(1)  # [n] diag(K)
    l = Yc.square().sum(1)  # [n] diag(L)
    sx, sy = Xc.sum(0), Yc.sum(0)  # [d1], [d2] (≈0 after centring; kept for exactness)
    tr_kl = cross - (k * l).sum()
    one_k_one = sx.square().sum() - k.sum()
    one_l_one = sy.square().sum() - l.sum()
    k1 = Xc @ sx - k  # [n] K̃1
    l1 = Yc @ sy - l  # [n] L̃1
    num = tr_kl + one_k_one * one_l_one / ((n - 1) * (n - 2)) - 2.0 / (n - 2) * (k1 * l1).sum()
    return num / (n * (n - 3))


def linear_cka(
    X: torch.Tensor, Y: torch.Tensor, debiased: bool = False, form: str = "auto"
) -> torch.Tensor:
    """Linear CKA between two representations of the same n tokens (0-dim float64 tensor).

    ``CKA = HSIC(K,L)/√(HSIC(K,K)·HSIC(L,L))`` with linear kernels on float64-centred
    features. ``debiased=True`` uses the unbiased HSIC₁, which removes the strong upward
    bias of plug-in CKA when n is not ≫ d (it can then be slightly negative; needs n ≥ 4).
    ``form``: ``"feature"`` (d×d products, for n ≫ d), ``"gram"`` (n×n Grams, for d ≫ n)
    or ``"auto"`` (cheaper of the two). Both forms give the same value.
    """
    _check_2d(X, "X")
    _check_2d(Y, "Y")
    if X.shape[0] != Y.shape[0]:
        raise DepthToolsError(f"X and Y must have the same number of tokens, got {X.shape[0]} and {Y.shape[0]}")
    n, d1, d2 = X.shape[0], X.shape[1], Y.shape[1]
    if debiased and n < 4:
        raise DepthToolsError(f"debiased CKA needs at least 4 tokens, got {n}")
    if form not in ("auto", "feature", "gram"):
        raise DepthToolsError(f"form must be 'auto', 'feature' or 'gram', got {form!r}")
    Xc, Yc = centre_features(X), centre_features(Y)  # [n, d1], [n, d2]
    if form == "feature" or (form == "auto" and _use_feature_form(n, d1, d2)):
        xy = _hsic_terms_feature(Xc, Yc, debiased)
        xx = _hsic_terms_feature(Xc, Xc, debiased)
        yy = _hsic_terms_feature(Yc, Yc, debiased)
    else:
        K, L = Xc @ Xc.T, Yc @ Yc.T  # [n, n] each, already double-centred
        if debiased:
            Ku, Lu = u_centre(K), u_centre(L)
            xy, xx, yy = (Ku * Lu).sum(), Ku.square().sum(), Lu.square().sum()
        else:
            xy, xx, yy = (K * L).sum(), K.square().sum(), L.square().sum()
    return xy / torch.sqrt(xx * yy)


# --------------------------------------------------------------------------------------
# Outlier-dimension control
# --------------------------------------------------------------------------------------


def top_outlier_dims(X: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k features with largest mean |activation| (massive-activation dims).

    Compute once on a calibration set and pass to :func:`remove_dims` / the accumulator to
    drop the same dims in every batch, or let the accumulator pick them per batch.
    """
    _check_2d(X, "X")
    k = min(k, X.shape[1] - 1)  # always keep at least one feature
    return X.to(F64).abs().mean(0).topk(k).indices  # [k]


def remove_dims(X: torch.Tensor, dims: torch.Tensor) -> torch.Tensor:
    """Drop the given feature columns: [n, d] -> [n, d − len(dims)]."""
    keep = torch.ones(X.shape[1], dtype=torch.bool, device=X.device)
    keep[dims] = False
    return X[:, keep]


def zscore_features(X: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """Standardise each feature to mean 0, std 1 (float64), so no single dim dominates the Gram.

    Constant features (std < eps) become 0 rather than NaN.
    """
    X = centre_features(X)  # [n, d]
    std = X.std(dim=0, keepdim=True)  # [1, d]
    return X / torch.where(std > eps, std, torch.ones_like(std))


# --------------------------------------------------------------------------------------
# Minibatch (L+1)x(L+1) CKA accumulator
# --------------------------------------------------------------------------------------


class CKAAccumulator:
    """All-pairs linear CKA over depth states, accumulated over token minibatches.

    Per batch, every depth's Gram matrix is formed once from float64-centred features,
    centred (U-centring for ``debiased=True``, plain double centring otherwise — which is a
    no-op after feature centring), flattened, stacked to ``[L+1, n²]`` and multiplied with
    its transpose: ONE matmul yields all (L+1)² HSIC numerators. These per-batch HSICs are
    summed in float64 and ``result()`` returns the ratio of sums
    ``ΣHSIC(i,j)/√(ΣHSIC(i,i)·ΣHSIC(j,j))`` (Nguyen et al. 2021), which for the unbiased
    HSIC₁ converges to the full-data debiased CKA without storing activations. Memory is
    bounded by one batch of Grams: (L+1)·n²·8 bytes.

    Outlier control (docs/reference/metrics.md §3.1/3.3; massive dims make independent data look aligned):
    * ``outlier_mode='remove'``: drop ``outlier_k`` dims per depth, either ``outlier_dims``
      (one index tensor per depth, or one for all depths) or, if not given, the top-k by
      mean |activation| of each batch.
    * ``outlier_mode='zscore'``: standardise every feature within the batch.
    """

    def __init__(
        self,
        n_layers_plus_one: int,
        debiased: bool = True,
        outlier_mode: str | None = None,
        outlier_k: int = 1,
        outlier_dims: torch.Tensor | Sequence[torch.Tensor] | None = None,
    ) -> None:
        if n_layers_plus_one < 1:
            raise DepthToolsError(f"n_layers_plus_one must be >= 1, got {n_layers_plus_one}")
        if outlier_mode not in (None, "remove", "zscore"):
            raise DepthToolsError(f"outlier_mode must be None, 'remove' or 'zscore', got {outlier_mode!r}")
        if outlier_mode == "remove" and outlier_dims is None and outlier_k < 1:
            raise DepthToolsError(f"outlier_k must be >= 1 for outlier_mode='remove', got {outlier_k}")
        self.n_states = n_layers_plus_one
        self.debiased = debiased
        self.outlier_mode = outlier_mode
        self.outlier_k = outlier_k
        self.outlier_dims = outlier_dims
        self.hsic_sum = torch.zeros(n_layers_plus_one, n_layers_plus_one, dtype=F64)  # [L+1, L+1]
        self.n_batches = 0
        self.n_tokens = 0

    def _preprocess(self, X: torch.Tensor, depth: int) -> torch.Tensor:
        """Apply outlier control and float64 feature centring to one depth's batch ([n, d])."""
        if self.outlier_mode == "zscore":
            return zscore_features(X)
        if self.outlier_mode == "remove":
            dims = self.outlier_dims
            if dims is None:
                dims = top_outlier_dims(X, self.outlier_k)
            elif not isinstance(dims, torch.Tensor):
                dims = dims[depth]  # one index tensor per depth
            X = remove_dims(X, dims)
        return centre_features(X)

    def batch_grams(self, states: Sequence[torch.Tensor] | torch.Tensor) -> torch.Tensor:
        """Centred (or U-centred) Gram matrices of one batch, flattened: ``[L+1, n²]`` float64."""
        if len(states) != self.n_states:
            raise DepthToolsError(f"expected {self.n_states} depth states, got {len(states)}")
        for i, X in enumerate(states):
            _check_2d(X, f"states[{i}]")
        n = states[0].shape[0]
        if any(X.shape[0] != n for X in states):
            raise DepthToolsError("all depth states in a batch must have the same number of tokens")
        feats = [self._preprocess(X, i) for i, X in enumerate(states)]  # L+1 x [n, d_i]
        if all(f.shape == feats[0].shape for f in feats):
            F = torch.stack(feats)  # [L+1, n, d]
            G = F @ F.transpose(1, 2)  # [L+1, n, n]
        else:
            G = torch.stack([f @ f.T for f in feats])  # [L+1, n, n]
        if self.debiased:
            G = _u_centre_(G)  # fresh float64 stack: U-centre in place (removes the diagonal bias)
        return G.reshape(self.n_states, n * n)  # [L+1, n²]

    def update(self, states: Sequence[torch.Tensor] | torch.Tensor) -> None:
        """Add one token minibatch: ``states[i]`` is depth i's ``[n, d_i]`` activations (same n)."""
        G = self.batch_grams(states)  # [L+1, n²]
        n = states[0].shape[0]
        scale = n * (n - 3) if self.debiased else (n - 1) ** 2
        self.hsic_sum += (G @ G.T) / scale  # [L+1, L+1]: all pairs in one matmul
        self.n_batches += 1
        self.n_tokens += n

    def result(self) -> torch.Tensor:
        """The (L+1)×(L+1) CKA matrix: ratio of the accumulated HSIC sums (float64)."""
        if self.n_batches == 0:
            raise DepthToolsError("CKAAccumulator.result() called before any update()")
        diag = self.hsic_sum.diagonal()  # [L+1]
        return self.hsic_sum / torch.sqrt(torch.outer(diag, diag))


# --------------------------------------------------------------------------------------
# Angular distance between depth states
# --------------------------------------------------------------------------------------


def _unit_rows(Z: torch.Tensor, eps: float = 1e-30) -> torch.Tensor:
    """Normalise each token vector to unit length in float64 ([..., n, d])."""
    Z = Z.to(F64)
    return Z / Z.norm(dim=-1, keepdim=True).clamp_min(eps)


def _stack_states(states: Sequence[torch.Tensor] | torch.Tensor) -> torch.Tensor:
    """Stack depth states into ``[L+1, n, d]``; angular distance needs equal shapes."""
    if isinstance(states, torch.Tensor):
        if states.ndim != 3:
            raise DepthToolsError(f"states must be [L+1, tokens, features], got shape {tuple(states.shape)}")
        return states
    shapes = {tuple(s.shape) for s in states}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2:
        raise DepthToolsError(f"depth states must all be [tokens, features] of one shape, got {sorted(shapes)}")
    return torch.stack(list(states))


def angular_distance_matrix(
    states: Sequence[torch.Tensor] | torch.Tensor, chunk: int = 4096
) -> torch.Tensor:
    """All-pairs angular distance ``d(i,j) = mean_t arccos(cos(z_i(t), z_j(t)))/π`` ([L+1, L+1]).

    Per-token cosine between depth states i and j, clamped to [−1, 1] before arccos (rounding
    can push it past 1), averaged over tokens. 0 = same direction, 0.5 = orthogonal,
    1 = opposite. Zero-norm tokens count as orthogonal. Tokens are processed in chunks so
    memory is ``(L+1)²·chunk``.
    """
    Z = _stack_states(states)  # [L+1, n, d]
    m, n = Z.shape[0], Z.shape[1]
    total = torch.zeros(m, m, dtype=F64)
    for start in range(0, n, chunk):
        U = _unit_rows(Z[:, start : start + chunk])  # [L+1, c, d]
        cos = torch.einsum("itd,jtd->ijt", U, U).clamp(-1.0, 1.0)  # [L+1, L+1, c]
        total += torch.arccos(cos).sum(-1)
    D = total / (n * math.pi)
    D.fill_diagonal_(0.0)  # exact zero: arccos(1 − ulp) would give ~1e-8
    return D


def adjacent_angular_distance(states: Sequence[torch.Tensor] | torch.Tensor) -> torch.Tensor:
    """``d(ℓ−1, ℓ)`` for ℓ = 1..L ([L]); the cheap diagonal of :func:`angular_distance_matrix`."""
    U = _unit_rows(_stack_states(states))  # [L+1, n, d]
    cos = (U[:-1] * U[1:]).sum(-1).clamp(-1.0, 1.0)  # [L, n]
    return torch.arccos(cos).mean(-1) / math.pi


# --------------------------------------------------------------------------------------
# Spectral geometry
# --------------------------------------------------------------------------------------


def _entropy_exp(p: torch.Tensor) -> torch.Tensor:
    """``exp(−Σ p log p)`` over the last axis, with 0·log 0 = 0."""
    logp = torch.where(p > 0, p.log(), torch.zeros_like(p))
    return torch.exp(-(p * logp).sum(-1))


def effective_rank(Z: torch.Tensor) -> torch.Tensor:
    """Roy & Vetterli (2007) effective rank of the *centred* representation [n, d].

    ``p_i = σ_i/Σσ`` (singular values of centred Z), ``erank = exp(−Σ p log p)``. Equals r
    for r equal singular values; bounded by min(n, d) — use n ≥ 5d and compare erank/d
    across widths (docs/reference/metrics.md §3.5).
    """
    _check_2d(Z, "Z")
    s = torch.linalg.svdvals(centre_features(Z))  # [min(n, d)]
    return _entropy_exp(s / s.sum())


def participation_ratio(Z: torch.Tensor) -> torch.Tensor:
    """``PR = (Σλ)²/Σλ²`` with λ the covariance eigenvalues of Z [n, d] (= σ²/(n−1) of centred Z)."""
    _check_2d(Z, "Z")
    lam = torch.linalg.svdvals(centre_features(Z)).square()  # scale cancels in the ratio
    return lam.sum().square() / lam.square().sum()


@dataclass(frozen=True)
class TokenCollapse:
    """Token-collapse statistics at one depth, averaged over sequences (float64 scalars).

    Each of the first three → 1 when all tokens lie on one direction and → min(T, D) when
    spread; ``mean_cosine`` → 1 when collapsed and ≈ 0 for spread-out random tokens.
    """

    stable_rank: torch.Tensor  # Σs²/s_max²
    effective_rank: torch.Tensor  # exp(−Σ p log p), p = s²/Σs² (DepthBench; not Roy–Vetterli's s/Σs)
    l1_over_l2: torch.Tensor  # ‖s‖₁/‖s‖₂
    mean_cosine: torch.Tensor  # mean over token pairs t≠t' of cos(h_t, h_t') (cheap companion)


def token_collapse(H: torch.Tensor) -> TokenCollapse:
    """DepthBench token collapse of the *uncentred* per-sequence token matrix.

    ``H``: one sequence ``[T, D]`` or a batch ``[B, T, D]``. Per sequence, one SVD of the
    uncentred ``H`` (centring would remove exactly the shared direction that collapse is
    about) gives stable rank, effective rank (p = s²/Σs²) and ‖s‖₁/‖s‖₂; the mean pairwise
    cosine between distinct tokens is added. All are averaged over sequences.
    """
    if H.ndim == 2:
        H = H.unsqueeze(0)
    if H.ndim != 3 or H.shape[1] < 2:
        raise DepthToolsError(f"H must be [T, D] or [B, T, D] with T >= 2, got shape {tuple(H.shape)}")
    H = H.to(F64)
    # the same singular values either way; LAPACK takes a wide [T, D] matrix ~25x slower than its tall
    # transpose (T=62, D=576: 6.5 s vs 0.24 s for a batch of 8; benchmarks/RESULTS.md, issue 47)
    s = torch.linalg.svdvals(H.mT if H.shape[-2] < H.shape[-1] else H)  # [B, min(T, D)]
    s2 = s.square()
    stable = s2.sum(-1) / s2.max(-1).values  # [B]
    erank = _entropy_exp(s2 / s2.sum(-1, keepdim=True))  # [B]
    l1l2 = s.sum(-1) / s.norm(dim=-1)  # [B]
    U = _unit_rows(H)  # [B, T, D]
    T = H.shape[1]
    cos_sum = U.sum(1).square().sum(-1) - U.square().sum((-1, -2))  # [B] Σ_{t≠t'} cos via ‖Σu‖² − Σ‖u‖²
    mean_cos = cos_sum / (T * (T - 1))
    return TokenCollapse(stable.mean(), erank.mean(), l1l2.mean(), mean_cos.mean())


# --------------------------------------------------------------------------------------
# Summaries of an (L+1)x(L+1) CKA matrix
# --------------------------------------------------------------------------------------


def _check_square(C: torch.Tensor) -> None:
    """Reject anything but a square matrix of at least 2×2 (depths 0..L with L >= 1)."""
    if C.ndim != 2 or C.shape[0] != C.shape[1] or C.shape[0] < 2:
        raise DepthToolsError(f"CKA matrix must be square (L+1)x(L+1) with L >= 1, got shape {tuple(C.shape)}")


def adjacent_cka(C: torch.Tensor) -> torch.Tensor:
    """``c_ℓ = C[ℓ−1, ℓ]`` for ℓ = 1..L ([L]): similarity of each block's input and output."""
    _check_square(C)
    return C.diagonal(offset=1).clone()


def block_fraction(C: torch.Tensor, threshold: float = 0.9) -> float:
    """Longest contiguous run of depths a..b with all pairwise ``C > threshold``, as ``(b−a)/L``.

    The run length is counted in layers (transitions a→a+1 … b−1→b), so the fraction lies in
    [0, 1]: 0 when no two adjacent depths are that similar, 1 when all L+1 depths form one
    block (Nguyen et al. 2021 block structure = evidence of wasted depth).
    """
    _check_square(C)
    M = C > threshold  # [L+1, L+1]
    m = C.shape[0]
    best = 0
    for a in range(m):
        b = a
        # extend while the new depth b+1 is similar to every depth already in a..b
        while b + 1 < m and bool(M[a : b + 2, b + 1].all()) and bool(M[b + 1, a : b + 2].all()):
            b += 1
        best = max(best, b - a)
    return best / (m - 1)


def n_rep(C: torch.Tensor) -> torch.Tensor:
    """Representational participation ratio ``N_rep = (L+1)²/Σ_ij C_ij²``.

    1 if all depths are identical (C all ones), L+1 if mutually orthogonal (C = I).
    Equals ``(tr C)²/‖C‖²_F`` since CKA has a unit diagonal.
    """
    _check_square(C)
    C = C.to(F64)
    return torch.tensor(float(C.shape[0]) ** 2, dtype=F64) / C.square().sum()
