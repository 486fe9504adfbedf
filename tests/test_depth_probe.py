"""The training depth probe's backward norms read the tensor each block writes, as its scheme names it
(`ResidualScheme.written_tensor`, issue 19), for every architecture."""

import pytest
import torch

from depthtools.arch import Plan, list_archs
from depthtools.train.probe import DepthProbe

from tiny_models import one_thread, tiny, windows  # noqa: F401 (fixture)

ARCHS = [spec.name for spec in list_archs()]


@pytest.mark.parametrize("arch", ARCHS)
def test_written_tensor_is_what_the_last_block_wrote(arch):
    """At depth l >= 1 the written tensor depends on block l-1: skipping it changes the tensor. Before,
    probe.py guessed state fields and took AttnRes' newest *banked* source, which for Block AttnRes is a
    block sum closed before block l-1 ran (so its 'depth l' gradient was an earlier block's, and
    several depths hooked one tensor) and for Full AttnRes the attention output, not the MLP's."""
    model = tiny(arch, n_layer=3)
    tokens = windows(2, 9)[:, :-1]
    states = model.run_states(tokens)
    written = [model.scheme.written_tensor(s) for s in states]
    assert all(torch.is_tensor(w) and w.shape[:2] == tokens.shape for w in written)
    assert len({id(w) for w in written}) == len(written), "two depths share one written tensor"
    for depth in range(1, model.n_layer + 1):
        skipped = model.run_states(tokens, plan=Plan.skipping(depth - 1))[depth]
        assert not torch.allclose(model.scheme.written_tensor(skipped), written[depth]), depth


@pytest.mark.parametrize("arch", ["preln", "hc", "blockattnres", "denseformer", "moda"])
def test_probe_records_a_gradient_norm_at_every_depth(arch):
    model = tiny(arch, n_layer=3).float().train()
    tokens = windows(2, 9)
    probe = DepthProbe()
    states = model.run_states(tokens[:, :-1])
    probe.watch(model, states)
    loss = torch.nn.functional.cross_entropy(model.head(states[-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    record = probe.record()
    assert len(record["depth_fwd_norm"]) == len(record["depth_grad_norm"]) == 4
    assert all(g is not None and g > 0 for g in record["depth_grad_norm"]), record


def test_full_attnres_writes_its_mlp_output_last():
    """Full AttnRes' newest source after block l-1 is that block's MLP output (before: its attention output)."""
    model = tiny("attnres", n_layer=3)
    tokens = windows(2, 9)[:, :-1]
    _, cache = model.run_with_cache(tokens)
    states = model.run_states(tokens)
    for depth in range(1, 4):
        torch.testing.assert_close(model.scheme.written_tensor(states[depth]), cache[f"blocks.{depth - 1}.hook_mlp_out"])
