"""The depth-state contract (docs/design.md §3), checked for every registered architecture."""

import pytest
import torch

from depthtools.arch import DepthModel, Plan, list_archs
from depthtools.config import ModelConfig

from tiny_models import VOCAB, one_thread, perturb, tiny, windows  # noqa: F401 (fixture)

ARCHS = [spec.name for spec in list_archs()]


@pytest.mark.parametrize("arch", ARCHS)
def test_builds_and_is_causal(arch):
    model, toks = tiny(arch), windows(2, 12)
    logits = model(toks)
    assert logits.shape == (2, 12, VOCAB) and torch.isfinite(logits).all()
    changed = toks.clone()
    changed[:, 7] = (changed[:, 7] + 1) % VOCAB
    other = model(changed)
    assert torch.equal(logits[:, :7], other[:, :7]), "a later token changed an earlier logit"
    assert not torch.allclose(logits[:, 7:], other[:, 7:])


@pytest.mark.parametrize("arch", ARCHS)
def test_readout_of_final_state_is_the_models_logits(arch):
    model, toks = tiny(arch), windows(2, 12)
    states = model.run_states(toks)
    assert len(states) == model.n_layer + 1
    assert torch.equal(model.head(states[-1]), model(toks))
    geometry = model.geometry(states[2])
    assert geometry.shape[:2] == toks.shape and geometry.dim() == 3


@pytest.mark.parametrize("arch", ARCHS)
def test_run_from_cached_state_equals_full_run(arch):
    model, toks = tiny(arch), windows(2, 12)
    states = model.run_states(toks)
    full = model(toks)
    for depth in range(model.n_layer + 1):
        assert torch.equal(model.run(from_state=states[depth], start=depth), full)
    plan = Plan.skipping(2)
    naive = model.run(toks, plan=plan)
    assert torch.equal(model.run(plan=plan, start=2, from_state=states[2]), naive)


@pytest.mark.parametrize("arch", ARCHS)
def test_swap_twice_is_identity_and_swap_changes_output(arch):
    model, toks = tiny(arch), windows(2, 12)
    L = model.n_layer
    order = list(range(L))
    order[1], order[2] = order[2], order[1]
    once = model.run(toks, plan=Plan(order=tuple(order)))
    twice_order = [order[i] for i in order]  # composing the swap with itself
    assert twice_order == list(range(L))
    assert torch.equal(model.run(toks, plan=Plan(order=tuple(twice_order))), model(toks))
    assert not torch.allclose(once, model(toks))


@pytest.mark.parametrize("arch", ARCHS)
def test_gradients_reach_every_parameter(arch):
    cfg = ModelConfig(arch=arch, vocab_size=VOCAB, d_model=32, n_layer=3, n_heads=4, max_seq_len=24)
    model = DepthModel(cfg, seed=0)
    perturb(model, 0.02)  # zero-init gains (ReZero, queries) would give exact-zero grads elsewhere
    toks = windows(2, 12)
    loss = torch.nn.functional.cross_entropy(model(toks).flatten(0, 1), toks.roll(-1, 1).flatten())
    loss.backward()
    dead = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not dead, f"parameters without gradient: {dead}"


@pytest.mark.parametrize("arch", ARCHS)
def test_registry_extra_parameter_formula_matches_built_model(arch):
    from depthtools.arch import get_arch

    for n_layer, d in ((3, 32), (5, 48)):
        cfg = ModelConfig(arch=arch, vocab_size=VOCAB, d_model=d, n_layer=n_layer, n_heads=4)
        built = DepthModel(cfg).param_counts()["total"]
        base = DepthModel(cfg.replace(arch="preln")).param_counts()["total"]
        assert built - base == get_arch(arch).extra_params(cfg)


@pytest.mark.parametrize("arch", ARCHS)
def test_hooks_exist_and_run_with_cache_returns_activation_cache(arch):
    from transformer_lens import ActivationCache

    model, toks = tiny(arch), windows(2, 12)
    logits, cache = model.run_with_cache(toks)
    assert isinstance(cache, ActivationCache)
    # with hooks attached the pattern is formed explicitly (not fused SDPA): same function
    assert torch.allclose(logits, model(toks), atol=1e-10)
    assert "hook_embed" in cache and "ln_final.hook_normalized" in cache
    for name in ("attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_z", "attn.hook_pattern", "mlp.hook_post"):
        assert f"blocks.0.{name}" in cache, name
    pattern = cache["blocks.0.attn.hook_pattern"]
    assert torch.allclose(pattern.sum(-1), torch.ones_like(pattern.sum(-1)))


@pytest.mark.parametrize("arch", ARCHS)
def test_training_steps_leave_the_state_dict_as_it_was(arch, tmp_path):
    """Work buffers a scheme keeps between steps are not model state: after two training steps the
    state dict has the same entries, and the checkpoint saves and loads (to the same logits)."""
    from depthtools.checkpoint import load, save

    model, toks = tiny(arch), windows(2, 12)
    before = model.state_dict()
    for _ in range(2):
        model.train()(toks).square().mean().backward()
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(after[k].shape == before[k].shape for k in before)
    save(model.float(), tmp_path / "ckpt")
    loaded = load(tmp_path / "ckpt")
    assert torch.equal(loaded.eval()(toks), model.eval()(toks))
