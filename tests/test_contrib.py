"""Contributions and block-Jacobian identity deviation (depthtools.analysis.contrib)."""

import pytest
import torch

from depthtools.analysis.contrib import block_map, contributions, deviation_of, jvp, jvps, rademacher
from depthtools.arch.registry import list_archs

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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_additive_split_holds_in_low_precision_and_post_ln_still_fails(dtype):
    """In bfloat16/float16 the residual sums round (relative ~eps of the dtype), so comparing with the exact sum
    called every Pre-LN block non-additive; compared with the sums rounded as the model rounds them, the
    split holds (attention/MLP norms within the dtype's rounding of the float32 model's), and Post-LN -- whose
    Norm(h + f(h)) at init misses the identity by less than a bfloat16 rounding -- still has none."""
    tokens = token_set()
    model = tiny("preln")
    with torch.no_grad():  # off the init, so attention and MLP outputs are not ~0
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    f32 = contributions(model, tokens, jacobian=False)
    low = contributions(model.to(dtype), tokens, jacobian=False)
    assert rows(low, "additive") == [1.0] * 4
    eps = torch.finfo(dtype).eps
    for metric in ("attn_relative", "mlp_relative"):
        assert rows(low, metric) == pytest.approx(rows(f32, metric), rel=16 * eps)
    post = contributions(tiny("postln").to(dtype), tokens, jacobian=False)
    assert rows(post, "additive") == [0.0] * 4


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


BATCHED_CASES = [(spec.name, {}) for spec in list_archs()] + [
    ("preln", dict(moe_experts=4, moe_top_k=2, moe_shared_ff=16, moe_layers="mdm")),  # experts: routed rows
    ("preln", dict(parallel=True, qk_norm="head", sliding_window=4, layer_types="sfs")),  # parallel residual, per-head QK-norm, sliding window
]


@pytest.mark.parametrize("arch,options", BATCHED_CASES, ids=[f"{a}{'-' + '-'.join(o) if o else ''}"
                                                           for a, o in BATCHED_CASES])
def test_batched_probes_give_each_probe_what_it_gets_alone(arch, options):
    """`jvps` (the probes batched by vmap, the primal run once) against `jvp` per probe, the path it replaces: the
    same numbers on every architecture whose state a JVP is defined for (float64, so a reordered sum would show)."""
    model = tiny_model(arch, n_layer=3, vocab=40, context=32, seed=0, **options)
    inputs = token_set(n=2, t=9)[:, :-1]
    with torch.no_grad():
        states = model.run_states(inputs)
    checked = 0
    for position in range(model.n_layer):
        mapped = block_map(model, position, states[position])
        if mapped is None:
            continue
        x, f = mapped
        gen = torch.Generator().manual_seed(position)
        vs = torch.stack([rademacher(x, gen, 1) for _ in range(3)])
        batched, method = jvps(model, f, x, vs)
        alone = [jvp(model, f, x, v) for v in vs]
        assert method == alone[0][1]
        for got, (want, _) in zip(batched, alone):
            assert torch.allclose(got, want, rtol=1e-12, atol=1e-12 * float(want.abs().max())), (arch, position)
        checked += 1
    assert checked == (model.n_layer if torch.is_tensor(states[0]) else 0)  # a JVP is defined on tensor states


def test_no_probes_gives_no_jacobian_deviation():
    """probes=0: nothing to batch, so the deviation is NaN (no error from stacking no probes)."""
    df = contributions(tiny("preln", n_layer=2), token_set(), probes=0)
    assert all(d != d for d in rows(df, "jacobian_deviation"))
    assert len(rows(df, "relative_contribution")) == 2
