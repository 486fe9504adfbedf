"""Depth-state similarity and geometry (depthtools.analysis.geometry) against direct computations."""

import pytest
import torch

from depthtools.analysis import geometry
from depthtools.analysis.geometry import _Moments, depth_similarity, pair_matrix, spectral_stats
from depthtools.analysis.similarity import effective_rank, linear_cka, participation_ratio, token_collapse

from tiny_models import one_thread, tiny as tiny_model, windows  # noqa: F401 (fixture)


def tiny(arch="preln", n_layer=4, seed=0):
    """As initialised, float32 (the tolerances below are float32's)."""
    return tiny_model(arch, n_layer, vocab=40, context=64, seed=seed, at_init=True)


def token_set(n=4, t=24, seed=1):
    return windows(n, t + 1, seed, vocab=40)


def per_depth(df, metric):
    sub = df[df.metric == metric].sort_values("layer")
    return sub.value.tolist()


def test_identical_states_have_zero_angle_and_unit_cka():
    model = tiny()
    with torch.no_grad():
        for block in model.blocks:  # every block's branch writes 0: z_0 = z_1 = ... = z_L
            block.attn.w_o.weight.zero_()
            block.mlp.w2.weight.zero_()
    df = depth_similarity(model, token_set(), cka_batch=32)
    A = pair_matrix(df, "angular_distance")
    assert torch.allclose(A, torch.zeros_like(A), atol=1e-6)
    assert per_depth(df, "adjacent_angular_distance") == pytest.approx([0.0] * 4, abs=1e-6)
    for variant in ("debiased", "biased", "zscore"):
        C = pair_matrix(df, f"cka_{variant}")
        assert torch.allclose(C, torch.ones_like(C), atol=1e-9), variant
        model_rows = df[df.unit == "model"].set_index("metric").value
        assert model_rows[f"n_rep_{variant}"] == pytest.approx(1.0)
        assert model_rows[f"cka_block_fraction_{variant}"] == pytest.approx(1.0)


def test_statistics_equal_direct_computation_on_all_rows():
    """One model batch and one CKA minibatch: the streamed results equal the full-data functions."""
    model, tokens, k = tiny("hc"), token_set(n=3, t=20), 3  # hc: geometry = 4 concatenated streams
    df = depth_similarity(model, tokens, batch_size=3, exclude_first=k, cka_batch=10_000)
    with torch.no_grad():
        g = [model.geometry(z)[:, k:] for z in model.run_states(tokens[:, :-1])]
    rows = [x.reshape(-1, x.shape[-1]) for x in g]
    assert rows[0].shape == (3 * 17, 128)
    assert per_depth(df, "effective_rank") == pytest.approx([float(effective_rank(r)) for r in rows], rel=1e-6)
    assert per_depth(df, "participation_ratio") == pytest.approx([float(participation_ratio(r)) for r in rows], rel=1e-6)
    C = pair_matrix(df, "cka_debiased")
    Cb = pair_matrix(df, "cka_biased")
    for i in (0, 2, 4):
        for j in (1, 3):
            assert C[i, j] == pytest.approx(float(linear_cka(rows[i], rows[j], debiased=True)), rel=1e-6)
            assert Cb[i, j] == pytest.approx(float(linear_cka(rows[i], rows[j])), rel=1e-6)
    collapse = [float(token_collapse(x).effective_rank) for x in g]
    assert per_depth(df, "collapse_effective_rank") == pytest.approx(collapse, rel=1e-6)
    cos = torch.nn.functional.cosine_similarity(g[0].double(), g[1].double(), dim=-1).clamp(-1, 1)
    angle = float(torch.arccos(cos).mean() / torch.pi)
    assert per_depth(df, "adjacent_angular_distance")[0] == pytest.approx(angle, rel=1e-5)


def test_table_schema_and_excluded_positions():
    model = tiny(n_layer=2)
    df = depth_similarity(model, token_set(n=2, t=12), exclude_first=4, cka_batch=8)
    assert {"model", "arch", "n_layer", "d_model", "metric", "unit", "layer", "layer_j", "rel_depth", "value"} <= set(df.columns)
    assert df.attrs["settings"]["exclude_first"] == 4
    n_tokens = df[df.metric == "n_tokens"].value.item()
    assert n_tokens == 2 * (12 - 4)
    adj = df[df.metric == "adjacent_cka_debiased"]
    assert adj.rel_depth.tolist() == [0.5, 1.0]


# -- the spectra's two forms: kept rows (n <= k, n x n Gram) and k x k moments ----------------------

EPS = torch.finfo(torch.float64).eps


def scatter_spectrum(X, drop_top=0):
    """The reference: the k x k centred scatter built explicitly from all rows, the same top-|mean| dims dropped
    (by Σ|x|, ties as topk breaks them), its eigvalsh; and the same with the eigenvalues below its rounding
    floor (k·eps·max diag XᵀX: the cancellation in XᵀX − s1 s1ᵀ/n) set to 0."""
    n, k = X.shape
    s2, s1 = X.T @ X, X.sum(0)
    scatter = s2 - torch.outer(s1, s1) / n
    if drop_top:
        keep = torch.ones(k, dtype=torch.bool)
        keep[X.abs().sum(0).topk(min(drop_top, k - 1)).indices] = False
        scatter = scatter[keep][:, keep]
    lam = torch.linalg.eigvalsh(scatter).clamp_min(0.0)
    return lam, torch.where(lam > k * EPS * s2.diagonal().max(), lam, torch.zeros_like(lam))


def streamed(blocks, keep_rows=None):
    m = _Moments(blocks[0].shape[1], keep_rows)
    for X in blocks:
        m.update(X)
    return m


def rows(n, k, seed, offset=3.0):
    """Random float64 rows with a per-column mean (so centring matters) and one massive column."""
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(n, k, generator=gen, dtype=torch.float64) + offset * torch.randn(k, generator=gen, dtype=torch.float64)
    X[:, 5] += 40.0
    return X


@pytest.mark.parametrize("n", [20, 47, 48])  # n < k, n = k: the rows are kept
@pytest.mark.parametrize("drop_top", [0, 1, 2])
def test_gram_spectrum_equals_scatter_spectrum(n, drop_top):
    """Kept rows in three update calls: the Gram's eigenvalues are the scatter's nonzero ones (the shorter
    list padded with zeros; equal within float64 rounding); PR equal to 1e-9; erank equal to 1e-9 to
    the reference without its rounding-floor eigenvalues (the raw k x k erank carries ~1e-6 of √rounding,
    see test_gram_erank_is_nearer_the_svd_definition)."""
    k = 48
    X = rows(n, k, seed=n + drop_top)
    m = streamed([X[:7], X[7:9], X[9:]])
    assert m.rows is not None and m.s2 is None  # still the rows form
    gram = m.spectrum(drop_top)
    raw, clean = scatter_spectrum(X, drop_top)
    assert len(gram) == n and len(raw) == k - min(drop_top, k - 1)
    size = max(len(raw), n)  # n = k with dims dropped: the Gram has the more (zero) eigenvalues
    a, b = (torch.cat([torch.zeros(size - len(v), dtype=torch.float64), v]).sort().values for v in (gram, raw))
    assert torch.allclose(a, b, rtol=0, atol=1e-11 * float(raw.max()))
    erank, pr = spectral_stats(gram)
    erank_ref, pr_ref = spectral_stats(clean)
    assert pr == pytest.approx(spectral_stats(raw)[1], rel=1e-9)
    assert pr == pytest.approx(pr_ref, rel=1e-9)
    gram_clean = torch.where(gram > n * EPS * float(gram.max()) * 10, gram, torch.zeros_like(gram))
    assert spectral_stats(gram_clean)[0] == pytest.approx(erank_ref, rel=1e-9)
    assert erank == pytest.approx(erank_ref, rel=1e-7)


def test_spectral_stats_ignore_zero_eigenvalues():
    """The premise of the Gram form: the k − n zeros it leaves out change neither erank nor PR."""
    lam = torch.tensor([3.0, 1.0, 0.5, 1e-3], dtype=torch.float64)
    padded = torch.cat([torch.zeros(100, dtype=torch.float64), lam])
    assert spectral_stats(padded) == spectral_stats(lam)


def test_gram_erank_is_nearer_the_svd_definition():
    """erank is defined on the singular values of the centred rows (`similarity.effective_rank`): the Gram
    form is within 1e-7 of it, the k x k form off by ~1e-6-1e-5 (√ of its rounding-level null eigenvalues)."""
    X = rows(30, 256, seed=3)
    exact = float(effective_rank(X))
    gram = spectral_stats(streamed([X]).spectrum())[0]
    square = spectral_stats(streamed([X], keep_rows=False).spectrum())[0]
    assert gram == pytest.approx(exact, rel=1e-7)
    assert abs(gram - exact) < abs(square - exact) / 10


@pytest.mark.parametrize("drop_top", [0, 1, 2])
def test_switch_to_moments_when_rows_exceed_width(drop_top):
    """n passes k inside the third update: the kept rows are folded into s2 and dropped; from then on the
    moments and spectra are exactly (bitwise) the k x k path's on the same updates."""
    k = 40
    X = rows(53, k, seed=7)
    blocks = [X[:15], X[15:38], X[38:45], X[45:]]  # n: 15, 38 (rows), 45 > 40 (switch), 53
    m = streamed(blocks[:2])
    assert m.rows is not None and m.n == 38
    m.update(blocks[2])
    assert m.rows is None and m.s2 is not None
    m.update(blocks[3])
    square = streamed(blocks, keep_rows=False)
    assert torch.equal(m.s2, square.s2) and torch.equal(m.s1, square.s1) and torch.equal(m.abs1, square.abs1)
    assert torch.equal(m.spectrum(drop_top), square.spectrum(drop_top))
    raw, _ = scatter_spectrum(X, drop_top)
    assert torch.allclose(m.spectrum(drop_top), raw, rtol=0, atol=1e-11 * float(raw.max()))


def test_gram_spectrum_of_rank_deficient_rows():
    """Rows of rank 5 (and a constant column): erank and PR as the SVD of the centred rows gives them, both forms'
    PR equal, the Gram's nonzero eigenvalues the scatter's."""
    gen = torch.Generator().manual_seed(11)
    X = torch.randn(25, 5, generator=gen, dtype=torch.float64) @ torch.randn(5, 64, generator=gen, dtype=torch.float64)
    X[:, 0] = 2.5
    for drop_top in (0, 1, 2):
        gram = streamed([X[:10], X[10:]]).spectrum(drop_top)
        raw, clean = scatter_spectrum(X, drop_top)
        assert int((gram > 1e-9 * gram.max()).sum()) == int((clean > 0).sum()) == 5
        assert torch.allclose(gram.sort().values[-5:], raw[-5:], rtol=1e-10)
        assert spectral_stats(gram)[1] == pytest.approx(spectral_stats(raw)[1], rel=1e-9)
    assert spectral_stats(streamed([X]).spectrum())[0] == pytest.approx(float(effective_rank(X)), rel=1e-6)
    assert spectral_stats(streamed([X]).spectrum())[1] == pytest.approx(float(participation_ratio(X)), rel=1e-9)


def test_depth_similarity_spectra_unchanged_by_gram_form(monkeypatch):
    """tokens < width (2 x 11 rows, d 32): the table's spectral rows from the kept rows (the default) against the
    k x k moments (GRAM_SPECTRA off, the form before): PR within 1e-9, erank within the k x k form's √rounding
    (measured 8e-8, checked to 1e-6; the Gram's erank is the nearer the SVD definition, checked above); every
    other row identical."""
    model, tokens = tiny(), token_set(n=2, t=12)
    gram = depth_similarity(model, tokens, cka_batch=8)
    monkeypatch.setattr(geometry, "GRAM_SPECTRA", False)
    square = depth_similarity(model, tokens, cka_batch=8)
    assert gram[gram.metric == "n_tokens"].value.item() == 22 < model.cfg.d_model == 32
    for metric in ("participation_ratio", "participation_ratio_no_outlier"):
        assert per_depth(gram, metric) == pytest.approx(per_depth(square, metric), rel=1e-9)
    for metric in ("effective_rank", "effective_rank_no_outlier"):
        assert per_depth(gram, metric) == pytest.approx(per_depth(square, metric), rel=1e-6)
    with torch.no_grad():
        g = [model.geometry(z)[:, 1:].reshape(-1, 32) for z in model.run_states(tokens[:, :-1])]
    assert per_depth(gram, "effective_rank") == pytest.approx([float(effective_rank(r)) for r in g], rel=1e-7)
    spectral = gram.metric.str.startswith(("effective_rank", "participation_ratio"))
    assert gram[~spectral].value.tolist() == square[~spectral].value.tolist()


@pytest.mark.parametrize("n_seqs, form", [(2, "rows"), (4, "k x k")])
def test_cost_times_the_spectra_in_the_runs_form(monkeypatch, n_seqs, form):
    """`cost.similarity_seconds` times the spectra as the run will compute them: 2 x 11 rows <= d 32 keep the
    rows to the end (Gram); 4 x 11 rows > 32 switch to the k x k moments, though its 2-sequence sample would not."""
    from depthtools.analysis.cost import similarity_seconds

    seen = []
    spectrum = _Moments.spectrum

    def spy(self, drop_top=0):
        seen.append("rows" if self.rows is not None else "k x k")
        return spectrum(self, drop_top)

    monkeypatch.setattr(_Moments, "spectrum", spy)
    assert similarity_seconds(tiny(n_layer=2), token_set(n=n_seqs, t=12), 2, {"cka_batch": 8}) > 0
    assert seen == [form, form]
