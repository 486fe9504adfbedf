"""Contributions and block-Jacobian identity deviation (depthtools.analysis.contrib)."""

import pytest
import torch

from depthtools.analysis.contrib import block_map, contributions, deviation_of, jvp

from tiny_models import one_thread, tiny as tiny_model, windows  # noqa: F401 (fixture)


def tiny(arch="preln", n_layer=4, seed=0):
    """As initialised, float32 (the tolerances below are float32's)."""
    return tiny_model(arch, n_layer, vocab=40, context=32, seed=seed, at_init=True)


def token_set(n=2, t=8, seed=1):
    return windows(n, t + 1, seed, vocab=40)


def rows(df, metric):
    return df[df.metric == metric].sort_values("layer").value.tolist()


def test_additive_split_where_the_identity_holds_and_fallback_where_not():
    tokens = token_set()
    pre = contributions(tiny("preln"), tokens, jacobian=False)
    assert rows(pre, "additive") == [1.0] * 4
    assert len(rows(pre, "attn_relative")) == 4 and len(rows(pre, "mlp_cosine")) == 4
    post = contributions(tiny("postln"), tokens, jacobian=False)  # Norm(h + f(h)): not additive
    assert rows(post, "additive") == [0.0] * 4
    assert rows(post, "attn_relative") == [] and any("split unavailable" in n for n in post.attrs["notes"])
    # the total relative contribution is still reported, and equals a direct computation
    model = tiny("preln")
    with torch.no_grad():
        z = model.run_states(tokens[:, :-1])
    r0 = ((z[1] - z[0]).norm(dim=-1) / z[0].norm(dim=-1))[:, 1:].mean()
    assert rows(pre, "relative_contribution")[0] == pytest.approx(float(r0), rel=1e-5)


def test_zero_block_has_zero_jacobian_deviation_and_contribution():
    model = tiny("preln")
    with torch.no_grad():
        model.blocks[2].attn.w_o.weight.zero_()
        model.blocks[2].mlp.w2.weight.zero_()
    df = contributions(model, token_set(), probes=2)
    dev = rows(df, "jacobian_deviation")
    assert dev[2] == pytest.approx(0.0, abs=1e-10)
    assert all(d > 1e-4 for i, d in enumerate(dev) if i != 2)
    assert rows(df, "relative_contribution")[2] == 0.0
    assert set(df[df.metric == "jacobian_deviation"].jacobian_method) == {"jvp"}


@pytest.mark.parametrize("arch", ["preln", "hc", "mhc"])
def test_jvp_deviation_matches_an_explicit_jacobian(arch):
    model, inputs, k = tiny(arch, n_layer=2), token_set(n=1, t=5)[:, :-1], 1
    with torch.no_grad():
        state = model.run_states(inputs)[1]
    x, f = block_map(model, 1, state)
    v = torch.randn(x.shape, generator=torch.Generator().manual_seed(0))
    v[:, :k] = 0
    Jv, method = jvp(model, f, x, v)
    J = torch.autograd.functional.jacobian(f, x).reshape(x.numel(), x.numel())  # reverse mode, explicit
    ref = (J @ v.reshape(-1)).reshape(x.shape)
    tol = 1e-4 if method == "jvp" else 2e-3
    assert torch.allclose(Jv, ref, rtol=tol, atol=tol * float(ref.abs().max()))
    assert float(deviation_of(Jv, v, k)) == pytest.approx(float(deviation_of(ref, v, k)), rel=10 * tol)
    assert method == "jvp"  # mHC too: under forward AD its connector takes the plain-autograd reference


def test_non_tensor_state_reports_nan_with_a_note():
    df = contributions(tiny("denseformer", n_layer=2), token_set(), probes=1)
    assert all(d != d for d in rows(df, "jacobian_deviation"))
    assert any("Jacobian deviation unavailable" in n for n in df.attrs["notes"])
    assert len(rows(df, "relative_contribution")) == 2
