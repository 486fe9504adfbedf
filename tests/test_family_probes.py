"""Probes on imported pretrained families, checked against transformers itself (issue 38 part 4).

For a model of every family (test_families.py's cases: transformers' own tiny random models, imported):

* logit lens: the cross-entropy at every depth d equals transformers' hidden_states[d] read through
  transformers' own final norm, head and (Gemma-2) final soft-cap — the family's readout, not ours;
* ablate skip: the cross-entropy with block l bypassed equals transformers' model with its layer l made the
  identity (a forward hook), for every l.

The TransformerLens cache functions on every family are in test_tl_cache.py ("family:<case>").
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_families import CASES, VOCAB, build_hf

from depthtools.analysis import ablate, logit_lens
from depthtools.interop import from_hf

from tiny_models import one_thread  # noqa: F401  (autouse: torch on one thread)

transformers = pytest.importorskip("transformers")

N, T1 = 3, 13  # token windows [N, T+1]: inputs [:, :-1], targets [:, 1:], position 0 unscored


def windows() -> torch.Tensor:
    return torch.randint(0, VOCAB, (N, T1), generator=torch.Generator().manual_seed(5))


def scored_ce(logits: torch.Tensor, toks: torch.Tensor) -> float:
    """Mean cross-entropy over the scored positions (1..T-1 of the inputs), as the probes score."""
    return F.cross_entropy(logits[:, 1:].flatten(0, 1).double(), toks[:, 2:].flatten()).item()


def hf_parts(hf):
    """(decoder layers, final norm, final soft-cap) of a transformers causal LM, whatever the family calls them."""
    body = getattr(hf, "model", None) or getattr(hf, "transformer", None) or hf.gpt_neox
    layers = getattr(body, "layers", None) or body.h
    norm = (getattr(body, "norm", None) or getattr(body, "ln_f", None) or getattr(body, "final_layernorm", None)
            or body.final_layer_norm)
    return layers, norm, getattr(hf.config, "final_logit_softcapping", None)


def hf_readout(hf, hidden: torch.Tensor) -> torch.Tensor:
    """transformers' own head on a hidden state: its final norm, lm_head and final soft-cap."""
    _, norm, cap = hf_parts(hf)
    logits = hf.lm_head(norm(hidden))
    return logits if not cap else torch.tanh(logits / cap) * cap


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("probes")
    return {case: (build_hf(case, root / case), from_hf(root / case)) for case in CASES}


@pytest.mark.parametrize("case", list(CASES))
def test_logit_lens_is_the_familys_own_readout_at_every_depth(models, case):
    hf, ours = models[case]
    toks = windows()
    lens = logit_lens(ours, toks, batch_size=2)
    with torch.no_grad():
        hidden = hf(toks[:, :-1], output_hidden_states=True).hidden_states
        L = ours.n_layer
        for depth in range(L):
            expected = scored_ce(hf_readout(hf, hidden[depth]), toks)
            assert lens["ce"].iloc[depth] == pytest.approx(expected, abs=1e-4), depth
        final = scored_ce(hf(toks[:, :-1]).logits, toks)  # the last entry: the model's own output
    assert lens["ce"].iloc[L] == pytest.approx(final, abs=1e-4)
    assert lens["kl_final_lens"].iloc[L] == 0


def _identity_layer(layer):
    """Make a transformers decoder layer the identity on its hidden states (restored by the returned handles)."""
    seen = {}

    def before(module, args, kwargs):
        seen["x"] = args[0] if args else kwargs["hidden_states"]

    def after(module, args, kwargs, out):
        return (seen["x"], *out[1:]) if isinstance(out, tuple) else seen["x"]

    return [layer.register_forward_pre_hook(before, with_kwargs=True),
            layer.register_forward_hook(after, with_kwargs=True)]


@pytest.mark.parametrize("case", list(CASES))
def test_skip_ablation_equals_transformers_with_the_layer_removed(models, case):
    hf, ours = models[case]
    toks = windows()
    rows = ablate(ours, toks, mode="skip", batch_size=2)
    layers, _, _ = hf_parts(hf)
    for layer in range(ours.n_layer):
        handles = _identity_layer(layers[layer])
        try:
            with torch.no_grad():
                expected = scored_ce(hf(toks[:, :-1]).logits, toks)
        finally:
            for handle in handles:
                handle.remove()
        row = rows.query(f"layer == {layer}").iloc[0]
        assert row["ce"] == pytest.approx(expected, abs=1e-4), layer
    with torch.no_grad():
        intact = scored_ce(hf(toks[:, :-1]).logits, toks)
    assert rows["ce_intact"].iloc[0] == pytest.approx(intact, abs=1e-4)
