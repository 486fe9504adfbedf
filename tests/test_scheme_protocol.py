"""Adding an architecture is one scheme file plus its registration (issue 19): a toy scheme registered
here gets option validation, FLOPs, routing statistics and the training probe without any edit to
flops.py, routing.py or probe.py."""

import math

import pytest
import torch
from test_flops import counted_forward_flops

from depthtools.analysis.routing import routing_matrix, routing_stats
from depthtools.arch import ArchSpec, DepthModel, register, registry
from depthtools.arch.layers import RMSNorm
from depthtools.arch.scheme import DepthRouting, Option, ResidualScheme
from depthtools.config import ModelConfig
from depthtools.errors import DepthToolsError
from depthtools.train.flops import flops_per_token
from depthtools.train.probe import DepthProbe

from tiny_models import one_thread  # noqa: F401 (fixture)


class ToyScheme(ResidualScheme):
    """Pre-LN whose MLP branches are scaled by a learned scalar `mix` (routing: the final readout reads
    the embedding and each MLP output with weight mix, each attention output with weight 1)."""

    @classmethod
    def option_schema(cls, arch):
        return {"toy_init": Option("number", 0.5, low=0, low_open=True)}

    def __init__(self, cfg):
        super().__init__(cfg)
        self.mix = torch.nn.Parameter(torch.tensor(float(self.opts.toy_init)))

    def build_block(self, block):
        block.attn_norm, block.mlp_norm = RMSNorm(self.cfg.d_model), RMSNorm(self.cfg.d_model)

    def step(self, position, block, h, home, rope):
        h = h + block.hook_attn_out(block.attn(block.attn_norm(h), *rope))
        return h + self.mix * block.hook_mlp_out(block.mlp(block.mlp_norm(h)))

    def extra_flops(self):
        return 0.0  # a scalar multiply is elementwise

    def depth_routing(self, model, tokens, exclude_first):
        S = 2 * self.cfg.n_layer
        W = torch.full((S + 1, S + 1), math.nan, dtype=torch.float64)
        W[S, 0] = 1.0
        for j in range(S):
            W[S, j + 1] = float(self.mix.detach()) if j % 2 else 1.0
        return DepthRouting([(S, "final")], W, ["toy routing"])


@pytest.fixture
def toy():
    register(ArchSpec("toy", "baseline", "toy", "1", lambda c: 1, "none", ToyScheme))
    yield "toy"
    registry.unregister("toy")


def test_a_registered_scheme_gets_options_flops_routing_and_the_probe(toy, monkeypatch):
    shape = dict(vocab_size=40, d_model=16, n_layer=2, n_heads=2, max_seq_len=16)
    with pytest.raises(DepthToolsError, match="unknown toy option 'toy_gain'; valid: toy_init"):
        ModelConfig(arch=toy, options={"toy_gain": 1.0}, **shape)
    with pytest.raises(DepthToolsError, match="toy option toy_init must be a finite number > 0"):
        ModelConfig(arch=toy, options={"toy_init": 0}, **shape)
    model = DepthModel(ModelConfig(arch=toy, options={"toy_init": 0.25}, **shape), seed=0).eval()
    tokens = torch.randint(0, 40, (2, 7), generator=torch.Generator().manual_seed(0))

    counted = counted_forward_flops(model, tokens[:, :-1], monkeypatch)
    assert flops_per_token(model.config, model.param_counts()["total"], 6) / 3 - 2 * 5 * 16 == counted

    df = routing_stats(model, tokens)
    W = routing_matrix(df)
    assert W[4, 2].item() == 0.25 and W[4, 1].item() == 1.0 and "toy routing" in df.attrs["notes"]

    probe = DepthProbe()
    states = model.train().run_states(tokens[:, :-1])
    probe.watch(model, states)
    model.head(states[-1]).square().mean().backward()
    assert all(g is not None and g > 0 for g in probe.record()["depth_grad_norm"])
