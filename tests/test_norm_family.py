"""Normalisation-family formulas checked against the reference equations (docs/reference/architectures.md §2)."""

import math

import pytest
import torch
import torch.nn.functional as F

from depthtools.arch import DepthModel, Plan
from depthtools.arch.norm_family import (
    deepnorm_constants,
    layerscale_init,
    mixln_post_blocks,
    sublayer_specs,
)
from depthtools.config import ModelConfig

V = 53


def build(arch, n_layer=4, d=32, **kw):
    cfg = ModelConfig(arch=arch, vocab_size=V, d_model=d, n_layer=n_layer, n_heads=4, max_seq_len=32, **kw)
    return DepthModel(cfg, seed=0).double().eval()


def toks():
    return torch.randint(0, V, (2, 10), generator=torch.Generator().manual_seed(0))


def rms(x, w, eps=1e-5):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def test_deepnorm_constants_match_paper():
    alpha, beta = deepnorm_constants(24)
    assert alpha == pytest.approx(2.632, abs=1e-3) and beta == pytest.approx(0.268, abs=1e-3)
    assert deepnorm_constants(6) == pytest.approx((12 ** 0.25, 48 ** -0.25))


def test_deepnorm_init_scales_v_o_and_mlp_by_beta_but_not_q_k():
    torch.manual_seed(0)
    ref = build("preln", n_layer=6)
    deep = build("deepnorm", n_layer=6)
    beta = deepnorm_constants(6)[1]
    b0, r0 = deep.blocks[0], ref.blocks[0]
    # same seed and module creation order -> identical draws before scaling (no pre norms in deepnorm)
    assert torch.allclose(b0.attn.w_q.weight, r0.attn.w_q.weight)
    for name in ("w_v", "w_o"):
        assert torch.allclose(getattr(b0.attn, name).weight, beta * getattr(r0.attn, name).weight)
    for name in ("w1", "w2", "w3"):
        assert torch.allclose(getattr(b0.mlp, name).weight, beta * getattr(r0.mlp, name).weight)


def test_deepnorm_block_equation():
    model = build("deepnorm", n_layer=3)
    x = torch.randn(2, 10, 32, dtype=torch.float64)
    blk = model.blocks[1]
    alpha = (2 * 3) ** 0.25
    rope = (model.rope_cos, model.rope_sin)
    h = rms(alpha * x + blk.attn(x, *rope), blk.attn_post_norm.weight)
    h = rms(alpha * h + blk.mlp(h), blk.mlp_post_norm.weight)
    assert torch.allclose(model.block_step(1, x), h, atol=1e-12)


def layer_norm_ref(x, w, eps):
    """LayerNorm without bias written out: (x - mean) / sqrt(biased variance + eps) * w."""
    c = x - x.mean(-1, keepdim=True)
    return c / torch.sqrt(c.pow(2).mean(-1, keepdim=True) + eps) * w


def test_deepnorm_layernorm_option_matches_formula_and_default_is_unchanged():
    """DepthBench's DeepNorm: LN(a·h + f(h)) with LayerNorm (no bias) as both post-norms, at the model's eps;
    the final norm stays RMSNorm. The default `norm="rmsnorm"` model is bit-identical to one without the option."""
    eps = 1e-6
    model = build("deepnorm", n_layer=3, norm_eps=eps, options={"norm": "layernorm"})
    blk = model.blocks[1]
    assert blk.attn_post_norm.bias is None and blk.mlp_post_norm.eps == eps
    with torch.no_grad():  # non-trivial gains so the reference must apply them
        for norm in (blk.attn_post_norm, blk.mlp_post_norm, model.ln_final):
            norm.weight.copy_(torch.rand(32, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) + 0.5)
    x = 3.0 + torch.randn(2, 10, 32, dtype=torch.float64)  # a non-zero mean, which LayerNorm removes
    alpha, rope = (2 * 3) ** 0.25, (model.rope_cos, model.rope_sin)
    h = layer_norm_ref(alpha * x + blk.attn(x, *rope), blk.attn_post_norm.weight, eps)
    h = layer_norm_ref(alpha * h + blk.mlp(h), blk.mlp_post_norm.weight, eps)
    assert torch.allclose(model.block_step(1, x), h, atol=1e-12, rtol=0)
    assert not torch.allclose(h, rms(alpha * x + blk.attn(x, *rope), blk.attn_post_norm.weight, eps), atol=1e-3)
    assert torch.allclose(model.ln_final(h), rms(h, model.ln_final.weight, eps), atol=1e-12, rtol=0)
    t = toks()
    plain, explicit = build("deepnorm", n_layer=3), build("deepnorm", n_layer=3, options={"norm": "rmsnorm"})
    assert torch.equal(plain(t), explicit(t))
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in explicit.named_parameters()]


def test_lns_scales_normalised_input_by_inverse_sqrt_block_index():
    model = build("lns", n_layer=4)
    x = torch.randn(2, 10, 32, dtype=torch.float64)
    rope = (model.rope_cos, model.rope_sin)
    for b in range(4):
        blk = model.blocks[b]
        s = 1 / math.sqrt(b + 1)
        h = x + blk.attn(s * rms(x, blk.attn_norm.weight), *rope)
        h = h + blk.mlp(s * rms(h, blk.mlp_norm.weight))
        assert torch.allclose(model.block_step(b, x), h, atol=1e-12)


def test_lns_scale_travels_with_the_block_on_swap():
    model = build("lns", n_layer=4)
    x = torch.randn(2, 10, 32, dtype=torch.float64)
    rope = (model.rope_cos, model.rope_sin)
    blk = model.blocks[3]  # run block 3 at position 0: its own 1/sqrt(4) factor applies
    h = x + blk.attn(0.5 * rms(x, blk.attn_norm.weight), *rope)
    h = h + blk.mlp(0.5 * rms(h, blk.mlp_norm.weight))
    assert torch.allclose(model.block_step(0, x, block=3), h, atol=1e-12)


def test_mixln_split_first_quarter_post_ln():
    assert [mixln_post_blocks(L) for L in (3, 4, 8, 12, 32)] == [0, 1, 2, 3, 8]
    cfg = ModelConfig(arch="mixln", vocab_size=V, d_model=32, n_layer=8, n_heads=4)
    kinds = [sublayer_specs(cfg, p)[0].post_norm for p in range(8)]
    assert kinds == [True, True] + [False] * 6
    model = build("mixln", n_layer=8)
    assert hasattr(model.blocks[1], "attn_post_norm") and not hasattr(model.blocks[1], "attn_norm")
    assert hasattr(model.blocks[2], "attn_norm") and not hasattr(model.blocks[2], "attn_post_norm")


def test_keel_block0_special_case_and_alpha():
    model = build("keel", n_layer=3)
    L = 3
    x = torch.randn(2, 10, 32, dtype=torch.float64)
    rope = (model.rope_cos, model.rope_sin)
    b0 = model.blocks[0]
    assert not hasattr(b0, "attn_post_norm") and hasattr(b0, "mlp_post_norm")
    h = x + b0.attn(rms(x, b0.attn_norm.weight), *rope)  # plain Pre-LN attention
    h = rms(h + b0.mlp(rms(h, b0.mlp_norm.weight)), b0.mlp_post_norm.weight)  # Post-LN MLP, no alpha
    assert torch.allclose(model.block_step(0, x), h, atol=1e-12)
    b1 = model.blocks[1]
    h = rms(2 * L * x + b1.attn(rms(x, b1.attn_norm.weight), *rope), b1.attn_post_norm.weight)
    h = rms(2 * L * h + b1.mlp(rms(h, b1.mlp_norm.weight)), b1.mlp_post_norm.weight)
    assert torch.allclose(model.block_step(1, x), h, atol=1e-12)


def test_keel_swap_takes_missing_norm_from_the_position():
    model = build("keel", n_layer=3)
    with torch.no_grad():
        model.blocks[2].attn_post_norm.weight.mul_(3.0)
    x = torch.randn(2, 10, 32, dtype=torch.float64)
    # block 0 (no attn post norm) running at position 2 uses position 2's attn_post_norm
    rope = (model.rope_cos, model.rope_sin)
    b0, home = model.blocks[0], model.blocks[2]
    h = rms(6 * x + b0.attn(rms(x, b0.attn_norm.weight), *rope), home.attn_post_norm.weight)
    h = rms(6 * h + b0.mlp(rms(h, b0.mlp_norm.weight)), b0.mlp_post_norm.weight)
    assert torch.allclose(model.block_step(2, x, block=0), h, atol=1e-12)


def test_layerscale_and_rezero_inits():
    assert (layerscale_init(12), layerscale_init(24), layerscale_init(32)) == (0.1, 1e-5, 1e-6)
    ls = build("layerscale", n_layer=4)
    assert torch.allclose(ls.blocks[0].attn_gain, torch.tensor(0.1, dtype=torch.float64)) and ls.blocks[0].attn_gain.shape == (32,)
    rz = build("rezero", n_layer=4)
    assert all(torch.all(b.attn_gain == 0) and torch.all(b.mlp_gain == 0) for b in rz.blocks)
    assert not any(hasattr(b, "attn_norm") for b in rz.blocks)
    # ReZero at init is the identity network: logits = unembed(final_norm(embedding))
    t = toks()
    assert torch.allclose(rz(t), rz.head(rz.embed(t)), atol=1e-12)


def test_depth_mup_and_completep_multipliers():
    for arch, a in (("depthmup", 0.5), ("completep", 1.0)):
        cfg = ModelConfig(arch=arch, vocab_size=V, d_model=32, n_layer=48, n_heads=4)
        assert sublayer_specs(cfg, 0)[0].branch_mult == pytest.approx((48 / 24) ** -a)


@pytest.mark.parametrize("arch", ["preln", "periln", "lns", "layerscale", "depthmup"])
def test_skip_of_a_block_with_zeroed_output_projections_changes_nothing(arch):
    model = build(arch)
    with torch.no_grad():
        model.blocks[2].attn.w_o.weight.zero_()
        model.blocks[2].mlp.w2.weight.zero_()
        if arch == "periln":  # RMSNorm(0) = 0: the output norm keeps a zero branch zero
            pass
    t = toks()
    assert torch.allclose(model.run(t, plan=Plan.skipping(2)), model(t), atol=1e-12)


def test_additive_identity_resid_pre_plus_outputs_is_resid_post():
    model = build("preln")
    _, cache = model.run_with_cache(toks())
    for l in range(model.n_layer):
        pre, post = cache[f"blocks.{l}.hook_resid_pre"], cache[f"blocks.{l}.hook_resid_post"]
        total = pre + cache[f"blocks.{l}.hook_attn_out"] + cache[f"blocks.{l}.hook_mlp_out"]
        assert torch.allclose(total, post, atol=1e-12)
        assert torch.allclose(pre + cache[f"blocks.{l}.hook_attn_out"], cache[f"blocks.{l}.hook_resid_mid"])


def test_preln_matches_an_independent_reference_forward():
    """A from-scratch Llama-style Pre-LN forward written here (explicit attention, HF rope)."""
    model = build("preln", n_layer=2)
    t = toks()
    x = model.tok_embed.weight[t]
    B, T, d = x.shape
    H, hd = 4, 8
    pos = torch.arange(T, dtype=torch.float64)
    inv = 1.0 / 10000 ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = torch.cat([torch.outer(pos, inv)] * 2, -1)
    rot = lambda v: v * ang.cos() + torch.cat([-v[..., hd // 2:], v[..., : hd // 2]], -1) * ang.sin()
    for blk in model.blocks:
        a = rms(x, blk.attn_norm.weight)
        q = (a @ blk.attn.w_q.weight.T).view(B, T, H, hd).transpose(1, 2)
        k = (a @ blk.attn.w_k.weight.T).view(B, T, H, hd).transpose(1, 2)
        v = (a @ blk.attn.w_v.weight.T).view(B, T, H, hd).transpose(1, 2)
        s = rot(q) @ rot(k).transpose(-1, -2) / math.sqrt(hd)
        s = s.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), -math.inf)
        z = (s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, d)
        x = x + z @ blk.attn.w_o.weight.T
        m = rms(x, blk.mlp_norm.weight)
        x = x + (F.silu(m @ blk.mlp.w1.weight.T) * (m @ blk.mlp.w3.weight.T)) @ blk.mlp.w2.weight.T
    logits = rms(x, model.ln_final.weight) @ model.unembed.weight.T
    assert torch.allclose(model(t), logits, atol=1e-10)


@pytest.mark.parametrize("arch", ["preln", "lns", "postln", "deepnorm", "mixln", "periln"])
def test_transformer_lens_logit_lens_accepts_single_stream_models(arch):
    from transformer_lens.tools.analysis import logit_lens

    model = build(arch)
    t = toks()
    result = logit_lens(model, t[:, :-1], positions=None, targets=t[:, 1:], return_type="log_probs")
    assert result.labels[-1] == "final_post" and len(result.labels) == model.n_layer + 1
    final = result.values[-1, ..., 0]  # [batch, pos]: log p(target) read at the last block
    expected = model(t[:, :-1]).log_softmax(-1).gather(-1, t[:, 1:, None]).squeeze(-1)
    assert torch.allclose(final.double(), expected, atol=1e-6)
    # intermediate entries are our own lens: head(z_l) of the contract's depth states
    states = model.run_states(t[:, :-1])
    mid = model.head(states[2]).log_softmax(-1).gather(-1, t[:, 1:, None]).squeeze(-1)
    assert torch.allclose(result.values[2, ..., 0].double(), mid, atol=1e-6)


def test_every_member_is_a_recipe_row_and_its_options_not_its_name_choose_the_switches():
    """Behaviour is data (norm_family.RECIPES) plus options: every registered member has a row, and a config
    whose options equal another member's defaults-made-explicit gets the same switches at every position."""
    from depthtools.arch import list_archs
    from depthtools.arch.norm_family import RECIPES, NormFamilyScheme
    from depthtools.errors import DepthToolsError

    members = {s.name for s in list_archs() if issubclass(s.scheme, NormFamilyScheme)}
    assert members == set(RECIPES)
    shape = dict(vocab_size=V, d_model=32, n_layer=8, n_heads=4, max_seq_len=32)
    depthmup = ModelConfig(arch="depthmup", **shape)
    as_completep = ModelConfig(arch="completep", options={"depth_exponent": 0.5}, **shape)
    assert [sublayer_specs(depthmup, p) for p in range(8)] == [sublayer_specs(as_completep, p) for p in range(8)]
    keel = ModelConfig(arch="keel", options={"keel_alpha": 3}, **shape)
    assert {sublayer_specs(keel, p)[0].alpha for p in range(1, 8)} == {3.0} and sublayer_specs(keel, 0)[0].alpha == 1.0
    with pytest.raises(DepthToolsError, match="'hc' is not a normalisation-family architecture"):
        sublayer_specs(ModelConfig(arch="hc", **shape), 0)
