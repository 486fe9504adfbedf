"""The `depthbench` profile (depthtools.profiles): what it switches, that our defaults stay, that it trains."""

import math

import pytest
import torch

from depthtools import profiles
from depthtools.config import ModelConfig, TrainConfig
from depthtools.errors import DepthToolsError
from depthtools.presets import DEPTHBENCH_TEN

from tiny_models import SMALL, one_thread  # noqa: F401


def test_depthbench_profile_switches_options_and_keeps_defaults():
    base = ModelConfig(arch="mhc", **SMALL)
    cfg, train, notes = profiles.apply("depthbench", base, TrainConfig(batch_size=4, seq_len=16), steps=3)
    assert cfg.norm_eps == 1e-6 and cfg.options == {"mhc_init": "uniform", "sinkhorn_iters": 20,
                                                    "sinkhorn_order": "cols_last", "readout": "mean"}
    assert profiles.apply_model("depthbench", ModelConfig(arch="hc", **SMALL)).options == {"readout": "normed_sum"}
    pytorch_mhc = profiles.apply_model("depthbench", ModelConfig(arch="mhc", **SMALL, options={"mhc_init": "hc_like"}))
    assert pytorch_mhc.options["readout"] == "normed_sum"
    assert train.tokens == 3 * 4 * 16 and train.weight_decay == 0.1 and train.decay_groups == "depthbench"
    assert (train.beta1, train.beta2, train.eps, train.grad_clip) == (0.9, 0.95, 1e-8, 1.0)
    assert (train.schedule, train.warmup_fraction, train.final_lr_fraction) == ("cosine", 0.1, 0.1)
    hop = profiles.apply("depthbench", base, TrainConfig(lr=1e-3, warmup_fraction=0.02))[1]
    assert hop.lr == 1e-3 and hop.warmup_fraction == 0.1  # the preset's LR stays; scale-free choices are DepthBench's
    assert not any("readout" in n for n in notes)  # reproduced since the readout option
    # bf16 weights: one line per run, saying what it does instead on this device (depthtools.train.loop)
    assert "on CPU" in profiles.weights_note("depthbench", "cpu", "float32", False)
    assert "has no bf16" in profiles.weights_note("depthbench", "cuda", "float32", False)
    assert "bf16 weights and AdamW state as DepthBench" in profiles.weights_note("depthbench", "cuda", "bfloat16", True,
                                                                                 "bfloat16")  # implemented (param_dtype)
    assert train.param_dtype == "auto"  # bf16 where the device does bf16 (depthtools.train.precision)
    assert profiles.weights_note(None, "cpu", "float32", False) is None
    assert profiles.apply("depthtools", base)[0] == base and base.norm_eps == 1e-5  # defaults unchanged
    deepnorm, _, deepnorm_notes = profiles.apply("depthbench", ModelConfig(arch="deepnorm", **SMALL))
    assert deepnorm.options == {"norm": "layernorm"} and deepnorm.norm_eps == 1e-6 and deepnorm_notes == []
    from depthtools.arch import DepthModel
    post = DepthModel(deepnorm, seed=0).blocks[0].attn_post_norm  # the profile's eps reaches the LayerNorm
    assert (post.kind, post.eps, post.bias) == ("layer", 1e-6, None)
    moda = profiles.apply("depthbench", ModelConfig(arch="moda", **SMALL, options={"moda_depth_rope": "none"}))[0]
    assert moda.options["moda_depth_rope"] == "none"  # an explicit option wins
    with pytest.raises(DepthToolsError, match="unknown profile 'olmo'; valid"):
        profiles.apply("olmo", base)


@pytest.mark.parametrize("arch", ["attnres", "blockattnres"])
def test_depthbench_profile_keeps_attnres_res_norms_at_olmo_cores_eps(arch):
    """DepthBench's AttnRes normalises keys, every sublayer input read from a mix and the final output at
    OLMo-core's RMSNorm eps 1e-5 while its blocks' own norm eps is 1e-6: under the profile, mix_eps = 1e-5 and
    only block 0's attention norm (it reads the embedding alone) keeps 1e-6."""
    from depthtools.arch import DepthModel

    cfg = profiles.apply_model("depthbench", ModelConfig(arch=arch, **SMALL))
    assert cfg.norm_eps == 1e-6 and cfg.options == {"mix_eps": 1e-5}
    model = DepthModel(cfg, seed=0)
    eps = {name: m.eps for name, m in model.named_modules() if hasattr(m, "eps") and not name.endswith("key_norm")}
    key_eps = {m.eps for name, m in model.named_modules() if name.endswith("key_norm")}
    assert key_eps == {1e-5} and eps.pop("blocks.0.attn_norm") == 1e-6
    assert set(eps.values()) == {1e-5}, eps
    explicit = profiles.apply_model("depthbench", ModelConfig(arch=arch, **SMALL, options={"mix_eps": 1e-6}))
    assert explicit.options == {"mix_eps": 1e-6}  # an explicit option wins


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


# -- wiring: `depthtools train --profile`, `grid plan --profile`, a spec's train "profile" -------------
def test_train_command_profile_is_recorded_and_says_what_it_does_instead(data_dir, tmp_path, caplog):
    import json
    import logging

    from typer.testing import CliRunner

    from cli.main import app

    out = tmp_path / "cell"
    args = ["train", "--arch", "hc", "--layers", "2", "--d-model", "32", "--n-heads", "2", "--data", str(data_dir),
            "--out", str(out), "--tokens", str(3 * 4 * 16), "--batch-size", "4", "--seq-len", "16",
            "--eval-every", "0", "--threads", "1", "--device", "cpu", "--profile", "depthbench"]
    with caplog.at_level(logging.WARNING, logger="depthtools.train.loop"):
        result = CliRunner().invoke(app, args + ["--lr", "1e-3"])
    assert result.exit_code == 0, (result.output, result.exception)
    config = json.loads((out / "config.json").read_text())
    assert config["train"]["profile"] == "depthbench" and config["train"]["decay_groups"] == "depthbench"
    assert config["train"]["lr"] == 1e-3  # an explicit option wins over the profile
    assert config["model"]["norm_eps"] == 1e-6
    notes = config["train_resolved"]["profile_notes"]
    weights = [n for n in notes if "bf16 weights" in n]
    assert len(weights) == 1 and "on CPU" in weights[0] and "float32 weights" in weights[0]
    assert config["model"]["options"]["readout"] == "normed_sum"
    assert weights[0] in caplog.text  # printed, one line
    with pytest.raises(DepthToolsError, match="unknown profile 'olmo'; valid: depthtools, depthbench"):
        TrainConfig(profile="olmo")


def test_grid_plan_profile_and_a_spec_naming_one(tmp_path):
    import json

    from typer.testing import CliRunner

    from cli.main import app
    from depthtools.train.sweep import load_spec

    path = tmp_path / "db.json"
    result = CliRunner().invoke(app, ["grid", "plan", "--preset", "tiny", "--profile", "depthbench", "--out", str(path)])
    assert result.exit_code == 0, (result.output, result.exception)
    spec = json.loads(path.read_text())
    assert spec["train"]["profile"] == "depthbench" and spec["train"]["decay_groups"] == "depthbench"
    assert spec["train"]["lr"] == 3e-3  # the preset's LR stays
    assert all(c["model"]["norm_eps"] == 1e-6 for c in spec["cells"])
    again = load_spec(path)  # reading it back changes nothing
    assert again["train"] == spec["train"] and [c.model for c in again["cells"]] == [c["model"] for c in spec["cells"]]

    # a spec written by hand: the profile fills what the spec leaves out, its explicit choices stay
    hand = {**spec, "train": {"profile": "depthbench", "warmup_fraction": 0.05, "tokens": 1000},
            "cells": [{**c, "model": {**c["model"], "norm_eps": 1e-5}} for c in spec["cells"]]}
    mhc_path = tmp_path / "mhc.json"  # an mHC cell as the planner writes it (a cell must agree with its model)
    result = CliRunner().invoke(app, ["grid", "plan", "--arch", "mhc", "--layers", "2", "--budget", "250k",
                                      "--vocab-size", "256", "--n-heads", "2", "--out", str(mhc_path)])
    assert result.exit_code == 0, (result.output, result.exception)
    mhc_cell = json.loads(mhc_path.read_text())["cells"][0]
    hand["cells"][0] = {**mhc_cell, "model": {**mhc_cell["model"], "norm_eps": 1e-5, "options": {}}}
    loaded = load_spec(hand)
    assert loaded["train"]["warmup_fraction"] == 0.05 and loaded["train"]["decay_groups"] == "depthbench"
    assert all(c.model["norm_eps"] == 1e-6 for c in loaded["cells"])
    assert loaded["cells"][0].model["options"]["mhc_init"] == "uniform"
    plain = {**spec, "train": {"tokens": 1000}}
    assert load_spec(plain)["train"] == {"tokens": 1000}  # no profile: untouched
    with pytest.raises(DepthToolsError, match="unknown profile 'olmo'"):
        load_spec({**spec, "train": {"profile": "olmo"}})


def _sinkhorn_log(logits, num_iters=20):
    """DepthBench's `hyper_connections.sinkhorn_log` (tau 1) written out: log-domain potentials with marginals
    1/n, each round the row potential u first, then the column potential v; exp(z + u + v) · n."""
    n = logits.shape[-1]
    u = torch.zeros(logits.shape[:-1], dtype=logits.dtype)
    v = torch.zeros(logits.shape[:-2] + logits.shape[-1:], dtype=logits.dtype)
    for _ in range(num_iters):
        u = -math.log(n) - torch.logsumexp(logits + v.unsqueeze(-2), dim=-1)
        v = -math.log(n) - torch.logsumexp(logits + u.unsqueeze(-1), dim=-2)
    return torch.exp(logits + u.unsqueeze(-1) + v.unsqueeze(-2)) * n


def test_depthbench_profile_mhc_sinkhorn_is_depthbench_sinkhorn_log():
    """mHC under the profile (cols_last, 20 rounds): every connector's H_res equals DepthBench's sinkhorn_log of
    the connector's logits (gate · x'φ_res + bias, x' = the RMS-normed flattened streams), float64."""
    from depthtools.arch import DepthModel
    from depthtools.arch.hyper import sinkhorn_knopp

    cfg = profiles.apply_model("depthbench", ModelConfig(arch="mhc", **SMALL))
    assert (cfg.options["sinkhorn_order"], cfg.options["sinkhorn_iters"]) == ("cols_last", 20)
    model = DepthModel(cfg, seed=0).double().eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # strong, asymmetric logits: the Sinkhorn order matters at these
        for block in model.blocks:
            for conn in (block.attn_hc, block.mlp_hc):
                conn.gate_res.fill_(2.0)
                conn.phi_res.add_(0.5 * torch.randn(conn.phi_res.shape, generator=gen, dtype=torch.float64))
                conn.bias_res.add_(2.0 * torch.randn(conn.bias_res.shape, generator=gen, dtype=torch.float64))
    names = [f"blocks.{l}.{hook}" for l in range(model.n_layer)
             for hook in ("hook_streams_pre", "hook_streams_mid", "attn_hc.hook_res_weights", "mlp_hc.hook_res_weights")]
    got = {}

    def store(t, hook):
        got[hook.name] = t.detach().clone()

    toks = torch.randint(0, SMALL["vocab_size"], (2, 9), generator=gen)
    with torch.no_grad(), model.hooks(fwd_hooks=[(name, store) for name in names]):
        model(toks)
    n = model.scheme.n
    for l, block in enumerate(model.blocks):
        for conn, streams, res in ((block.attn_hc, "hook_streams_pre", "attn_hc.hook_res_weights"),
                                   (block.mlp_hc, "hook_streams_mid", "mlp_hc.hook_res_weights")):
            x = got[f"blocks.{l}.{streams}"].flatten(-2)  # [B,T,n·d]
            x = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + conn.eps)
            logits = conn.gate_res * (x @ conn.phi_res).unflatten(-1, (n, n)) + conn.bias_res
            want = _sinkhorn_log(logits.detach())
            torch.testing.assert_close(got[f"blocks.{l}.{res}"], want, atol=1e-10, rtol=0)
            assert not torch.allclose(want, sinkhorn_knopp(logits.detach(), 20, "rows_last"), atol=1e-4)
