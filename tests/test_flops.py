"""FLOPs per token (depthtools.train.flops) against a counted forward, for every architecture (issue 19).

What is counted: the matrix products of one forward (torch.utils.flop_counter, 2 FLOPs per
multiply-add), with every hook point hooked so that each architecture runs its explicit path
(attention with the pattern formed, connectors and depth mixes step by step; AttnRes without its
bank of precomputed key dots), plus mv (a mix with
static weights) and the weighted sums over sources, which the package forms elementwise and this
test forms as the matrix products they are. Not counted, by either side: elementwise work (norms,
softmax, activations, Sinkhorn, residual adds). The formula keeps one elementwise term, the Pre-LN
backbone's 2L+1 norm gains (2 FLOPs per token each), which the comparison adds back exactly; so the
formula must equal the count exactly: a wrong source count, block size or slot count shows.
"""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from depthtools.arch import DepthModel, list_archs
from depthtools.config import ModelConfig
from depthtools.train.flops import flops_per_token, scheme_extra_flops

SHAPE = dict(vocab_size=40, d_model=16, n_heads=2, max_seq_len=16)
T = 6

VARIANTS = [(spec.name, {}, 3) for spec in list_archs()] + [
    ("hc", {"n_streams": 2, "head_mixer": True, "connector_norm_gain": True}, 3),
    ("mhc", {"n_streams": 3, "head_mixer": True}, 2),
    ("attnres", {}, 5),
    ("blockattnres", {"attnres_block_size": 3}, 5),  # partial blocks that straddle transformer blocks
    ("blockattnres", {}, 12),  # default S = 2·ceil(L/8) = 4 (flops.py once used √L)
    ("denseformer", {"dwa_dilation": 2, "dwa_period": 2}, 5),
    ("moda", {"moda_norm": "post"}, 4),
    # a mixture of experts: each token runs its top-k experts, the shared expert and the router (no other expert)
    ("preln", {"moe_experts": 4, "moe_top_k": 2, "moe_ff": 24, "moe_shared_ff": 16, "moe_layers": "mdm"}, 3),
]


def _stacked_sum(weights, sources):
    """Σ_i w_i v_i as a matrix product: [..., d, n] @ [n] (static weights) or @ [..., n, 1] (per token)."""
    if len(sources) == 1:  # a one-source "mix" is the identity: nothing to count
        return sources[0] * (weights[..., :1] if weights.dim() > 1 else weights[0])
    stacked = torch.stack(sources, -1)
    return stacked @ weights if weights.dim() == 1 else (stacked @ weights.unsqueeze(-1)).squeeze(-1)


def _mv(a_shape, b_shape, *args, out_shape=None, **kwargs):
    return 2 * a_shape[0] * a_shape[1]


def counted_forward_flops(model, tokens, monkeypatch) -> float:
    """Matrix-product FLOPs per token of one explicit-path forward (see the module docstring)."""
    import depthtools.arch.attnres as attnres
    import depthtools.arch.denseformer as denseformer

    for module in (attnres, denseformer):
        monkeypatch.setattr(module, "weighted_sum", _stacked_sum)
    # AttnRes' bank precomputes key dots with every mixer (the fast path); the hooked path does not read
    # them, so run without a bank: the per-source mixes are the function itself.
    monkeypatch.setattr(attnres.AttnResScheme, "_new_bank", lambda self, sources: (None, None))
    counter = FlopCounterMode(display=False, custom_mapping={torch.ops.aten.mv: _mv})
    with torch.no_grad(), model.hooks(fwd_hooks=[(lambda name: True, lambda tensor, hook: None)]), counter:
        model(tokens)
    return counter.get_total_flops() / tokens.numel()


@pytest.mark.parametrize("arch,options,n_layer", VARIANTS, ids=lambda v: str(v))
def test_flops_per_token_equals_the_counted_forward(arch, options, n_layer, monkeypatch):
    cfg = ModelConfig(arch=arch, n_layer=n_layer, options=options, **SHAPE)
    model = DepthModel(cfg, seed=0).eval()
    tokens = torch.randint(0, SHAPE["vocab_size"], (2, T), generator=torch.Generator().manual_seed(0))
    counted = counted_forward_flops(model, tokens, monkeypatch)
    norm_gains = 2 * (2 * n_layer + 1) * cfg.d_model  # the formula's one elementwise term (Pre-LN's norms)
    formula = flops_per_token(cfg, model.param_counts()["total"], T) / 3
    assert formula - norm_gains == pytest.approx(counted, rel=1e-12, abs=1e-6), (
        f"{arch} {options}: formula {formula - norm_gains:.0f}, counted {counted:.0f}, "
        f"scheme extras {scheme_extra_flops(cfg):.0f}")


def test_the_counted_forward_sees_depth_mixing_the_preln_backbone_lacks(monkeypatch):
    """Guards the counter itself: HC, AttnRes, DenseFormer and MoDA count more than Pre-LN."""
    tokens = torch.randint(0, SHAPE["vocab_size"], (2, T), generator=torch.Generator().manual_seed(0))
    base = counted_forward_flops(DepthModel(ModelConfig(arch="preln", n_layer=3, **SHAPE)).eval(), tokens, monkeypatch)
    for arch in ("hc", "attnres", "denseformer", "moda"):
        model = DepthModel(ModelConfig(arch=arch, n_layer=3, **SHAPE)).eval()
        extra_params = model.param_counts()["total"] - DepthModel(ModelConfig(arch="preln", n_layer=3, **SHAPE)).param_counts()["total"]
        assert counted_forward_flops(model, tokens, monkeypatch) - base > 2 * extra_params * (arch == "moda"), arch


def test_training_flops_are_three_forwards_and_do_not_move_the_rng():
    cfg = ModelConfig(arch="mhc", n_layer=2, **SHAPE)
    params = DepthModel(cfg).param_counts()["total"]
    torch.manual_seed(3)
    expected = torch.rand(1)
    torch.manual_seed(3)
    fpt = flops_per_token(cfg, params, T)
    assert torch.equal(torch.rand(1), expected)
    base = params - 40 * 16 - (params - DepthModel(cfg.replace(arch="preln", options={})).param_counts()["total"])
    assert fpt == 6 * base + 12 * 2 * 16 * T + 3 * scheme_extra_flops(cfg)
