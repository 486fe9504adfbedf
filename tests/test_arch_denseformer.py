"""DenseFormer: Pre-LN at init, the DWA equations (dilation/period), skip, swap, parameter count."""

import copy

import pytest
import torch

from depthtools.arch import DepthModel, Plan, get_arch
from depthtools.config import ModelConfig
from depthtools.errors import DepthToolsError

VOCAB = 53


def config(n_layer=5, arch="denseformer", **options) -> ModelConfig:
    return ModelConfig(arch=arch, vocab_size=VOCAB, d_model=32, n_layer=n_layer, n_heads=4,
                       max_seq_len=16, options=options)


def build(n_layer=5, arch="denseformer", **options) -> DepthModel:
    return DepthModel(config(n_layer, arch, **options), seed=0).double().eval()


def perturb(model, scale=0.3, only=None):
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if only is None or only in name:
                p.add_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))


def tokens(batch=2, length=10):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(0))


def preln_block(model, block, x):
    x = x + block.attn(block.attn_norm(x), model.rope_cos, model.rope_sin)
    return x + block.mlp(block.mlp_norm(x))


def reference_denseformer(model, toks, k, p, skip=()):
    """The paper's DWA with an explicit full weight row a_{b,j} (zero outside the dilation group)."""
    X = [model.tok_embed(toks)]
    mixed = X[0]
    for b, block in enumerate(model.blocks):
        X.append(mixed if b in skip else preln_block(model, block, mixed))
        if (b + 1) % p == 0:
            row = model.scheme.dwa[str(b)]
            group = [j for j in range(b + 2) if j % k == (b + 1) % k]
            assert len(group) == len(row)
            mixed = sum(row[n] * X[j] for n, j in enumerate(group))
        else:
            mixed = X[-1]
    return model.unembed(model.ln_final(mixed))


def test_init_equals_preln_exactly():
    preln = build(arch="preln")
    perturb(preln)
    model = build()
    missing, unexpected = model.load_state_dict(preln.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("scheme.dwa.") for k in missing)
    toks = tokens()
    assert torch.allclose(model(toks), preln(toks), atol=1e-12, rtol=0)
    for ours, theirs in zip(model.run_states(toks), preln.run_states(toks)):
        assert torch.allclose(model.readout(ours), theirs, atol=1e-12, rtol=0)
    perturb(model, only="dwa", scale=0.1)  # the comparison can fail
    assert not torch.allclose(model(toks), preln(toks), atol=1e-4)


@pytest.mark.parametrize("k,p", [(1, 1), (2, 1), (1, 2), (2, 3), (3, 2)])
def test_matches_dwa_equations(k, p):
    model = build(n_layer=6, dwa_dilation=k, dwa_period=p)
    perturb(model)
    toks = tokens()
    assert torch.allclose(model(toks), reference_denseformer(model, toks, k, p), atol=1e-10)
    assert torch.allclose(model.run(toks, plan=Plan.skipping(2)),
                          reference_denseformer(model, toks, k, p, skip={2}), atol=1e-10)


def test_extra_params_formula():
    spec = get_arch("denseformer")
    for L in (1, 5, 8):
        assert spec.extra_params(config(L)) == L * (L + 3) // 2
    for L, k, p in ((6, 2, 1), (7, 1, 2), (9, 2, 3), (5, 4, 4)):
        cfg = config(L, dwa_dilation=k, dwa_period=p)
        built = DepthModel(cfg).param_counts()["total"] - DepthModel(config(L, "preln")).param_counts()["total"]
        expected = sum((m // k) + 1 for m in range(p, L + 1, p))
        assert built == spec.extra_params(cfg) == expected
    with pytest.raises(DepthToolsError, match="dwa_dilation"):
        build(dwa_dilation=0)


def test_skip_last_block_hand_computed():
    model = build()
    perturb(model)
    toks = tokens()
    L = model.n_layer
    states = model.run_states(toks)
    before = states[L - 1]
    # X_L := Xt_{L-1}; the last DWA (unchanged) mixes X_0..X_{L-1}, Xt_{L-1}
    row = model.scheme.dwa[str(L - 1)]
    mixed = sum(w * x for w, x in zip(row, before.retained + (before.mixed,)))
    expected = model.unembed(model.ln_final(mixed))
    assert torch.allclose(model.run(toks, plan=Plan.skipping(L - 1)), expected, atol=1e-12)
    assert torch.allclose(model.run(plan=Plan.skipping(L - 1), start=L - 1, from_state=before), expected, atol=1e-12)


def test_swap_keeps_dwa_in_place():
    """Swap == a model whose blocks' weights (norms, attention, MLP) are exchanged, DWA rows not."""
    model = build()
    perturb(model)
    toks = tokens()
    exchanged = copy.deepcopy(model)
    exchanged.blocks[1].load_state_dict(model.blocks[3].state_dict())
    exchanged.blocks[3].load_state_dict(model.blocks[1].state_dict())
    assert torch.allclose(model.run(toks, plan=Plan.swapping(1, 3, model.n_layer)), exchanged(toks), atol=1e-12)


def test_hooks_expose_dwa_output_and_additive_block_stream():
    model = build()
    perturb(model)
    toks = tokens()
    _, cache = model.run_with_cache(toks)
    states = model.run_states(toks)
    for b in range(model.n_layer):
        assert torch.allclose(cache[f"blocks.{b}.hook_dwa_out"], states[b + 1].mixed)
        pre, mid, post = (cache[f"blocks.{b}.hook_resid_{n}"] for n in ("pre", "mid", "post"))
        assert torch.allclose(pre + cache[f"blocks.{b}.hook_attn_out"], mid)
        assert torch.allclose(mid + cache[f"blocks.{b}.hook_mlp_out"], post)
        assert torch.allclose(pre, states[b].mixed)
