"""Native routing statistics (depthtools.analysis.routing) at known initialisations."""

import math

import pytest
import torch

from depthtools.analysis.routing import consumer_stats, routing_matrix, routing_stats

from tiny_models import one_thread, tiny as tiny_model, windows  # noqa: F401 (fixture)


def tiny(arch, n_layer=3, **options):
    """As initialised (the routing at init is what these tests know), float32."""
    return tiny_model(arch, n_layer, vocab=40, context=32, at_init=True, **options)


TOKENS = windows(2, 9, seed=1, vocab=40)


def lower_triangle(W):
    return [(c, i) for c in range(W.shape[0]) for i in range(c + 1)]


@pytest.mark.parametrize("options", [{}, {"head_mixer": True}])
def test_unfolded_hc_matrix_at_init_is_the_preln_pattern(options):
    model = tiny("hc", **options)
    df = routing_stats(model, TOKENS)
    W = routing_matrix(df)
    assert W.shape == (7, 7)
    for c, i in lower_triangle(W):  # every consumer reads every earlier source with weight 1
        assert W[c, i].item() == pytest.approx(1.0, abs=1e-9)
    assert torch.isnan(W[0, 1])  # no source from the future
    final = df[(df.metric == "routing_weight") & (df.layer == 6)]
    assert set(final.consumer_kind) == {"final"}


def test_unfolded_hc_matrix_follows_edited_connections():
    """Zero the depth weight β of sublayer 0 (block 0 attention): nobody reads its output any more."""
    model = tiny("hc")
    with torch.no_grad():
        model.blocks[0].attn_hc.static_beta.zero_()
        model.blocks[0].attn_hc.beta_scale.zero_()
    W = routing_matrix(routing_stats(model, TOKENS))
    assert all(W[c, 1].item() == pytest.approx(0.0, abs=1e-12) for c in range(1, 7))
    assert W[3, 0].item() == pytest.approx(1.0, abs=1e-9)


@pytest.mark.parametrize("arch", ["attnres", "blockattnres"])
def test_attnres_maps_at_zero_queries_are_uniform(arch):
    model = tiny(arch, n_layer=4)
    W = routing_matrix(routing_stats(model, TOKENS))
    for c in range(W.shape[0]):
        row = W[c][~torch.isnan(W[c])]
        assert len(row) >= 1
        assert torch.allclose(row, torch.full_like(row, 1.0 / len(row)), atol=1e-6), c
    if arch == "attnres":  # Full AttnRes: consumer c reads all c+1 sources
        assert [int((~torch.isnan(W[c])).sum()) for c in range(9)] == list(range(1, 10))


def test_denseformer_init_reads_only_the_newest_state():
    df = routing_stats(tiny("denseformer"), TOKENS)
    W = routing_matrix(df)
    for c in (2, 4, 6):
        assert W[c, c].item() == 1.0 and (W[c, :c][~torch.isnan(W[c, :c])] == 0).all()
    assert df[df.metric == "mean_source_lag"].value.tolist() == [1.0, 1.0, 1.0]


def test_architecture_without_routing_gives_an_empty_table_with_a_note():
    df = routing_stats(tiny("preln"), TOKENS)
    assert df.empty and "no native depth routing" in df.attrs["notes"][0]


def test_consumer_statistics_on_a_handmade_row():
    row = torch.tensor([0.1, 0.0, 0.2, 0.3, 0.4] + [math.nan] * 2, dtype=torch.float64)
    stats = consumer_stats(4, row, long_range_k=2)  # lags: source i -> 4 - i + 1 = 5, 4, 3, 2, 1
    assert stats["mean_source_lag"] == pytest.approx(0.1 * 5 + 0.2 * 3 + 0.3 * 2 + 0.4 * 1)
    assert stats["long_range_mass"] == pytest.approx(0.3)  # lag > 2: sources 0 and 2
    assert stats["max_weight"] == pytest.approx(0.4)
    assert stats["source_entropy"] == pytest.approx(-sum(p * math.log(p) for p in (0.1, 0.2, 0.3, 0.4)))


@pytest.mark.parametrize("order", ["rows_last", "cols_last"])
def test_mhc_reports_the_sinkhorn_doubly_stochastic_residual(order):
    """Per sublayer, max |row sum - 1| and max |column sum - 1| of the 20-round Sinkhorn result over
    all tokens, equal to the sums of the hooked H_res; the order's last normalisation is exact."""
    model = tiny("mhc", n_layer=2, sinkhorn_order=order)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias_res", "phi_res")):  # strong, token-dependent logits: 20 rounds do not converge
                p.add_(4 * torch.randn(p.shape, generator=gen))
    df = routing_stats(model, TOKENS)
    _, cache = model.run_with_cache(TOKENS[:, :-1])  # (caching every hook runs attention unfused: ~1e-9 apart)
    rows = {m: df[df.metric == m].set_index("layer")["value"] for m in ("sinkhorn_row_error", "sinkhorn_col_error")}
    for j in range(4):
        R = cache[f"blocks.{j // 2}.{('attn', 'mlp')[j % 2]}_hc.hook_res_weights"].double()  # [B,T,n,n]
        assert rows["sinkhorn_row_error"][j] == pytest.approx(float((R.sum(-1) - 1).abs().max()), abs=1e-7)
        assert rows["sinkhorn_col_error"][j] == pytest.approx(float((R.sum(-2) - 1).abs().max()), abs=1e-7)
    exact, loose = ("row", "col") if order == "rows_last" else ("col", "row")
    top = {k: float(df[df.metric == f"sinkhorn_{k}_error_max"].value.iloc[0]) for k in ("row", "col")}
    assert top[exact] <= 1e-6 and top[loose] > 1e-4, top
    assert top["row"] == max(rows["sinkhorn_row_error"]) and top["col"] == max(rows["sinkhorn_col_error"])
    assert not routing_stats(tiny("hc", n_layer=2), TOKENS).metric.str.startswith("sinkhorn").any()  # HC's R is free


def test_normed_sum_final_consumer_reads_the_final_norms_per_stream_scale():
    """Issue 44: under readout "normed_sum" the head reads Σ_s ln_final(H_s) = γ ⊙ Σ_s H_s/rms(H_s) (HC's
    final norm is an RMSNorm), not the plain stream sum; the routing's final row weights the streams by those
    1/rms(H_s) (checked here against the model's own head), so it is not the uniform-weight row of "sum"."""
    from tiny_models import tiny as perturbed

    model = perturbed("hc", n_layer=2, vocab=40, context=32, readout="normed_sum").double()
    states = model.run_states(TOKENS)
    H = states[-1]  # [B,T,n,d]
    w = model.scheme.final_weights(H, model.ln_final)  # [B,T,n]
    expected = model.ln_final.weight * (w.unsqueeze(-1) * H).sum(-2)
    torch.testing.assert_close(expected, model.scheme.final_hidden(H, model.ln_final), rtol=1e-12, atol=1e-12)
    ns = routing_matrix(routing_stats(model, TOKENS))
    plain = perturbed("hc", n_layer=2, vocab=40, context=32, readout="sum").double()
    W = routing_matrix(routing_stats(plain, TOKENS))
    torch.testing.assert_close(ns[:-1], W[:-1], equal_nan=True)  # same weights, so the same inner consumers
    assert torch.isfinite(ns[-1]).all() and (ns[-1] - W[-1]).abs().max() > 1e-4
