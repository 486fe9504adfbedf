"""HC and mHC (depthtools/arch/hyper.py): init equivalence with Pre-LN, the paper equations as a
slow per-token reference, Sinkhorn, skip/swap semantics, hooks, options and bookkeeping.

The references below are written from the equations in docs/reference/architectures.md §3.1-3.2
and read only parameters from the library (plus the shared backbone: embedding, attention, MLP,
norms, head).
"""

import copy
import math

import pytest
import torch

from depthtools.arch import DepthModel, Plan, get_arch
from depthtools.arch.hyper import sinkhorn_knopp, sinkhorn_residuals
from depthtools.config import ModelConfig
from depthtools.errors import DepthToolsError

VOCAB = 37


def config(arch: str, n_layer: int = 3, d_model: int = 16, **options) -> ModelConfig:
    return ModelConfig(arch=arch, vocab_size=VOCAB, d_model=d_model, n_layer=n_layer, n_heads=2,
                       max_seq_len=16, options=options)


def tokens(batch: int = 2, length: int = 7, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def perturb(model: DepthModel, backbone: float = 0.05, routing: float = 0.3) -> None:
    """Move every parameter off its init: routing parameters strongly, so dynamic terms matter."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = routing if ("_hc." in name or name.startswith("scheme.")) else backbone
            p.add_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))


def model_for(arch: str, seed: int = 0, n_layer: int = 3, **options) -> DepthModel:
    return DepthModel(config(arch, n_layer, **options), seed=seed).double().eval()


def hc_with_preln_weights(arch: str, norm_eps: float = 1e-5, **options):
    """(Pre-LN model, HC/mHC model carrying the same backbone weights)."""
    cfg = config("preln").replace(norm_eps=norm_eps)
    preln = DepthModel(cfg, seed=0).double().eval()
    perturb(preln, backbone=0.05, routing=0.0)  # non-trivial norm gains too
    multi = DepthModel(cfg.replace(arch=arch, options={"scale_output_init_by_sqrt_n": False, **options}),
                       seed=1).double().eval()
    missing, unexpected = multi.load_state_dict(preln.state_dict(), strict=False)
    assert not unexpected and missing and all("_hc." in k or k.startswith("scheme.") for k in missing)
    return preln, multi


# -- init equivalence with Pre-LN ----------------------------------------------------------------

def test_hc_at_init_is_preln_stream_for_stream():
    """S_m = e_k, S_r = I, S_b = 1, dynamic 0: every stream is exactly the Pre-LN residual stream."""
    preln, hc = hc_with_preln_weights("hc")
    toks = tokens()
    for h, H in zip(preln.run_states(toks), hc.run_states(toks)):
        assert H.shape[-2] == 4
        torch.testing.assert_close(H, h.unsqueeze(-2).expand_as(H), rtol=0, atol=1e-12)
    # logits: FinalNorm(Σ_s H_s) = FinalNorm(4h) equals FinalNorm(h) up to the final norm's eps
    torch.testing.assert_close(hc.unembed(hc.ln_final(hc.readout(H) / 4)), preln(toks), rtol=0, atol=1e-12)


def test_hc_at_init_logits_equal_preln_up_to_norm_eps():
    preln, hc = hc_with_preln_weights("hc", norm_eps=1e-12)
    toks = tokens()
    torch.testing.assert_close(hc(toks), preln(toks), rtol=0, atol=1e-9)


@pytest.mark.parametrize("init", ["hc_like", "uniform"])
def test_mhc_with_zero_projections_is_preln(init):
    """phi = 0: H_pre·H = c·h (the pre-norm removes c, up to eps), H_post = 2σ(0) = 1, and H_res is
    symmetric with equal rows, hence exactly doubly stochastic: identical streams stay identical.
    hc_like: c = σ(8) + 3σ(-8) = 1 + 2σ(-8); uniform: c = 4·σ(0) = 2."""
    preln, mhc = hc_with_preln_weights("mhc", norm_eps=1e-12, mhc_init=init)
    with torch.no_grad():
        for name, p in mhc.named_parameters():
            if ".phi_" in name:
                p.zero_()
    toks = tokens()
    for h, H in zip(preln.run_states(toks), mhc.run_states(toks)):
        torch.testing.assert_close(H, h.unsqueeze(-2).expand_as(H), rtol=0, atol=1e-9)
    torch.testing.assert_close(mhc(toks), preln(toks), rtol=0, atol=1e-9)


def test_mhc_hc_like_default_eps_deviation_is_the_predicted_eps_effect():
    """With the default eps 1e-5 the streams deviate from Pre-LN only through RMSNorm(c·u) vs
    RMSNorm(u): relative size eps(1 - 1/c²)/(2·ms(u)) with c - 1 = 2σ(-8) ≈ 6.7e-4 and ms(u) ≈ 4e-4
    (embedding std 0.02), i.e. ≈ 2e-5 of the branch input; tolerance 1e-4 of the logit scale. (The
    final norm's own eps effect, FinalNorm(4h) vs FinalNorm(h), is removed by reading sum/4.)"""
    preln, mhc = hc_with_preln_weights("mhc")
    toks = tokens()
    reference = preln(toks)
    lens = mhc.unembed(mhc.ln_final(mhc.readout(mhc.run_states(toks)[-1]) / 4))
    diff = (lens - reference).abs().max().item()
    assert 0 < diff < 1e-4 * reference.abs().max().item()


def test_output_init_scaled_by_sqrt_n_by_default():
    preln = DepthModel(config("preln"), seed=0)
    for arch, n in (("hc", 4), ("mhc", 3)):
        scaled = DepthModel(config(arch, n_streams=n), seed=0)
        plain = DepthModel(config(arch, n_streams=n, scale_output_init_by_sqrt_n=False), seed=0)
        for b_ref, b_scaled, b_plain in zip(preln.blocks, scaled.blocks, plain.blocks):
            for ref, s, p in ((b_ref.attn.w_o, b_scaled.attn.w_o, b_plain.attn.w_o),
                              (b_ref.mlp.w2, b_scaled.mlp.w2, b_plain.mlp.w2)):
                torch.testing.assert_close(s.weight, ref.weight / math.sqrt(n))
                assert torch.equal(p.weight, ref.weight)
            assert torch.equal(b_scaled.attn.w_q.weight, b_ref.attn.w_q.weight)


def test_init_values_follow_the_papers():
    hc = DepthModel(config("hc", n_layer=3), seed=0)
    for b, block in enumerate(hc.blocks):
        for sub, conn in enumerate((block.attn_hc, block.mlp_hc)):
            k = (2 * b + sub) % 4
            assert torch.equal(conn.static_alpha[:, 0], torch.eye(4)[k])
            assert torch.equal(conn.static_alpha[:, 1:], torch.eye(4))
            assert torch.equal(conn.static_beta, torch.ones(4))
            assert not conn.dynamic_alpha.any() and not conn.dynamic_beta.any()
            assert conn.alpha_scale.item() == conn.beta_scale.item() == pytest.approx(0.01)
    mhc = DepthModel(config("mhc", n_layer=3), seed=0)
    conn = mhc.blocks[1].mlp_hc  # sublayer index 3 -> selected stream 3
    assert torch.equal(conn.bias_pre, torch.tensor([-8.0, -8.0, -8.0, 8.0]))
    assert torch.equal(conn.bias_res, 16 * torch.eye(4) - 8)
    assert not conn.bias_post.any() and not conn.phi_res.any()
    uniform = DepthModel(config("mhc", mhc_init="uniform"), seed=0).blocks[0].attn_hc
    assert 0.015 < uniform.phi_res.std().item() < 0.025 and not uniform.bias_res.any()
    luci = DepthModel(config("mhc", mhc_init="lucidrains"), seed=0).blocks[0].mlp_hc
    assert torch.equal(luci.bias_pre, torch.eye(4)[1]) and torch.equal(luci.bias_post, torch.ones(4))
    assert torch.equal(luci.bias_res, torch.eye(4))


# -- the paper equations as a slow per-token reference --------------------------------------------

def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean() + eps)


def hc_token(conn, Ht: torch.Tensor, eps: float):
    """HC Eq. for one token: A_m [n], A_r [n,n] (rows = input streams), B [n]."""
    n = Ht.shape[0]
    A_m, A_r, B = torch.zeros(n), torch.zeros(n, n), torch.zeros(n)
    A_m, A_r, B = A_m.to(Ht), A_r.to(Ht), B.to(Ht)
    gain = conn.norm_gain if conn.norm_gain is not None else 1.0  # option connector_norm_gain
    for s in range(n):
        hbar = rms(Ht[s], eps) * gain
        A_m[s] = conn.static_alpha[s, 0] + conn.alpha_scale * torch.tanh(hbar @ conn.dynamic_alpha[:, 0])
        for j in range(n):
            A_r[s, j] = conn.static_alpha[s, 1 + j] + conn.alpha_scale * torch.tanh(hbar @ conn.dynamic_alpha[:, 1 + j])
        B[s] = conn.static_beta[s] + conn.beta_scale * torch.tanh(hbar @ conn.dynamic_beta)
    u = sum(A_m[s] * Ht[s] for s in range(n))
    return u, lambda y: torch.stack([sum(A_r[s, j] * Ht[s] for s in range(n)) + B[j] * y for j in range(n)])


def T_r(M: torch.Tensor) -> torch.Tensor:
    """Row normalisation (rows = output streams o: Σ_i M[o,i] = 1)."""
    return M / M.sum(dim=-1, keepdim=True)


def T_c(M: torch.Tensor) -> torch.Tensor:
    """Column normalisation (Σ_o M[o,i] = 1)."""
    return M / M.sum(dim=-2, keepdim=True)


def paper_sinkhorn(logits: torch.Tensor, t_max: int = 20, order: str = "rows_last") -> torch.Tensor:
    """mHC Eq. 9: M(0) = exp(H̃), M(t) = T_r(T_c(M(t-1))); "cols_last" is the reverse, T_c(T_r(.))."""
    M = torch.exp(logits)
    for _ in range(t_max):
        M = T_r(T_c(M)) if order == "rows_last" else T_c(T_r(M))
    return M


def mhc_token(conn, Ht: torch.Tensor, eps: float):
    """mHC Eq. for one token (paper orientation H_res·H, row-major mat())."""
    n = Ht.shape[0]
    x = rms(Ht.reshape(-1), eps)  # vec(H): stream s occupies x[s·d:(s+1)·d]
    pre = torch.sigmoid(conn.gate_pre * (x @ conn.phi_pre) + conn.bias_pre)
    post = 2 * torch.sigmoid(conn.gate_post * (x @ conn.phi_post) + conn.bias_post)
    res_logits = torch.stack([torch.stack([conn.gate_res * (x @ conn.phi_res[:, o * n + i]) + conn.bias_res[o, i]
                                           for i in range(n)]) for o in range(n)])
    H_res = paper_sinkhorn(res_logits, conn.t_max, conn.order)
    u = sum(pre[s] * Ht[s] for s in range(n))
    return u, lambda y: torch.stack([sum(H_res[o, i] * Ht[i] for i in range(n)) + post[o] * y for o in range(n)])


def head_mixer_token(scheme, Ht: torch.Tensor, eps: float) -> torch.Tensor:
    x = rms(Ht.reshape(-1), eps)
    p = torch.sigmoid(scheme.head_scale * (scheme.head_fn @ x) + scheme.head_base) + 1e-6
    return sum(p[s] * Ht[s] for s in range(Ht.shape[0]))


@torch.no_grad()
def reference_logits(model: DepthModel, toks: torch.Tensor, token_fn, eps: float, n: int) -> torch.Tensor:
    x0 = model.tok_embed(toks)  # [B,T,d]
    Bsz, T, d = x0.shape
    H = x0.unsqueeze(2).repeat(1, 1, n, 1)  # n copies
    rope = (model.rope_cos, model.rope_sin)
    for block in model.blocks:
        for conn, norm, f in ((block.attn_hc, block.attn_norm, lambda x: block.attn(x, *rope)),
                              (block.mlp_hc, block.mlp_norm, block.mlp)):
            U, updates = torch.zeros_like(x0), {}
            for b in range(Bsz):
                for t in range(T):
                    U[b, t], updates[b, t] = token_fn(conn, H[b, t], eps)
            Y = f(norm(U))  # the sublayer runs on all tokens at once (attention mixes them)
            H = torch.stack([torch.stack([updates[b, t](Y[b, t]) for t in range(T)]) for b in range(Bsz)])
    if model.scheme.head_fn is None:
        r = H.sum(2)
    else:
        r = torch.stack([torch.stack([head_mixer_token(model.scheme, H[b, t], eps) for t in range(T)])
                         for b in range(Bsz)])
    return model.unembed(model.ln_final(r))


@pytest.mark.parametrize("n,gain", [(4, False), (3, False), (4, True)])
def test_hc_matches_per_token_reference(n, gain):
    model = model_for("hc", n_layer=2, n_streams=n, connector_norm_eps=1e-8, connector_norm_gain=gain)
    perturb(model)  # (moves the gains off 1 too)
    toks = tokens(length=5)
    torch.testing.assert_close(model(toks), reference_logits(model, toks, hc_token, 1e-8, n), rtol=0, atol=1e-10)


@pytest.mark.parametrize("n,head_mixer,order", [(4, False, "rows_last"), (3, True, "rows_last"), (4, False, "cols_last")])
def test_mhc_matches_per_token_reference(n, head_mixer, order):
    model = model_for("mhc", n_layer=2, n_streams=n, head_mixer=head_mixer, connector_norm_eps=1e-6,
                      sinkhorn_order=order)
    perturb(model)
    toks = tokens(length=5)
    torch.testing.assert_close(model(toks), reference_logits(model, toks, mhc_token, 1e-6, n), rtol=0, atol=1e-10)


def test_hc_head_mixer_matches_reference():
    model = model_for("hc", n_layer=1, head_mixer=True, connector_norm_eps=1e-8)
    perturb(model)
    toks = tokens(length=4)
    torch.testing.assert_close(model(toks), reference_logits(model, toks, hc_token, 1e-8, 4), rtol=0, atol=1e-10)


# -- Sinkhorn -------------------------------------------------------------------------------------

def assert_doubly_stochastic(M: torch.Tensor, tol: float = 1e-5) -> None:
    assert M.dtype == torch.float32 and (M >= 0).all()
    ones = torch.ones(M.shape[:-1])
    torch.testing.assert_close(M.sum(-1), ones, rtol=0, atol=tol)
    torch.testing.assert_close(M.sum(-2), ones, rtol=0, atol=tol)


def test_sinkhorn_is_doubly_stochastic_in_float32_also_for_bf16_input():
    """t_max = 20 rounds converge to 1e-5 for well-conditioned logits (the init's ±8 gap plus noise,
    or logits of spread ~0.5); for spread ≳ 1 the columns of a 20-round result can still be off by
    1e-3..1e-1 (the mHC definition is the 20-round map, not the exact projection). Rows are
    normalised last (the paper's Eq. 9; "cols_last": columns), so they always sum to 1."""
    gen = torch.Generator().manual_seed(0)
    for logits in (0.5 * torch.randn(64, 9, 4, 4, generator=gen),
                   16 * torch.eye(4) - 8 + 0.3 * torch.randn(64, 9, 4, 4, generator=gen)):
        assert_doubly_stochastic(sinkhorn_knopp(logits))
        assert_doubly_stochastic(sinkhorn_knopp(logits.bfloat16()))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert_doubly_stochastic(sinkhorn_knopp(logits.bfloat16()))
    strong = 4 * torch.randn(64, 4, 4, generator=gen)
    torch.testing.assert_close(sinkhorn_knopp(strong).sum(-1), torch.ones(64, 4), rtol=0, atol=1e-6)
    torch.testing.assert_close(sinkhorn_knopp(strong, order="cols_last").sum(-2), torch.ones(64, 4), rtol=0, atol=1e-6)
    assert_doubly_stochastic(sinkhorn_knopp(torch.tensor([[8.0, -8.0], [-8.0, 8.0]])))
    assert torch.isfinite(sinkhorn_knopp(torch.tensor([[200.0, -200.0], [0.0, 0.0]]))).all()
    assert sinkhorn_knopp(torch.zeros(0, 3, 3)).shape == (0, 3, 3)


@pytest.mark.parametrize("order", ["rows_last", "cols_last"])
def test_sinkhorn_matches_paper_iteration_and_its_gradient(order):
    """Forward and backward of the fused Sinkhorn follow the chosen order: against the plain-autograd
    loop of T_r/T_c (1e-12) and finite differences (gradcheck, float64)."""
    logits = torch.randn(3, 5, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    logits.requires_grad_(True)
    out = sinkhorn_knopp(logits, order=order)
    paper = torch.stack([torch.stack([paper_sinkhorn(z, order=order) for z in row]) for row in logits])
    torch.testing.assert_close(out, paper, rtol=0, atol=1e-14)
    g = torch.randn_like(out)
    (fast,) = torch.autograd.grad(out, logits, g)
    (slow,) = torch.autograd.grad(paper, logits, g)
    torch.testing.assert_close(fast, slow, rtol=0, atol=1e-12)
    small = (2 * logits[:1, :2]).detach().requires_grad_()
    assert torch.autograd.gradcheck(lambda z: sinkhorn_knopp(z, 5, order), (small,))
    assert torch.autograd.gradcheck(lambda z: sinkhorn_knopp(z, 2, order), (torch.randn(2, 3, 3, dtype=torch.float64,
                                    generator=torch.Generator().manual_seed(2), requires_grad=True),))


def test_default_sinkhorn_is_eq9_row_stochastic_and_differs_from_the_old_order():
    """Eq. 9 ends with T_r, so the default result is row-stochastic to rounding even where 20 rounds
    have not converged; the old order ("cols_last") is column-stochastic, and for strong logits the
    two 20-round maps differ by up to ~0.05 (logits 4·N(0,1)) or ~0.15 (8·N(0,1))."""
    logits = 4 * torch.randn(256, 4, 4, generator=torch.Generator().manual_seed(5))
    default, old = sinkhorn_knopp(logits), sinkhorn_knopp(logits, order="cols_last")
    row_err, col_err = sinkhorn_residuals(default)
    assert row_err <= 1e-6 and col_err > 1e-3  # rows exact, columns not yet converged
    old_row, old_col = sinkhorn_residuals(old)
    assert old_col <= 1e-6 and old_row > 1e-3
    eq9 = torch.stack([paper_sinkhorn(z) for z in logits.double()])  # independent loop, float64
    torch.testing.assert_close(default.double(), eq9, rtol=0, atol=1e-6)
    assert (default - old).abs().max() > 0.02  # 0.045 here; 0.15 at 8·randn (benchmarks: issue 18)
    with pytest.raises(DepthToolsError, match="rows_last"):
        sinkhorn_knopp(logits, order="rows")


@pytest.mark.parametrize("order", ["rows_last", "cols_last"])
def test_fused_mhc_connector_gradients_match_plain_autograd(order):
    """The fused connector (the op depthtools::mhc_connect, one autograd node with its own Sinkhorn backward)
    against the connector written in plain torch ops with the T_r/T_c loop: outputs and every gradient."""
    from depthtools.arch.hyper import ManifoldHyperConnection

    torch.manual_seed(0)
    n, d, N, eps = 3, 5, 4, 1e-6
    conn = ManifoldHyperConnection(n, d, 1, eps, "uniform", 4, order).double()
    with torch.no_grad():
        for p in conn.parameters():
            p.add_(0.5 * torch.randn_like(p))
    H = torch.randn(N, n, d, dtype=torch.float64, requires_grad=True)
    params = list(conn.parameters())

    def plain(H):
        x = H.reshape(N, n * d)
        x = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
        pre = torch.sigmoid(conn.gate_pre * (x @ conn.phi_pre) + conn.bias_pre)
        post = 2 * torch.sigmoid(conn.gate_post * (x @ conn.phi_post) + conn.bias_post)
        res = paper_sinkhorn((conn.gate_res * (x @ conn.phi_res)).view(N, n, n) + conn.bias_res, 4, order)
        return torch.einsum("ns,nsd->nd", pre, H), torch.einsum("noi,nid->nod", res, H), post

    fused = conn.fused(H)
    reference = plain(H)
    gs = [torch.randn_like(t) for t in reference]
    for a, b in zip(fused, reference):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    got = torch.autograd.grad(fused, [H, *params], gs)
    want = torch.autograd.grad(reference, [H, *params], gs)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)
    assert torch.autograd.gradcheck(lambda H: conn.fused(H), (H.detach()[:2].requires_grad_(),))


def test_sinkhorn_order_is_recorded_and_old_checkpoints_keep_theirs(tmp_path):
    """New mhc models write the resolved order into their config; a config.json saved before the
    option existed (no key) loads as the order it was trained with ("cols_last"), bit for bit."""
    import json

    from depthtools import checkpoint as ck

    fresh = DepthModel(config("mhc"), seed=0)
    assert fresh.config.options["sinkhorn_order"] == "rows_last"
    perturb(fresh)
    ck.save(fresh, tmp_path / "new")
    assert json.loads((tmp_path / "new" / "config.json").read_text())["model"]["options"] == {"sinkhorn_order": "rows_last"}
    toks = tokens()
    with torch.no_grad():
        torch.testing.assert_close(ck.load(tmp_path / "new")(toks), fresh.eval()(toks), rtol=0, atol=0)
    old = DepthModel(config("mhc", sinkhorn_order="cols_last"), seed=0)
    perturb(old)
    ck.save(old, tmp_path / "old")
    file = tmp_path / "old" / "config.json"
    saved = json.loads(file.read_text())
    saved["model"]["options"] = {}  # what a checkpoint written before issue 18 holds
    file.write_text(json.dumps(saved))
    loaded = ck.load(tmp_path / "old")
    assert loaded.config.options == {"sinkhorn_order": "cols_last"}
    with torch.no_grad():
        torch.testing.assert_close(loaded(toks), old.eval()(toks), rtol=0, atol=0)
        assert (loaded(toks) - ck.load(tmp_path / "new")(toks)).abs().max() > 0  # the order matters
    assert DepthModel(config("hc")).config.options == {}  # other architectures record nothing new


# -- HC connector norm gain (option connector_norm_gain) ---------------------------------------------

def test_hc_connector_norm_gain_adds_trained_gains_and_ones_reproduce_the_default():
    plain = model_for("hc", n_layer=2)
    perturb(plain)
    gained = model_for("hc", n_layer=2, connector_norm_gain=True)
    assert not any("norm_gain" in name for name, _ in plain.named_parameters())  # default: no gain (old checkpoints)
    missing, unexpected = gained.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and sorted(missing) == sorted(
        f"blocks.{b}.{side}_hc.norm_gain" for b in range(2) for side in ("attn", "mlp"))
    assert all(torch.equal(getattr(gained.blocks[b], f"{s}_hc").norm_gain, torch.ones(16, dtype=torch.float64))
               for b in range(2) for s in ("attn", "mlp"))
    toks = tokens()
    # gains of one: the same function, bit for bit, on the fused path and the hooked (step-by-step) path
    assert torch.equal(gained(toks), plain(toks))
    _, cache_g = gained.run_with_cache(toks)
    _, cache_p = plain.run_with_cache(toks)
    assert all(torch.equal(cache_g[k], cache_p[k]) for k in cache_p.keys())
    # the gains are trained: every one receives a non-zero gradient, and the shared parameters' gradients are unchanged
    for model in (plain, gained):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(toks).flatten(0, 1), toks.flatten()).backward()
    grads = dict(gained.named_parameters())
    for name, p in plain.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, rtol=0, atol=1e-14)
    gains = [p for name, p in gained.named_parameters() if name.endswith("norm_gain")]
    assert len(gains) == 4 and all(p.grad is not None and p.grad.abs().min() > 0 for p in gains)
    from depthtools.config import TrainConfig
    from depthtools.train.optim import param_groups

    groups, _ = param_groups(gained, TrainConfig(tokens=1000))
    undecayed = {id(p) for g in groups if g["weight_decay"] == 0.0 for p in g["params"]}
    assert all(id(p) in undecayed for p in gains)  # gains, like norm gains, are not weight-decayed
    # a different gain changes the function (it is not a no-op)
    with torch.no_grad():
        gained.blocks[0].attn_hc.norm_gain.mul_(1.5)
    assert (gained(toks) - plain(toks)).abs().max() > 1e-6
    with pytest.raises(DepthToolsError, match="connector_norm_gain"):
        DepthModel(config("hc", connector_norm_gain=1))
    with pytest.raises(DepthToolsError, match="unknown"):
        DepthModel(config("mhc", connector_norm_gain=True))


# -- contract: skip, swap, readout, hooks -----------------------------------------------------------

@pytest.mark.parametrize("arch", ["hc", "mhc"])
def test_branch_skip_equals_zeroed_branch_outputs_and_identity_skip_keeps_streams(arch):
    model = model_for(arch)
    perturb(model)
    toks = tokens()
    states = model.run_states(toks)
    assert model.scheme.skip(1, states[1]) is states[1]  # identity: streams unchanged
    zeroed = copy.deepcopy(model)
    with torch.no_grad():
        zeroed.blocks[1].attn.w_o.weight.zero_()
        zeroed.blocks[1].mlp.w2.weight.zero_()
    branch = model.run(toks, plan=Plan.skipping(1, rule="branch"))
    torch.testing.assert_close(branch, zeroed(toks), rtol=0, atol=1e-12)
    assert not torch.allclose(branch, model.run(toks, plan=Plan.skipping(1)))
    with pytest.raises(DepthToolsError, match="branch"):
        model.run(toks, plan=Plan.skipping(1, rule="mask"))


@pytest.mark.parametrize("arch", ["hc", "mhc"])
def test_swap_moves_every_block_tensor_including_connectors(arch):
    model = model_for(arch)
    perturb(model)
    toks = tokens()
    moved = copy.deepcopy(model)
    first, second = ({k: v.clone() for k, v in moved.blocks[i].state_dict().items()} for i in (0, 2))
    moved.blocks[0].load_state_dict(second)
    moved.blocks[2].load_state_dict(first)
    torch.testing.assert_close(model.run(toks, plan=Plan.swapping(0, 2, 3)), moved(toks), rtol=0, atol=1e-12)


@pytest.mark.parametrize("options", [{"n_streams": 3, "head_mixer": True}, {"n_streams": 2}])
@pytest.mark.parametrize("arch", ["hc", "mhc"])
def test_option_variants_keep_the_contract(arch, options):
    model = model_for(arch, **options)
    perturb(model)
    toks = tokens()
    states = model.run_states(toks)
    assert states[0].shape == (2, 7, options["n_streams"], 16)
    assert model.geometry(states[1]).shape == (2, 7, options["n_streams"] * 16)
    assert torch.equal(model.head(states[-1]), model(toks))
    assert torch.equal(model.run(from_state=states[2], start=2), model(toks))
    model.float().train()
    loss = model(toks).logsumexp(-1).mean()
    loss.backward()
    dead = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not dead


@pytest.mark.parametrize("arch", ["hc", "mhc"])
def test_hooks_expose_streams_weights_and_branch_input(arch):
    model = model_for(arch)
    perturb(model)
    toks = tokens()
    logits, cache = model.run_with_cache(toks)
    assert not model.blocks[0].hook_out_is_single_residual_stream
    assert not any("hook_resid" in name for name in cache.keys())
    B, T, n, d = 2, 7, 4, 16
    for l in range(3):
        assert cache[f"blocks.{l}.hook_streams_pre"].shape == (B, T, n, d)
        assert cache[f"blocks.{l}.attn_hc.hook_res_weights"].shape == (B, T, n, n)
        assert cache[f"blocks.{l}.mlp_hc.hook_width_weights"].shape == (B, T, n)
        assert cache[f"blocks.{l}.mlp_hc.hook_depth_weights"].shape == (B, T, n)
        assert cache[f"blocks.{l}.attn_hc.hook_branch_in"].shape == (B, T, d)
        assert cache[f"blocks.{l}.hook_attn_out"].shape == (B, T, d)
    # the hooked tensors obey the update rule H_mid = R @ H_pre + β ⊗ attn_out, u = Σ w_s H_s
    H_pre, H_mid = cache["blocks.1.hook_streams_pre"], cache["blocks.1.hook_streams_mid"]
    w, R, beta = (cache[f"blocks.1.attn_hc.hook_{k}_weights"] for k in ("width", "res", "depth"))
    torch.testing.assert_close(cache["blocks.1.attn_hc.hook_branch_in"], torch.einsum("bts,btsd->btd", w, H_pre))
    expected = torch.einsum("btos,btsd->btod", R, H_pre) + beta[..., None] * cache["blocks.1.hook_attn_out"][:, :, None]
    torch.testing.assert_close(H_mid, expected)
    torch.testing.assert_close(cache["blocks.0.hook_streams_post"], cache["blocks.1.hook_streams_pre"])
    torch.testing.assert_close(logits, model.head(cache["blocks.2.hook_streams_post"]))
    if arch == "mhc":
        ones = torch.ones(B, T, n, dtype=R.dtype)
        assert torch.allclose(R.sum(-2), ones) and torch.allclose(R.sum(-1), ones)


@pytest.mark.parametrize("arch", ["hc", "mhc"])
def test_editing_hooked_branch_outputs_equals_branch_skip(arch):
    model = model_for(arch)
    perturb(model)
    toks = tokens()
    zero = lambda x, hook: torch.zeros_like(x)  # noqa: E731
    edited = model.run_with_hooks(toks, fwd_hooks=[("blocks.2.hook_attn_out", zero), ("blocks.2.hook_mlp_out", zero)])
    torch.testing.assert_close(edited, model.run(toks, plan=Plan.skipping(2, rule="branch")), rtol=0, atol=1e-12)


def test_mhc_under_bf16_autocast_keeps_routing_in_float32():
    model = DepthModel(config("mhc"), seed=0)
    perturb(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, cache = model.run_with_cache(tokens())
    assert torch.isfinite(logits).all()
    R = cache["blocks.1.mlp_hc.hook_res_weights"]
    assert_doubly_stochastic(R)
    assert cache["blocks.1.hook_streams_post"].dtype == torch.float32


# -- bookkeeping ---------------------------------------------------------------------------------

@pytest.mark.parametrize("arch,options", [
    (arch, options) for arch in ("hc", "mhc") for options in ({}, {"n_streams": 3}, {"n_streams": 2, "head_mixer": True})
] + [("hc", {"connector_norm_gain": True}), ("hc", {"n_streams": 3, "connector_norm_gain": True, "head_mixer": True})])
def test_extra_parameter_formula(arch, options):
    cfg = config(arch, n_layer=2, d_model=24, **options)
    built = DepthModel(cfg).param_counts()["total"]
    base = DepthModel(cfg.replace(arch="preln", options={})).param_counts()["total"]
    assert built - base == get_arch(arch).extra_params(cfg)


def test_registry_entries():
    for name, paper in (("hc", "2409.19606"), ("mhc", "2512.24880")):
        spec = get_arch(name)
        assert spec.family == "multi-stream" and spec.in_depthbench and paper in spec.paper
    d, L = 1024, 24  # docs/reference/architectures.md §3.2: n = 4 gives 2L(96d + 27)
    big = ModelConfig(arch="mhc", d_model=d, n_layer=L, n_heads=16)
    assert get_arch("mhc").extra_params(big) == 2 * L * (96 * d + 27)


@pytest.mark.parametrize("arch", ["hc", "mhc"])
def test_static_routing_parameters_are_excluded_from_weight_decay(arch):
    model = DepthModel(config(arch, head_mixer=True))
    patterns = model.scheme.no_decay_names()
    no_decay = {name for name, _ in model.named_parameters() if any(p in name for p in patterns)}
    static = {"static_alpha", "static_beta", "alpha_scale", "beta_scale"} if arch == "hc" else {
        "bias_pre", "bias_post", "bias_res", "gate_pre", "gate_post", "gate_res"}
    for name, _ in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        assert (name in no_decay) == (leaf in static | {"head_base", "head_scale"}), name


@pytest.mark.parametrize("options,match", [
    ({"n_streams": 0}, "n_streams"), ({"mhc_init": "zeros"}, "mhc_init"), ({"streams": 4}, "unknown"),
    ({"sinkhorn_iters": 0}, "sinkhorn_iters"), ({"head_mixer": "yes"}, "head_mixer"),
    ({"connector_norm_eps": 0.0}, "connector_norm_eps"), ({"sinkhorn_order": "rows"}, "sinkhorn_order"),
    ({"sinkhorn_order": None}, "sinkhorn_order"),
])
def test_bad_options_are_one_line_errors(options, match):
    with pytest.raises(DepthToolsError, match=match):
        DepthModel(config("mhc", **options))
    with pytest.raises(DepthToolsError, match="unknown"):
        DepthModel(config("hc", mhc_init="uniform"))


# -- readout option (issue 37: DepthBench's HC head norms each stream, then sums) ------------------
@pytest.mark.parametrize("arch", ["hc", "mhc"])
def test_readout_options_against_the_formula(arch):
    from tiny_models import tiny

    ids = tokens()
    logits = {}
    for mode in ("sum", "mean", "normed_sum"):
        model = tiny(arch, n_layer=3, readout=mode)  # float64, every parameter moved off its init
        with torch.no_grad():
            H = model.run_states(ids)[-1].double()  # [B,T,n,d]
            logits[mode] = model.run(ids)
        gamma, eps, W = model.ln_final.weight.double(), model.config.norm_eps, model.unembed.weight.double()

        def rms_norm(x):
            return gamma * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)

        expected = {"sum": rms_norm(H.sum(-2)), "mean": rms_norm(H.mean(-2)),
                    "normed_sum": sum(rms_norm(H[..., s, :]) for s in range(H.shape[-2]))}[mode] @ W.T
        torch.testing.assert_close(logits[mode].double(), expected, rtol=0, atol=1e-10)
    # "sum" is the default: the same weights without the option give the same logits
    with torch.no_grad():
        torch.testing.assert_close(tiny(arch, n_layer=3).run(ids), logits["sum"], rtol=0, atol=0)
    assert (logits["normed_sum"] - logits["sum"]).abs().max() > 1e-3  # a different function
    with pytest.raises(DepthToolsError, match="readout='normed_sum'.*model.head"):
        model.readout(H)
    with pytest.raises(DepthToolsError, match="head_mixer .* needs readout='sum'"):
        DepthModel(config(arch, head_mixer=True, readout="mean"))
