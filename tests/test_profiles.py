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
    assert train.tokens == 3 * 4 * 16 and train.weight_decay == 0.1
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
