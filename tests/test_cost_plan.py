"""The cost plan (depthtools.analysis.cost) against counted block calls and head evaluations on a
tiny model, the swap-pair bound, and the plan line the probe commands print."""

import math

import pytest
import torch

from depthtools.analysis.ablate import ablate, chosen_pairs, swap_pairs
from depthtools.analysis.cost import analysis_cost, head_ratio, plan_line
from depthtools.analysis.suite import analysis_args
from depthtools.errors import DepthToolsError
from tiny_models import one_thread, tiny, windows  # noqa: F401 (fixture)


class Counter:
    """Wraps model.block_step and model.head / model.readout_logits on the instance, counting block
    calls and head work in whole-batch units (rows evaluated / rows of one batch)."""

    def __init__(self, model, rows_per_batch: int):
        self.blocks, self.head_rows, self.rows = 0, 0, rows_per_batch
        block_step, head, readout_logits = model.block_step, model.head, model.readout_logits

        def count_block(*a, **k):
            self.blocks += 1
            return block_step(*a, **k)

        def count_head(state):
            self.head_rows += state.shape[0] * state.shape[1]
            return head(state)

        def count_readout(x):
            self.head_rows += x.shape[:-1].numel()
            return readout_logits(x)

        model.block_step, model.head, model.readout_logits = count_block, count_head, count_readout

    @property
    def heads(self) -> float:
        return self.head_rows / self.rows


def run_counted(name, model, tokens, bs, **options):
    from depthtools.analysis import suite

    args = analysis_args(name, batch_size=bs, **options)
    scored = tokens.shape[1] - 2 if name.startswith("lens") else tokens.shape[1] - 1  # the lens reads scored rows
    counter = Counter(model, bs * scored)
    suite.ANALYSES[name].run(model, tokens, suite.Probe(), **args)
    return counter, analysis_cost(name, model, args, tokens.shape[0], tokens.shape[1] - 1, bs)


@pytest.mark.parametrize("name,options", [
    ("lens_logit", {}),
    ("ablate_skip", {}),
    ("ablate_swap", {}),
    ("ablate_swap", {"swap_pairs_max": 4}),
    ("ablate_swap_adjacent", {}),
    ("ablate_mean", {}),
    ("sequence_profile", {}),
    ("causal", {}),
    ("causal", {"future": False}),
    ("similarity", {}),
])
def test_cost_formula_equals_counted_block_calls(name, options):
    model = tiny("preln", n_layer=5)
    tokens = windows(n=4, length=13)  # 2 batches of 2: per-batch costs are multiplied, not assumed
    counter, cost = run_counted(name, model, tokens, 2, **options)
    assert counter.blocks == cost.blocks
    if name not in ("causal", "similarity"):
        assert counter.heads == pytest.approx(cost.heads)
    h, L = head_ratio(model), model.n_layer
    assert cost.forwards == pytest.approx((cost.blocks + h * cost.heads) / (L + h))


def test_prune_cost_is_an_upper_bound():
    model = tiny("preln", n_layer=4)
    tokens = windows(n=2, length=13)
    counter, cost = run_counted("ablate_prune", model, tokens, 2, tau=0.0)
    assert cost.upper_bound and counter.blocks <= cost.blocks and counter.blocks > cost.blocks / 4


def test_skip_sweep_cost_is_about_half_of_naive_reruns():
    """Σ_l (L-l-1)/L suffix passes: the cost plan states the prefix reuse, ~0.5 L forwards, not L."""
    model = tiny("preln", n_layer=30, vocab=61)
    cost = analysis_cost("ablate_skip", model, analysis_args("ablate_skip"), 8, 12, 8)
    naive = model.n_layer * len(model.scheme.skip_rules) + 1
    assert cost.forwards < 0.6 * naive


def test_swap_pairs_max_spreads_pairs_evenly_and_records_the_bound():
    every = swap_pairs(30, "all")
    assert len(every) == 435
    some = chosen_pairs(30, "all", 64)
    assert len(some) == 64 and some[0] == every[0] and some[-1] == every[-1] and set(some) <= set(every)
    assert chosen_pairs(4, "all", 64) == swap_pairs(4, "all")  # small models: every pair, nothing changes
    with pytest.raises(DepthToolsError, match="swap-pairs-max"):
        chosen_pairs(30, "all", 0)
    args = analysis_args("ablate_swap", swap_pairs_max=10)
    assert args["swap_pairs_max"] == 10  # what table_settings records with the table
    model = tiny("preln", n_layer=6)
    df = ablate(model, windows(n=2, length=9), mode="swap", pairs="all", swap_pairs_max=5)
    assert len(df) == 5
    full = ablate(model, windows(n=2, length=9), mode="swap", pairs="all").set_index(["layer", "layer2"])
    for row in df.itertuples():  # a bounded row means what the unbounded one means
        assert row.delta_ce == pytest.approx(full.loc[(row.layer, row.layer2), "delta_ce"])


def test_plan_line_is_one_line_with_forwards_and_an_eta():
    model = tiny("preln", n_layer=3)
    costs = [analysis_cost(n, model, analysis_args(n), 8, 12, 4) for n in ("lens_logit", "ablate_prune")]
    line = plan_line(model, costs, 2, 0.5)
    assert "\n" not in line and "lens_logit" in line and "≤" in line and "ETA" in line
    total = sum(c.forwards for c in costs)
    assert f"total {total:.0f}" in line
