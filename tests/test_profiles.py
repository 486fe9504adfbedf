"""The `depthbench` profile (depthtools.profiles): what it switches, that our defaults stay, that it trains."""

import math

import pytest
from depthtools.config import ModelConfig, TrainConfig
from depthtools.errors import DepthToolsError
from depthtools.presets import DEPTHBENCH_TEN
from depthtools import profiles
from tiny_models import SMALL, one_thread  # noqa: F401


def test_depthbench_profile_switches_options_and_keeps_defaults():
    base = ModelConfig(arch="mhc", **SMALL)
    cfg, train, notes = profiles.apply("depthbench", base, TrainConfig(batch_size=4, seq_len=16), steps=3)
    assert cfg.norm_eps == 1e-6 and cfg.options == {"mhc_init": "uniform", "sinkhorn_iters": 20,
                                                    "sinkhorn_order": "cols_last"}
    assert train.tokens == 3 * 4 * 16 and train.weight_decay == 0.1 and train.decay_groups == "depthbench"
    assert (train.beta1, train.beta2, train.eps, train.grad_clip) == (0.9, 0.95, 1e-8, 1.0)
    assert (train.schedule, train.warmup_fraction, train.final_lr_fraction) == ("cosine", 0.1, 0.1)
    hop = profiles.apply("depthbench", base, TrainConfig(lr=1e-3, warmup_fraction=0.02))[1]
    assert hop.lr == 1e-3 and hop.warmup_fraction == 0.1  # the preset's LR stays; scale-free choices are DepthBench's
    assert any("readout" in n for n in notes) and any("bf16" in n for n in notes)
    assert profiles.apply("depthtools", base)[0] == base and base.norm_eps == 1e-5  # defaults unchanged
    moda = profiles.apply("depthbench", ModelConfig(arch="moda", **SMALL, options={"moda_depth_rope": "none"}))[0]
    assert moda.options["moda_depth_rope"] == "none"  # an explicit option wins
    with pytest.raises(DepthToolsError, match="unknown profile 'olmo'; valid"):
        profiles.apply("olmo", base)


@pytest.mark.parametrize("arch", DEPTHBENCH_TEN)
def test_profile_trains_every_depthbench_arch(arch, data_dir, tmp_path):
    from depthtools.train import train_cell

    cfg, train, _ = profiles.apply("depthbench", ModelConfig(arch=arch, **SMALL),
                                   TrainConfig(batch_size=2, seq_len=16, eval_every=0, eval_tokens=64,
                                               log_every=1, depth_stats_every=0, checkpoint_every=0), steps=3)
    summary = train_cell(cfg, train, data_dir, tmp_path / arch)
    losses = [v for k, v in summary.items() if "loss" in k and isinstance(v, float)]
    assert losses and all(math.isfinite(v) for v in losses), summary


# -- weight-decay groups (TrainConfig.decay_groups) ----------------------------------------------
# DepthBench's static routing, read off its `HyperConnectionsConfig.static_parameter_patterns` and mapped
# to our parameter names by hand: HC static_alpha/static_beta; Liger mHC (our "uniform" init) b and
# alpha_pre/post/res = bias_* and gate_*; PyTorch mHC (our "hc_like" init) pre/post/residual_bias = bias_*.
DEPTHBENCH_STATIC = {
    ("hc", None): {"static_alpha", "static_beta"},
    ("mhc", "uniform"): {"bias_pre", "bias_post", "bias_res", "gate_pre", "gate_post", "gate_res"},
    ("mhc", "hc_like"): {"bias_pre", "bias_post", "bias_res"},
}


def _decay_split(model, train):
    from depthtools.train.optim import param_groups

    groups, names = param_groups(model, train)
    ids = {id(p): n for n, p in model.named_parameters()}
    decayed = {ids[id(p)] for g in groups if g["weight_decay"] > 0 for p in g["params"]}
    return groups, names, decayed


@pytest.mark.parametrize("arch,init", [("preln", None), ("attnres", None), ("lns", None), ("moda", None),
                                       ("hc", None), ("mhc", "uniform"), ("mhc", "hc_like")])
def test_depthbench_decay_groups_equal_an_independent_listing(arch, init):
    from depthtools.arch import DepthModel

    options = {"mhc_init": init} if init else {}
    model = DepthModel(ModelConfig(arch=arch, **SMALL, options=options))
    groups, names, decayed = _decay_split(model, TrainConfig(tokens=1, weight_decay=0.1, decay_groups="depthbench"))
    static = DEPTHBENCH_STATIC.get((arch, init), set())
    expected_undecayed = {n for n, _ in model.named_parameters() if n.split(".")[-1] in static}
    all_names = {n for n, _ in model.named_parameters()}
    assert all_names - decayed == expected_undecayed and len(names) == len(all_names)
    assert len(groups) == (2 if static else 1)  # DepthBench: one group, plus the wd-0 override for HC/mHC
    assert all(g["weight_decay"] in (0.0, 0.1) for g in groups)
    # norms, gains and 1-D tensors decay too (ours exempts them)
    assert any(n.endswith("norm.weight") for n in decayed)


def test_default_decay_groups_are_unchanged():
    from depthtools.arch import DepthModel

    assert "decay_groups" not in TrainConfig().to_dict()  # config.json and run fingerprints stay as before
    assert TrainConfig(decay_groups="depthbench").to_dict()["decay_groups"] == "depthbench"
    model = DepthModel(ModelConfig(arch="hc", **SMALL))
    _, _, decayed = _decay_split(model, TrainConfig(tokens=1))
    # ours: matrices only, minus the routing names of the scheme
    expected = {n for n, p in model.named_parameters()
                if p.dim() >= 2 and n.split(".")[-1] not in {"static_alpha", "static_beta"}}
    assert decayed == expected
    with pytest.raises(DepthToolsError, match="unknown decay_groups 'olmo'; valid: depthtools, depthbench"):
        TrainConfig(decay_groups="olmo")


def test_depthbench_decay_keeps_depth_scaled_block_groups():
    from depthtools.arch import DepthModel

    model = DepthModel(ModelConfig(arch="completep", **{**SMALL, "n_layer": 48}))
    groups, _, decayed = _decay_split(model, TrainConfig(tokens=1, decay_groups="depthbench"))
    assert decayed == {n for n, _ in model.named_parameters()}
    assert sorted(g["group"] for g in groups) == ["decay", "decay/blocks"]
