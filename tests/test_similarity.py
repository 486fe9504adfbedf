"""Tests for depthtools.analysis.similarity against independent, deliberately slow references.

The references use explicit n×n centring matrices and the Song et al. (2012) closed-form
unbiased HSIC on *uncentred* Gram matrices, so they share no code path with the module.
"""

import math

import numpy as np
import pytest
import torch

from depthtools.analysis.similarity import (
    CKAAccumulator,
    adjacent_angular_distance,
    adjacent_cka,
    angular_distance_matrix,
    block_fraction,
    effective_rank,
    hsic_unbiased,
    linear_cka,
    n_rep,
    participation_ratio,
    token_collapse,
    top_outlier_dims,
)

from tiny_models import one_thread  # noqa: F401 (fixture)

F64 = torch.float64


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------- references


def slow_hsic_biased(X: torch.Tensor, Y: torch.Tensor) -> float:
    """tr(K H L H)/(n−1)² with the explicit centring matrix H = I − 11ᵀ/n, raw Grams."""
    X, Y = X.to(F64), Y.to(F64)
    n = X.shape[0]
    H = torch.eye(n, dtype=F64) - torch.ones(n, n, dtype=F64) / n
    K, L = X @ X.T, Y @ Y.T
    return float(torch.trace(K @ H @ L @ H)) / (n - 1) ** 2


def song_hsic1(X: torch.Tensor, Y: torch.Tensor) -> float:
    """Song et al. 2012 closed-form unbiased HSIC on diag-zeroed raw (uncentred) Grams."""
    X, Y = X.to(F64), Y.to(F64)
    n = X.shape[0]
    Kt, Lt = X @ X.T, Y @ Y.T
    Kt.fill_diagonal_(0.0)
    Lt.fill_diagonal_(0.0)
    one = torch.ones(n, dtype=F64)
    val = (
        torch.trace(Kt @ Lt)
        + (one @ Kt @ one) * (one @ Lt @ one) / ((n - 1) * (n - 2))
        - 2.0 / (n - 2) * (one @ Kt @ Lt @ one)
    ) / (n * (n - 3))
    return float(val)


def slow_cka(X, Y, hsic) -> float:
    return hsic(X, Y) / math.sqrt(hsic(X, X) * hsic(Y, Y))


def correlated_pair(n: int, d1: int, d2: int, seed: int, noise: float = 1.0, offset: float = 3.0):
    """Two representations sharing a 4-d latent, with a non-zero mean (so centring matters)."""
    g = _gen(seed)
    Z = torch.randn(n, 4, generator=g, dtype=F64)
    X = Z @ torch.randn(4, d1, generator=g, dtype=F64) + noise * torch.randn(n, d1, generator=g, dtype=F64)
    Y = Z @ torch.randn(4, d2, generator=g, dtype=F64) + noise * torch.randn(n, d2, generator=g, dtype=F64)
    return X + offset, Y - offset


# ----------------------------------------------------------------------------- linear CKA


@pytest.mark.parametrize("form", ["feature", "gram", "auto"])
@pytest.mark.parametrize("shape", [(200, 12, 7), (30, 50, 80)])
def test_biased_cka_matches_explicit_centring_matrix(form, shape):
    X, Y = correlated_pair(*shape, seed=1)
    expected = slow_cka(X, Y, slow_hsic_biased)
    got = float(linear_cka(X, Y, debiased=False, form=form))
    assert got == pytest.approx(expected, abs=1e-8)


@pytest.mark.parametrize("form", ["feature", "gram", "auto"])
@pytest.mark.parametrize("shape", [(200, 12, 7), (30, 50, 80)])
def test_debiased_cka_matches_song_closed_form(form, shape):
    X, Y = correlated_pair(*shape, seed=2)
    expected = slow_cka(X, Y, song_hsic1)
    got = float(linear_cka(X, Y, debiased=True, form=form))
    assert got == pytest.approx(expected, abs=1e-8)
    # and debiasing really changes the value here (so the two tests cannot both pass by accident)
    assert abs(got - float(linear_cka(X, Y, debiased=False, form=form))) > 1e-3


def test_u_centred_hsic_equals_song_closed_form():
    X, Y = correlated_pair(25, 9, 6, seed=3)
    K, L = X @ X.T, Y @ Y.T  # raw, uncentred
    assert float(hsic_unbiased(K, L)) == pytest.approx(song_hsic1(X, Y), rel=1e-10, abs=1e-12)


@pytest.mark.parametrize("debiased", [False, True])
@pytest.mark.parametrize("form", ["feature", "gram"])
def test_cka_self_is_one(debiased, form):
    X, _ = correlated_pair(64, 20, 5, seed=4)
    assert float(linear_cka(X, X, debiased=debiased, form=form)) == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("debiased", [False, True])
def test_cka_invariant_to_orthogonal_map_scaling_and_shift(debiased):
    X, Y = correlated_pair(150, 16, 10, seed=5)
    Q, _ = torch.linalg.qr(torch.randn(16, 16, generator=_gen(6), dtype=F64))
    base = float(linear_cka(X, Y, debiased=debiased))
    assert float(linear_cka(X @ Q, Y, debiased=debiased)) == pytest.approx(base, abs=1e-10)
    assert float(linear_cka(7.5 * X, 0.01 * Y, debiased=debiased)) == pytest.approx(base, abs=1e-10)
    assert float(linear_cka(X + 100.0, Y, debiased=debiased)) == pytest.approx(base, abs=1e-8)
    # sanity: a non-isotropic scaling is NOT an invariance
    S = torch.ones(16, dtype=F64)
    S[0] = 30.0
    assert abs(float(linear_cka(X * S, Y, debiased=debiased)) - base) > 1e-3


def test_debiased_cka_removes_small_n_bias():
    g = _gen(7)
    X = torch.randn(64, 2048, generator=g)
    Y = torch.randn(64, 2048, generator=g)
    assert abs(float(linear_cka(X, Y, debiased=True))) < 0.1
    assert float(linear_cka(X, Y, debiased=False)) > 0.9


def test_float32_input_is_handled_in_float64():
    X, Y = correlated_pair(500, 8, 8, seed=8, offset=2000.0)  # large norms, as in §3.2
    ref = float(linear_cka(X, Y))
    got = linear_cka(X.float(), Y.float())
    assert got.dtype == F64
    assert float(got) == pytest.approx(ref, abs=1e-4)


# ----------------------------------------------------------------------------- accumulator


def depth_states(n: int, widths, seed: int):
    """A toy residual-stream-like stack: each depth = previous + fresh noise (projected)."""
    g = _gen(seed)
    base = torch.randn(n, max(widths), generator=g, dtype=F64)
    states = []
    for i, w in enumerate(widths):
        base = base + 0.6 * torch.randn(base.shape, generator=g, dtype=F64)
        states.append(base[:, :w] + 0.1 * i)
    return states


@pytest.mark.parametrize("widths", [[6, 6, 6, 6, 6], [6, 9, 4, 7, 5]])
@pytest.mark.parametrize("debiased", [True, False])
def test_accumulator_matches_per_pair_reference(widths, debiased):
    m = len(widths)
    hsic = song_hsic1 if debiased else slow_hsic_biased
    acc = CKAAccumulator(m, debiased=debiased)
    batches = [depth_states(n, widths, seed=10 + k) for k, n in enumerate([40, 33, 57])]
    for states in batches:
        acc.update(states)
    C = acc.result()
    assert C.shape == (m, m)
    sums = {(i, j): sum(hsic(b[i], b[j]) for b in batches) for i in range(m) for j in range(i, m)}
    for i in range(m):
        for j in range(m):
            num = sums[min(i, j), max(i, j)]
            ref = num / math.sqrt(sums[i, i] * sums[j, j])
            assert float(C[i, j]) == pytest.approx(ref, abs=1e-8), (i, j)


def test_accumulator_single_batch_equals_linear_cka():
    states = depth_states(80, [5, 5, 5, 5], seed=20)
    acc = CKAAccumulator(4, debiased=True)
    acc.update(states)
    C = acc.result()
    for i in range(4):
        for j in range(4):
            assert float(C[i, j]) == pytest.approx(float(linear_cka(states[i], states[j], debiased=True)), abs=1e-10)
    assert torch.allclose(C, C.T) and torch.allclose(C.diagonal(), torch.ones(4, dtype=F64))


def _minibatch_cka(X, Y, batch: int, debiased: bool) -> float:
    acc = CKAAccumulator(2, debiased=debiased)
    for s in range(0, X.shape[0], batch):
        acc.update([X[s : s + batch], Y[s : s + batch]])
    return float(acc.result()[0, 1])


def test_minibatch_cka_approaches_full_debiased_value():
    """Ratio-of-sums debiased minibatch CKA is close to the full-data value at every batch size
    and exact when one batch holds all tokens; the biased estimator only gets there as batches grow."""
    n = 2048
    X, Y = correlated_pair(n, 48, 48, seed=21, noise=3.0)
    full = float(linear_cka(X, Y, debiased=True))
    sizes = (16, 64, 256, 1024)
    err_deb = [abs(_minibatch_cka(X, Y, b, debiased=True) - full) for b in sizes]
    err_bia = [abs(_minibatch_cka(X, Y, b, debiased=False) - full) for b in sizes]
    assert max(err_deb) < 0.02
    assert _minibatch_cka(X, Y, n, debiased=True) == pytest.approx(full, abs=1e-10)
    assert all(a > b for a, b in zip(err_bia, err_bia[1:]))  # biased: error shrinks with batch size
    assert err_bia[0] > 0.1 and err_bia[0] > 10 * err_deb[0]


def _shared_outlier_pair(n=512, d=64, seed=30):
    """Independent X, Y except for one shared massive dimension (docs/reference/metrics.md §3.1 pitfall)."""
    g = _gen(seed)
    X = torch.randn(n, d, generator=g, dtype=F64)
    Y = torch.randn(n, d, generator=g, dtype=F64)
    massive = 50.0 + 40.0 * torch.randn(n, generator=g, dtype=F64)
    X[:, 3] = massive
    Y[:, 3] = massive
    return X, Y


def test_shared_outlier_dim_inflates_cka_and_controls_remove_it():
    X, Y = _shared_outlier_pair()
    plain = CKAAccumulator(2, debiased=True)
    zs = CKAAccumulator(2, debiased=True, outlier_mode="zscore")
    rm = CKAAccumulator(2, debiased=True, outlier_mode="remove", outlier_k=1)
    rm_given = CKAAccumulator(2, debiased=True, outlier_mode="remove", outlier_dims=top_outlier_dims(X, 1))
    for s in range(0, 512, 128):
        for acc in (plain, zs, rm, rm_given):
            acc.update([X[s : s + 128], Y[s : s + 128]])
    assert float(plain.result()[0, 1]) > 0.9
    assert abs(float(zs.result()[0, 1])) < 0.1
    assert abs(float(rm.result()[0, 1])) < 0.1
    assert abs(float(rm_given.result()[0, 1])) < 0.1
    assert int(top_outlier_dims(X, 1)[0]) == 3


def test_accumulator_rejects_bad_input():
    acc = CKAAccumulator(3)
    with pytest.raises(ValueError):
        acc.result()
    with pytest.raises(ValueError):
        acc.update([torch.randn(10, 4)] * 2)
    with pytest.raises(ValueError):
        acc.update([torch.randn(3, 4)] * 3)  # n < 4 for debiased
    with pytest.raises(ValueError):
        acc.update([torch.randn(10, 4), torch.randn(11, 4), torch.randn(10, 4)])


# ----------------------------------------------------------------------------- angular distance


def test_angular_distance_of_identical_states_is_zero():
    Z = torch.randn(50, 16, generator=_gen(40))
    D = angular_distance_matrix([Z, Z.clone(), 3.0 * Z])
    assert torch.allclose(D, torch.zeros(3, 3, dtype=F64), atol=1e-6)
    assert torch.allclose(adjacent_angular_distance([Z, Z.clone(), 3.0 * Z]), torch.zeros(2, dtype=F64), atol=1e-6)


def test_angular_distance_matches_loop_reference_and_known_values():
    g = _gen(41)
    states = [torch.randn(37, 8, generator=g) for _ in range(4)]
    states[2] = -states[1]  # opposite -> 1
    D = angular_distance_matrix(states, chunk=10)  # chunking must not matter
    A = [s.double().numpy() for s in states]
    for i in range(4):
        for j in range(4):
            cos = (A[i] * A[j]).sum(1) / (np.linalg.norm(A[i], axis=1) * np.linalg.norm(A[j], axis=1))
            ref = np.mean(np.arccos(np.clip(cos, -1, 1))) / np.pi
            assert float(D[i, j]) == pytest.approx(ref if i != j else 0.0, abs=1e-7)  # arccos ill-conditioned at ±1
    assert float(D[1, 2]) == pytest.approx(1.0, abs=1e-6)
    e = torch.eye(2)
    assert float(angular_distance_matrix([e, e.flip(0)])[0, 1]) == pytest.approx(0.5, abs=1e-12)
    assert torch.allclose(adjacent_angular_distance(states), D.diagonal(offset=1), atol=1e-10)


# ----------------------------------------------------------------------------- spectra


def _centred_orthonormal(n: int, r: int, seed: int) -> torch.Tensor:
    """[n, r] orthonormal columns, each orthogonal to the all-ones vector."""
    A = torch.randn(n, r, generator=_gen(seed), dtype=F64)
    Q, _ = torch.linalg.qr(A - A.mean(0))
    return Q


def test_effective_rank_and_pr_of_exact_rank_r():
    n, d, r = 200, 40, 6
    U = _centred_orthonormal(n, r, seed=50)
    V, _ = torch.linalg.qr(torch.randn(d, r, generator=_gen(51), dtype=F64))
    Z = 5.0 * U @ V.T + 2.0  # equal singular values, plus a mean that centring must remove
    assert float(effective_rank(Z)) == pytest.approx(r, abs=1e-8)
    assert float(participation_ratio(Z)) == pytest.approx(r, abs=1e-8)
    s = torch.tensor([8.0, 4.0, 2.0, 1.0, 1.0, 0.5], dtype=F64)
    Z2 = (U * s) @ V.T
    p = (s / s.sum()).numpy()
    lam = (s**2).numpy()
    assert float(effective_rank(Z2)) == pytest.approx(float(np.exp(-(p * np.log(p)).sum())), abs=1e-8)
    assert float(participation_ratio(Z2)) == pytest.approx(lam.sum() ** 2 / (lam**2).sum(), abs=1e-8)
    # a generic rank-r matrix: between r/2 and r (numerical-zero singular values add ~nothing)
    G = torch.randn(n, r, generator=_gen(52), dtype=F64) @ torch.randn(r, d, generator=_gen(53), dtype=F64)
    assert r / 2 < float(effective_rank(G)) <= r + 1e-6


def test_token_collapse_extremes_and_batch_average():
    g = _gen(60)
    v = torch.randn(16, generator=g)
    collapsed = torch.rand(10, 1, generator=g).add(0.5) * v  # [10, 16], all tokens on one ray
    tc = token_collapse(collapsed)
    for val in (tc.stable_rank, tc.effective_rank, tc.l1_over_l2, tc.mean_cosine):
        assert float(val) == pytest.approx(1.0, abs=1e-6)
    spread = 3.0 * torch.eye(16)[:10]  # 10 orthogonal tokens of equal norm
    tc = token_collapse(spread)
    assert float(tc.stable_rank) == pytest.approx(10, abs=1e-8)
    assert float(tc.effective_rank) == pytest.approx(10, abs=1e-8)
    assert float(tc.l1_over_l2) == pytest.approx(math.sqrt(10), abs=1e-8)
    assert float(tc.mean_cosine) == pytest.approx(0.0, abs=1e-12)
    # batched input = mean of per-sequence values; uncentred (a shared offset raises cosine)
    H = torch.randn(3, 12, 8, generator=g, dtype=F64) + 2.0
    per = [token_collapse(H[b]) for b in range(3)]
    tb = token_collapse(H)
    assert float(tb.stable_rank) == pytest.approx(np.mean([float(t.stable_rank) for t in per]), abs=1e-10)
    s = np.linalg.svd(H[0].numpy(), compute_uv=False)
    q = s**2 / (s**2).sum()
    assert float(per[0].effective_rank) == pytest.approx(float(np.exp(-(q * np.log(q)).sum())), abs=1e-10)
    Hn = H[0].numpy() / np.linalg.norm(H[0].numpy(), axis=1, keepdims=True)
    cosm = Hn @ Hn.T
    assert float(per[0].mean_cosine) == pytest.approx((cosm.sum() - 12) / (12 * 11), abs=1e-10)
    assert float(tb.mean_cosine) > 0.5


# ----------------------------------------------------------------------------- summaries


def test_cka_summaries():
    m = 9  # L = 8
    C = torch.full((m, m), 0.3, dtype=F64)
    C[2:6, 2:6] = 0.95  # depths 2..5 form a block: 3 layers of 8
    C.fill_diagonal_(1.0)
    assert torch.equal(adjacent_cka(C), C.diagonal(offset=1))
    assert block_fraction(C) == pytest.approx(3 / 8)
    assert block_fraction(C, threshold=0.99) == 0.0
    # a chain with high adjacent but low long-range similarity is NOT a block
    chain = torch.full((m, m), 0.1, dtype=F64)
    chain.fill_diagonal_(1.0)
    idx = torch.arange(m - 1)
    chain[idx, idx + 1] = chain[idx + 1, idx] = 0.95
    assert block_fraction(chain) == pytest.approx(1 / 8)
    assert block_fraction(torch.ones(m, m, dtype=F64)) == pytest.approx(1.0)
    assert float(n_rep(torch.eye(m, dtype=F64))) == pytest.approx(m)
    assert float(n_rep(torch.ones(m, m, dtype=F64))) == pytest.approx(1.0)
    assert float(n_rep(C)) == pytest.approx(m**2 / float((C**2).sum()))
