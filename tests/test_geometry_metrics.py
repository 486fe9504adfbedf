"""Depth-state similarity and geometry (depthtools.analysis.geometry) against direct computations."""

import pytest
import torch

from depthtools.analysis.geometry import depth_similarity, pair_matrix
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
