"""The sweep engine, evaluation token sets and result tables (depthtools.analysis.sweep/tokens/tables)."""

import pytest
import torch

from depthtools.analysis import (
    check_tokens,
    intact_states,
    load_table,
    plan_logits,
    sample_windows,
    save_table,
    sweep,
    token_fingerprint,
)
from depthtools.arch import Plan, list_archs
from depthtools.errors import DepthToolsError

from tiny_models import VOCAB, one_thread, tiny, windows  # noqa: F401 (fixture)

ARCHS = [spec.name for spec in list_archs()]


@pytest.mark.parametrize("arch", ARCHS)
def test_cached_prefix_plans_equal_naive_full_reruns(arch):
    model, toks = tiny(arch), windows()
    inputs = toks[:, :-1]
    states = intact_states(model, inputs)
    L = model.n_layer
    plans = [Plan.skipping(l, rule=rule) for rule in model.scheme.skip_rules for l in range(L)]
    plans += [Plan.swapping(1, 2, L), Plan.swapping(0, 3, L), Plan(skip=frozenset({1, 3}))]
    for plan, cached in zip(plans, plan_logits(model, plans, states)):
        assert torch.equal(cached, model.run(inputs, plan=plan)), (plan.skip, plan.skip_rule, plan.order)
    fast = sweep(model, toks, plans, batch_size=2)
    slow = sweep(model, toks, plans, batch_size=2, reuse_prefix=False)
    assert fast == slow


@pytest.mark.parametrize("arch", ARCHS)
def test_plans_extending_the_previous_one_start_from_its_state_and_equal_full_reruns(arch):
    """Issue 47: a plan that does what the previous plan did up to a position past its own first change (the
    order pruning curve: k+1 blocks removed extend k) starts from the previous run's state there; its numbers
    are a full re-run's, bit for bit, and fewer blocks run than from the intact prefix."""
    from depthtools.analysis.sweep import common_prefix, plan_hidden

    model, toks = tiny(arch), windows()
    inputs = toks[:, :-1]
    L, rule = model.n_layer, model.scheme.skip_rules[-1]
    order = list(range(L))
    order[2], order[3] = 3, 2
    plans = [Plan(skip=frozenset({1})), Plan(skip=frozenset({1, 3})), Plan(skip=frozenset({1, 2, 3})),
             Plan(skip=frozenset({1, 2, 3})), Plan(skip=frozenset({1}), order=tuple(order)),
             Plan(skip=frozenset({1, 3}), skip_rule=rule), Plan(skip=frozenset({0, 1, 3}), skip_rule=rule)]
    assert [common_prefix(model, a, b) for a, b in zip(plans, plans[1:])] == \
        [3, 2, L, 2, 2 if rule == model.scheme.skip_rules[0] else 1, 0]
    states = intact_states(model, inputs)
    calls = []
    step = model.block_step
    model.block_step = lambda *a, **k: calls.append(a[0]) or step(*a, **k)
    try:
        hidden = list(plan_hidden(model, plans, states, inputs))
    finally:
        del model.block_step
    for plan, h in zip(plans, hidden):
        assert torch.equal(h, model.scheme.final_hidden(model.run_states(inputs, plan=plan)[-1], model.ln_final))
    from_intact = sum(L - plan.first_change(L) - len(plan.skip) for plan in plans)
    assert len(calls) < from_intact
    assert sweep(model, toks, plans, batch_size=2) == sweep(model, toks, plans, batch_size=2, reuse_prefix=False)


@pytest.mark.parametrize("arch", ["preln", "hc", "attnres", "denseformer", "moda"])
def test_causal_skip_runs_serve_the_skip_sweep_in_the_suite(arch):
    """Issue 47: inside `shared_sweeps` causal's single-skip runs are kept (`remember_hidden`), so the skip
    sweep after it runs no block for those plans and gives exactly the numbers it gives alone."""
    from depthtools.analysis.causal import causal_scores
    from depthtools.analysis.sweep import shared_sweeps

    model, toks = tiny(arch), windows(4)
    L = model.n_layer
    plans = [Plan.skipping(l) for l in range(L)]
    alone = sweep(model, toks, plans, batch_size=2)
    calls = []
    step = model.block_step
    with shared_sweeps():
        causal_scores(model, toks, batch_size=2, future=False)
        model.block_step = lambda *a, **k: calls.append(a[0]) or step(*a, **k)
        try:
            shared = sweep(model, toks, plans, batch_size=2)
        finally:
            del model.block_step
    # no skip plan's block runs (the intact pass too where states are tensors, which shared_sweeps keeps)
    assert calls in ([], list(range(L)) * 2) and shared == alone
    assert [torch.equal(a, b) for a, b in zip(shared.plan_sequences, alone.plan_sequences)] == [True] * L


def test_identity_plan_matches_intact_and_batching_is_invisible():
    model, toks = tiny("preln"), windows(5)
    result = sweep(model, toks, [Plan(), Plan.skipping(2)], batch_size=2)
    assert result.plans[0].kl == 0 and result.plans[0].ce == result.intact.ce
    assert result.plans[0].top1_agree == 1.0 and result.intact.n_tokens == 5 * 11  # 12 inputs, position 0 not scored
    one = sweep(model, toks, [Plan.skipping(2)], batch_size=5)
    assert one.plans[0].ce == pytest.approx(result.plans[1].ce, rel=1e-12)
    assert one.plans[0].kl == pytest.approx(result.plans[1].kl, rel=1e-10)
    assert result.plans[1].kl > 0


def test_position_zero_is_not_scored():
    from depthtools.analysis.sweep import scored_logprobs
    from depthtools.analysis.tokens import split_inputs

    toks = windows(2)
    inputs, targets = split_inputs(toks)
    assert torch.equal(inputs, toks[:, :-1]) and torch.equal(targets, toks[:, 2:])  # no target for position 0
    logits = torch.randn(2, 12, VOCAB, dtype=torch.float64)
    changed = logits.clone()
    changed[:, 0] = 1e3 * torch.randn(2, VOCAB, dtype=torch.float64)
    assert torch.equal(scored_logprobs(logits), scored_logprobs(changed))
    assert scored_logprobs(logits).shape == (2 * 11, VOCAB)


def test_sample_windows_are_deterministic_and_checked(tmp_path):
    from depthtools.data import prepare

    data = prepare(corpus="text-dir", text_dir="tests/fixtures/tiny_corpus", out_dir=tmp_path)
    a = sample_windows(data, 100, 16, seed=3)
    b = sample_windows(data, 100, 16, seed=3)
    assert a.shape == (7, 17) and a.dtype == torch.long and torch.equal(a, b)
    assert not torch.equal(a, sample_windows(data, 100, 16, seed=4))
    assert token_fingerprint(a) == token_fingerprint(b)
    with pytest.raises(DepthToolsError, match="empty token set"):
        sample_windows(data, 0, 16)
    with pytest.raises(DepthToolsError, match="no split"):
        sample_windows(data, 10, 16, split="nope")


def test_check_tokens_rejects_bad_token_sets():
    model = tiny("preln")
    with pytest.raises(DepthToolsError, match="exceeds the model's context 24"):
        check_tokens(model, windows(1, 30))
    with pytest.raises(DepthToolsError, match="empty token set"):
        check_tokens(model, torch.zeros(0, 10, dtype=torch.long))
    with pytest.raises(DepthToolsError, match="vocabulary"):
        check_tokens(model, torch.full((1, 8), VOCAB))
    with pytest.raises(DepthToolsError, match=r"\[N, T\+1\]"):
        check_tokens(model, torch.zeros(8, dtype=torch.long))
    with pytest.raises(DepthToolsError, match="no scored position"):
        check_tokens(model, torch.zeros(2, 2, dtype=torch.long))


def test_save_table_round_trips_and_refuses_other_settings(tmp_path):
    import pandas as pd

    df = pd.DataFrame({"model": ["a", "a"], "layer": pd.array([0, None], dtype="Int64"), "delta_ce": [0.1, 0.2]})
    settings = {"mode": "skip", "rules": ("identity",), "tau": 0.05}
    path = save_table(df, tmp_path, "ablate_skip", settings)
    assert path == tmp_path / "analysis" / "ablate_skip.parquet" and (tmp_path / "analysis" / "ablate_skip.json").is_file()
    back = load_table(tmp_path, "ablate_skip", {"mode": "skip", "rules": ["identity"], "tau": 0.05})
    pd.testing.assert_frame_equal(back, df)
    assert load_table(tmp_path, "ablate_skip", {**settings, "tau": 0.1}) is None
    assert load_table(tmp_path, "missing", settings) is None


@pytest.mark.parametrize("arch", ["preln", "hc", "denseformer"])
def test_chunked_head_sweep_equals_the_full_vocabulary_sweep(arch):
    """Issue 45/47: every plan decoded by the vocabulary-chunked head (`headmetrics`, chunks of 64 ids so a
    tiny vocabulary spans several) has the CE, KL and top-1 metrics of the full log-softmax path (float64
    models: to 1e-9; agreement exactly); an unchanged plan is the intact model exactly (KL 0)."""
    import depthtools.analysis.headmetrics as hm

    model, toks = tiny(arch), windows()
    L = model.n_layer
    plans = [Plan(), *(Plan.skipping(l) for l in range(L)), Plan.swapping(0, L - 1, L)]
    chunk = hm.CHUNK
    hm.CHUNK = 64
    try:
        new = sweep(model, toks, plans, batch_size=2, chunked_head=True)
    finally:
        hm.CHUNK = chunk
    old = sweep(model, toks, plans, batch_size=2, chunked_head=False)
    assert new.intact == old.intact and new.plans[0] == old.plans[0] and new.plans[0].kl == 0
    for a, b in zip(new.plans, old.plans):
        assert abs(a.ce - b.ce) < 1e-9 and abs(a.kl - b.kl) < 1e-9
        assert (a.top1_agree, a.top1_acc, a.n_tokens) == (b.top1_agree, b.top1_acc, b.n_tokens)
    assert torch.allclose(torch.stack(new.plan_sequences), torch.stack(old.plan_sequences), rtol=0, atol=1e-8)
