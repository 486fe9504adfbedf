"""Causal's shared rows (issue 47): the suffix step of a block (`NormFamilyScheme.step_suffix`,
`Attention.attend_rows`) against the whole-sequence step, the future effect with shared rows against
whole runs of every cut, and the whole-run fallback where the suffix step is not defined."""

import pytest
import torch

from depthtools.analysis import causal
from depthtools.analysis.causal import causal_scores, suffix_support
from depthtools.analysis.cost import analysis_cost
from depthtools.analysis.suite import analysis_args
from depthtools.arch.norm_family import RECIPES

from tiny_models import one_thread, tiny, windows  # noqa: F401 (fixture)

# Every normalisation-family architecture, and Pre-LN options that touch a per-token op or attention's view
# of positions (the imported Hugging Face families are these options: docs/pretrained.md)
CASES = [(arch, {}) for arch in RECIPES] + [
    ("preln", dict(attn_softcap=5.0, sliding_window=4, layer_types="sfsf", norm_gain="one_plus", out_norm=True,
                   embed_scale=2.0, final_softcap=3.0, attn_scale=0.3)),  # Gemma-2: local/global, softcaps
    ("preln", dict(sliding_window=3, rope_theta_sliding=100.0, layer_types="sffs", qk_norm="head")),  # Gemma-3
    ("preln", dict(parallel=True, rotary_fraction=0.5, norm="layer", norm_bias=True, qkv_bias=True,
                   mlp="plain", mlp_act="gelu")),  # GPT-NeoX / Phi
    ("preln", dict(pre_norm=False, out_norm=True, qk_norm="full", qkv_clip=0.5)),  # OLMo-2, a clip
    ("preln", dict(moe_experts=4, moe_top_k=2, moe_shared_ff=16, moe_layers="mdmm")),  # Qwen2-MoE
    ("preln", dict(positions="learned", attn_out_bias=True, head_bias=True)),  # GPT-2-like
    ("preln", dict(rope_type="dynamic", rope_factor=2.0, rope_original_context=8)),  # length-dependent RoPE
    ("preln", dict(rope_type="llama3", rope_factor=8.0, rope_original_context=8)),
]


def ids(case):
    arch, options = case
    return arch + ("-" + "-".join(sorted(options)[:2]) if options else "")


@pytest.mark.parametrize("case", CASES, ids=[ids(c) for c in CASES])
def test_suffix_step_equals_the_rows_of_the_whole_step(case):
    arch, options = case
    model = tiny(arch, n_layer=4, context=24, **options)
    rope = (model.rope_cos, model.rope_sin)
    tokens = windows(2, 14)
    with torch.no_grad():
        states = model.run_states(tokens)
        for p in range(model.n_layer):
            block, z = model.blocks[p], states[p]
            whole = model.scheme.step(p, block, z, block, rope)
            at_zero, (k, v) = model.scheme.step_suffix(p, block, z, block, rope, 0, None)
            assert torch.equal(at_zero, whole)  # start 0: the step's own arithmetic
            assert k.shape[:2] == v.shape[:2] == (2, 14)
            for start in (1, 5, 13):
                rows, (k2, v2) = model.scheme.step_suffix(p, block, z[:, start:], block, rope, start,
                                                          (k[:, :start], v[:, :start]))
                assert rows.shape == whole[:, start:].shape
                assert (rows - whole[:, start:]).abs().max() <= 1e-12  # float64
                assert (k2 - k).abs().max() <= 1e-12 and (v2 - v).abs().max() <= 1e-12


def whole_runs(model, tokens, **kw):
    """causal_scores with every cut run over whole sequences (the fallback forced)."""
    real = causal.suffix_support
    causal.suffix_support = lambda m: "forced for the reference"
    try:
        return causal_scores(model, tokens, **kw)
    finally:
        causal.suffix_support = real


@pytest.mark.parametrize("case", CASES, ids=[ids(c) for c in CASES])
def test_future_effect_with_shared_rows_equals_whole_runs(case, monkeypatch):
    arch, options = case
    model = tiny(arch, n_layer=4, context=24, **options).float()  # float32: the precision analyses run in
    assert suffix_support(model) is None
    calls = []
    step_suffix = model.scheme.step_suffix

    def counted(p, block, rows, home, rope, start, past):
        calls.append(start)
        return step_suffix(p, block, rows, home, rope, start, past)

    model.scheme.step_suffix = counted
    tokens = windows(4, 14)
    kw = dict(batch_size=2, future=True, cuts=[3, 9, 6, 9], exclude_first=1)
    got = causal_scores(model, tokens, **kw)
    assert set(calls) == {0, 3, 6}  # the top cut whole, the two smaller ones by rows; the repeated 9 reuses it
    ref = whole_runs(model, tokens, **kw)
    assert list(got.metric) == list(ref.metric) and list(got.layer_j.fillna(-1)) == list(ref.layer_j.fillna(-1))
    fut = got.metric.str.startswith("future")
    assert got[fut].value.notna().all()
    assert (got.value - ref.value).abs().max() <= 1e-6


@pytest.mark.parametrize("arch", ["hc", "mhc", "attnres", "blockattnres", "denseformer", "moda"])
def test_other_schemes_have_no_suffix_step(arch):
    assert suffix_support(tiny(arch, n_layer=2)) == f"{arch} has no suffix step"


@pytest.mark.parametrize("arch", ["hc", "mhc", "denseformer"])  # (AttnRes' and MoDA's future effect is NaN)
def test_other_schemes_run_whole_sequences_and_the_plan_counts_them(arch):
    from test_cost_plan import run_counted

    model = tiny(arch, n_layer=3)
    counter, cost = run_counted("causal", model, windows(2, 13), 2, cuts=[3, 7])
    assert counter.blocks == cost.blocks  # whole runs only: 3 + 3·(1 + 2 cuts)
    L = model.n_layer
    assert cost.blocks == L + sum((L - s - 1) * 3 for s in range(L))


def test_a_hooked_model_runs_whole_sequences():
    model = tiny("preln", n_layer=3)
    calls = []
    model.scheme.step_suffix = lambda *a: calls.append(a)
    with model.hooks(fwd_hooks=[("blocks.1.hook_resid_pre", lambda t, hook: t)]):
        assert suffix_support(model) == "a hook is attached to the model"
        causal_scores(model, windows(2, 13), batch_size=2, cuts=[4, 8])
    assert calls == [] and suffix_support(model) is None


def test_a_subclass_that_changes_the_step_does_not_inherit_the_suffix_step():
    model = tiny("preln", n_layer=2)

    class Changed(type(model.scheme)):
        def step(self, *a, **k):
            return super().step(*a, **k)

    model.scheme.__class__ = Changed
    assert suffix_support(model) == "preln has no suffix step"


def test_the_plan_counts_rows_at_the_suite_default():
    """At T = 128 the default cuts are 8, 48, 80, 120: the cuts cost 1 + (120 + 80 + 48)/128 runs per skipped
    block instead of 4."""
    model = tiny("preln", n_layer=30, vocab=61, context=128)
    args = analysis_args("causal")
    shared = analysis_cost("causal", model, args, 8, 128, 8)
    L = 30
    assert shared.blocks == pytest.approx(L + sum((L - s - 1) * (2 + 248 / 128) for s in range(L)))
    whole = analysis_cost("causal", tiny("hc", n_layer=30, vocab=61, context=128), args, 8, 128, 8)
    assert whole.blocks == L + sum((L - s - 1) * 5 for s in range(L))


def test_attend_rows_refuses_keys_of_the_wrong_rows():
    from depthtools.errors import DepthToolsError

    model = tiny("preln", n_layer=1)
    attn, x = model.blocks[0].attn, torch.randn(1, 6, 32, dtype=torch.float64)
    _, (k, v) = attn.attend_rows(x, 0, None, model.rope_cos, model.rope_sin)
    for start, past in ((2, None), (0, (k[:, :2], v[:, :2])), (3, (k[:, :2], v[:, :2]))):
        with pytest.raises(DepthToolsError, match="earlier rows"):
            attn.attend_rows(x[:, start:], start, past, model.rope_cos, model.rope_sin)
