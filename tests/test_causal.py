"""Causal skip-effect scores (depthtools.analysis.causal) against slow, independent references."""

import math

import pytest
import torch

from depthtools.analysis.causal import causal_scores, causal_summary, default_cuts, late_start
from depthtools.analysis.geometry import pair_matrix
from depthtools.arch import Plan

from tiny_models import one_thread, tiny as tiny_model, windows  # noqa: F401 (fixture)


def tiny(arch="preln", n_layer=4, seed=0, **options):
    """As initialised, float32 (the references below cast to float64 themselves)."""
    return tiny_model(arch, n_layer, vocab=40, context=32, seed=seed, at_init=True, **options)


def token_set(n=3, t=10, seed=1):
    return windows(n, t + 1, seed, vocab=40)


def zero_block(model, b):
    with torch.no_grad():
        model.blocks[b].attn.w_o.weight.zero_()
        model.blocks[b].mlp.w2.weight.zero_()


def naive_causal(model, tokens, exclude_first=1, rule=None):
    """C(s,l) from full re-runs of every skipped model and a loop over tokens (float64)."""
    inputs = tokens[:, :-1]
    L = model.n_layer
    with torch.no_grad():
        g = [model.geometry(z).double() for z in model.run_states(inputs)]
        C = torch.full((L, L), math.nan, dtype=torch.float64)
        for s in range(L):
            gs = [model.geometry(z).double() for z in model.run_states(inputs, plan=Plan.skipping(s, rule=rule))]
            for l in range(s + 1, L):
                vals = []
                for b in range(inputs.shape[0]):
                    for t in range(exclude_first, inputs.shape[1]):
                        u, us = g[l + 1][b, t] - g[l][b, t], gs[l + 1][b, t] - gs[l][b, t]
                        num = torch.linalg.vector_norm(us - u)
                        vals.append(0.0 if num == 0 else float(num / torch.linalg.vector_norm(u)))
                C[s, l] = sum(vals) / len(vals)
    return C


@pytest.mark.parametrize("arch", ["preln", "hc", "attnres"])
def test_causal_matrix_equals_naive_full_reruns(arch):
    model, tokens = tiny(arch), token_set()
    df = causal_scores(model, tokens, batch_size=2, future=False)
    got = pair_matrix(df, "causal_score")[:4, :4]
    ref = naive_causal(model, tokens)
    for s in range(4):
        for l in range(s + 1, 4):
            assert got[s, l] == pytest.approx(float(ref[s, l]), rel=1e-4, abs=1e-6)
    assert set(df.loc[df.metric == "causal_score", "layer"]) == {0, 1, 2}


def test_skipping_a_zero_branch_block_has_zero_causal_score():
    model = tiny("preln")
    zero_block(model, 1)
    df = causal_scores(model, token_set(), future=True, cuts=[4, 7])
    for metric in ("causal_score", "causal_score_max", "future_effect"):
        rows = df[(df.metric == metric) & (df.layer == 1)]
        assert len(rows) == 2 and (rows.value == 0).all(), metric
    other = df[(df.metric == "causal_score") & (df.layer == 0) & (df.layer_j != 1)]  # block 1 writes 0: 0/0 -> 0
    assert len(other) == 2 and (other.value > 0).all()


def test_future_effect_matches_a_hook_reference():
    """Pre-LN: skipping block s at positions < cut = resid_post := resid_pre there (a hook edit)."""
    model, tokens = tiny("preln", n_layer=3), token_set(n=2, t=9)
    inputs, s, cut = tokens[:, :-1], 0, 5
    df = causal_scores(model, tokens, future=True, cuts=[cut])
    with torch.no_grad():
        g = [model.geometry(z) for z in model.run_states(inputs)]
        store = {}

        def keep_pre(t, hook):
            store["pre"] = t

        def patch_post(t, hook):
            out = t.clone()
            out[:, 1:cut] = store["pre"][:, 1:cut]
            return out

        with model.hooks(fwd_hooks=[(f"blocks.{s}.hook_resid_pre", keep_pre), (f"blocks.{s}.hook_resid_post", patch_post)]):
            gp = [model.geometry(z) for z in model.run_states(inputs)]
    for l in (1, 2):
        u, up = g[l + 1] - g[l], gp[l + 1] - gp[l]
        ref = ((up - u).norm(dim=-1) / u.norm(dim=-1))[:, cut:].mean()
        got = df[(df.metric == "future_effect") & (df.layer == s) & (df.layer_j == l)].value.item()
        assert got == pytest.approx(float(ref), rel=1e-4)


def test_future_effect_unsupported_state_is_nan_with_a_note():
    df = causal_scores(tiny("attnres"), token_set(), future=True, cuts=[5])
    assert df[df.metric == "future_effect"].value.isna().all()
    assert any("unsupported" in n for n in df.attrs["notes"])
    assert df[df.metric == "causal_score"].value.notna().all()


def test_summary_formulas_on_a_handmade_matrix():
    L = 4
    C = torch.full((L, L), math.nan, dtype=torch.float64)
    values = {(0, 1): 0.9, (0, 2): 0.1, (0, 3): 0.2, (1, 2): 0.5, (1, 3): 0.3, (2, 3): 0.6}
    for k, v in values.items():
        C[k] = v
    out = causal_summary(C, threshold=0.45, late_fraction=0.75)
    assert late_start(L) == 1  # last 3/4 of 4 blocks: 1, 2, 3
    assert out["late_pair_fraction"] == pytest.approx(2 / 3)  # (1,2)=0.5, (1,3)=0.3, (2,3)=0.6
    di = [(0.9 + 0.1 + 0.2) / 3, (0.5 + 0.3) / 2, 0.6]
    assert out["global_score"] == pytest.approx(sum(di) / L / math.sqrt(L))
    assert out["downstream_influence_second_half"] == pytest.approx(0.6)
    assert default_cuts(64) == [8, 24, 40, 56] and default_cuts(10) == [5]
