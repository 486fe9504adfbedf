"""The remaining probes on imported families (issue 38 parts 4 and 5): DepthBench's protocol on Gemma-2's
final soft-cap (applied exactly: its losses equal transformers' own), the attention/MLP split on the
parallel-residual family (GPT-NeoX), and swap / prune / causal / similarity / contrib running to finite
numbers on a tiny model of every family."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from test_families import CASES, VOCAB, build_hf
from test_family_probes import _identity_layer, hf_parts

from depthtools.analysis import ablate
from depthtools.arch import Plan
from depthtools.interop import from_hf

from tiny_models import one_thread  # noqa: F401  (autouse: torch on one thread)

transformers = pytest.importorskip("transformers")


def windows(n: int = 3, t: int = 13) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, t), generator=torch.Generator().manual_seed(7))


def all_positions_ce(logits: torch.Tensor, ids: torch.Tensor) -> float:
    """DepthBench's loss: next-token CE over every position of the window."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).double(), ids[:, 1:].flatten()).item()


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma2")
    return build_hf("gemma2-softcap-window", root), from_hf(root)


def test_depthbench_losses_apply_gemma2s_final_softcap_exactly(gemma2):
    from depthtools.analysis.depthbench import family, mean_lm_loss

    hf, ours = gemma2
    ids = windows()
    assert family(ours) == "residual"
    with torch.no_grad():
        out = hf(ids, output_hidden_states=True)
        _, norm, cap = hf_parts(hf)
        uncapped = hf.lm_head(norm(out.hidden_states[-1])) if cap else None
    assert cap  # the case has a final soft-cap...
    assert abs(all_positions_ce(uncapped, ids) - all_positions_ce(out.logits, ids)) > 1e-2  # ...that binds
    assert mean_lm_loss(ours, ids, micro_batch_size=2) == pytest.approx(all_positions_ce(out.logits, ids), abs=1e-4)
    layers, _, _ = hf_parts(hf)
    for layer in range(ours.n_layer):  # DepthBench's skip (the identity for the residual family)
        handles = _identity_layer(layers[layer])
        try:
            with torch.no_grad():
                expected = all_positions_ce(hf(ids).logits, ids)
        finally:
            for handle in handles:
                handle.remove()
        got = mean_lm_loss(ours, ids, plan=Plan.skipping(layer, rule="identity"), micro_batch_size=2)
        assert got == pytest.approx(expected, abs=1e-4), layer


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("more")
    out = {}
    for case in CASES:
        build_hf(case, root / case)
        out[case] = from_hf(root / case)
    return out


def test_contrib_splits_attention_and_mlp_on_the_parallel_residual_family(models):
    from depthtools.analysis.suite import run_contrib

    case = next(c for c in CASES if "parallel" in c)
    model = models[case]
    assert model.backbone.parallel
    df = run_contrib(model, windows(), batch_size=2, jacobian=False)
    layered = df[df["layer"].notna()]
    additive = layered[layered["metric"] == "additive"]["value"]
    assert len(additive) == model.n_layer and (additive == 1).all()  # attn_out + mlp_out = the block's update
    for metric in ("attn_relative", "mlp_relative"):
        values = layered[layered["metric"] == metric]["value"]
        assert len(values) == model.n_layer and values.map(math.isfinite).all() and (values > 0).all()


@pytest.mark.parametrize("case", list(CASES))
def test_swap_prune_causal_similarity_contrib_run_on_every_family(models, case):
    from depthtools.analysis.suite import run_causal, run_contrib, run_similarity

    model, toks = models[case], windows()
    swaps = ablate(model, toks, mode="swap", pairs="all", batch_size=2)
    assert len(swaps) == model.n_layer * (model.n_layer - 1) // 2 and swaps["ce"].map(math.isfinite).all()
    prune = ablate(model, toks, mode="prune", batch_size=2, tau=0.0)
    assert prune["ce"].map(math.isfinite).all()
    for frame in (run_causal(model, toks, batch_size=2), run_similarity(model, toks, batch_size=2),
                  run_contrib(model, toks, batch_size=2)):
        values = frame["value"].dropna()
        assert len(values) and values.map(math.isfinite).all()
