"""The cost plan (depthtools.analysis.cost) against counted block calls and head evaluations on a
tiny model, the swap-pair bound, and the plan line the probe commands print."""


import pytest
import torch

from depthtools.analysis.ablate import ablate, chosen_pairs, swap_pairs
from depthtools.analysis.cost import analysis_cost, head_ratio, plan_line
from depthtools.analysis.suite import analysis_args
from depthtools.errors import DepthToolsError

from tiny_models import one_thread, tiny, windows  # noqa: F401 (fixture)


class Counter:
    """Wraps model.block_step, the scheme's suffix step (causal's shared rows) and model.head /
    model.readout_logits / model.hidden_logits on the instance, counting block calls (a suffix step on S of
    T rows counts S/T) and head work in whole-batch units (rows evaluated / rows of one batch)."""

    def __init__(self, model, rows_per_batch: int):
        self.blocks, self.head_rows, self.rows = 0, 0, rows_per_batch
        block_step, head, readout_logits, hidden_logits = (model.block_step, model.head, model.readout_logits,
                                                           model.hidden_logits)

        def count_block(*a, **k):
            self.blocks += 1
            return block_step(*a, **k)

        suffix_step = getattr(model.scheme, "step_suffix", None)
        if suffix_step is not None:
            def count_suffix(position, block, rows, home, rope, start, past):
                self.blocks += rows.shape[1] / (start + rows.shape[1])
                return suffix_step(position, block, rows, home, rope, start, past)

            model.scheme.step_suffix = count_suffix

        def count_head(state):
            self.head_rows += state.shape[0] * state.shape[1]
            return head(state)

        def count_readout(x):
            self.head_rows += x.shape[:-1].numel()
            return readout_logits(x)

        def count_hidden(x, out=None):
            self.head_rows += x.shape[:-1].numel()
            return hidden_logits(x, out=out)

        model.block_step, model.head, model.readout_logits = count_block, count_head, count_readout
        model.hidden_logits = count_hidden

    @property
    def heads(self) -> float:
        return self.head_rows / self.rows


from depthtools.analysis.headmetrics import Head  # noqa: E402


def run_counted(name, model, tokens, bs, **options):
    from depthtools.analysis import suite

    args = analysis_args(name, batch_size=bs, **options)
    scored = tokens.shape[1] - 2 if name.startswith("lens") else tokens.shape[1] - 1  # the lens reads scored rows
    counter = Counter(model, bs * scored)
    logits = Head.logits

    # the vocabulary-chunked head decodes the scored rows only (T − 1 of a sweep plan's T), a chunk being
    # (hi − lo) / V of a head row: counted as the full-width head evaluation it stands for
    per_row = 1.0 if name.startswith("lens") else (tokens.shape[1] - 1) / (tokens.shape[1] - 2)

    def count_chunk(head, x, lo, hi):
        counter.head_rows += x.shape[0] * (hi - lo) / head.vocab * per_row
        return logits(head, x, lo, hi)

    Head.logits = count_chunk
    try:
        suite.ANALYSES[name].run(model, tokens, suite.Probe(), **args)
    finally:
        Head.logits = logits
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
    ("causal", {"cuts": [3, 9, 5, 9]}),
    ("similarity", {}),
])
def test_cost_formula_equals_counted_block_calls(name, options):
    model = tiny("preln", n_layer=5)
    tokens = windows(n=4, length=13)  # 2 batches of 2: per-batch costs are multiplied, not assumed
    counter, cost = run_counted(name, model, tokens, 2, **options)
    assert counter.blocks == pytest.approx(cost.blocks, rel=1e-12)
    if name not in ("causal", "similarity"):
        assert counter.heads == pytest.approx(cost.heads)
    h, L = head_ratio(model), model.n_layer
    assert cost.forwards == pytest.approx((cost.blocks + h * cost.heads) / (L + h))


@pytest.mark.parametrize("arch,options", [("preln", {}), ("hc", {}), ("preln", {"moe_experts": 2, "moe_layers": "dmdm"})])
def test_routing_cost_equals_counted_block_calls(arch, options):
    """Issue 47: the normalisation family has no native depth routing, so routing runs no block there."""
    model = tiny(arch, n_layer=4, **options)
    counter, cost = run_counted("routing", model, windows(n=4, length=13), 2)
    L = model.n_layer
    # routing runs all 4 sequences at once (HC's native routing; the expert routing's batches of 8): each call
    # does the work of 2 of the plan's batches of 2
    expected = 2 * (L + 3 + 2 + 1) if options else {"preln": 0, "hc": 2 * L}[arch]  # MoE 1, 3: L + Σ_(s<3) (L−s−1)
    assert 2 * counter.blocks == cost.blocks == expected


@pytest.mark.parametrize("prune", ["order", "greedy"])
def test_prune_cost_is_an_upper_bound(prune):
    model = tiny("preln", n_layer=4)
    tokens = windows(n=2, length=13)
    counter, cost = run_counted("ablate_prune", model, tokens, 2, tau=0.0, prune=prune)
    assert cost.upper_bound and counter.blocks <= cost.blocks and counter.blocks > cost.blocks / 4
    assert counter.heads <= cost.heads


def test_default_prune_is_O_L_plans_and_reuses_the_measured_skip_sweep():
    """Issue 47: the order curve is ~L plans (the greedy one ~L²/2); with the skip sweep already
    measured it runs no single-skip plan again, which the plan's `skip_measured` cost states."""
    from depthtools.analysis import suite

    model = tiny("preln", n_layer=5)
    tokens = windows(n=2, length=13)
    rule = model.scheme.skip_rules[0]
    args = analysis_args("ablate_prune", batch_size=2, rules=[rule])
    skip = ablate(model, tokens, mode="skip", rules=[rule], batch_size=2)
    counter = Counter(model, 2 * 12)
    suite.ANALYSES["ablate_prune"].run(model, tokens, suite.Probe(), **args)
    alone = counter.blocks
    counter = Counter(model, 2 * 12)
    ablate(model, tokens, mode="prune", rules=[rule], batch_size=2,
           skip_delta={rule: list(skip.sort_values("layer")["delta_ce"])})
    reused = counter.blocks
    L = model.n_layer
    assert alone - reused == L + sum(L - l - 1 for l in range(L))  # exactly one skip sweep fewer
    measured = analysis_cost("ablate_prune", model, args, 2, 12, 2, skip_measured=True)
    assert reused <= measured.blocks < analysis_cost("ablate_prune", model, args, 2, 12, 2).blocks
    big = tiny("preln", n_layer=30, vocab=61)
    order = analysis_cost("ablate_prune", big, analysis_args("ablate_prune"), 8, 12, 8, skip_measured=True)
    greedy = analysis_cost("ablate_prune", big, analysis_args("ablate_prune", prune="greedy"), 8, 12, 8)
    assert order.forwards < greedy.forwards / 8


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


# -- the command line: the plan line, --swap-pairs-max, --dtype, --device ---------------------------------

@pytest.fixture
def cell(tmp_path, data_dir, monkeypatch):
    """A tiny 4-layer checkpoint recording the fixture corpus."""
    from depthtools import checkpoint as ck
    from depthtools.arch import DepthModel
    from depthtools.config import ModelConfig

    model = DepthModel(ModelConfig(arch="preln", vocab_size=256, d_model=32, n_layer=4, n_heads=4, max_seq_len=32),
                       seed=0)
    directory = tmp_path / "grid" / "preln_L4"
    ck.save(model, directory, extra={"data": {"path": str(data_dir)}})
    monkeypatch.setenv("DEPTHTOOLS_CHECKPOINTS", str(tmp_path / "grid"))
    return directory


def cli(*args):
    from typer.testing import CliRunner

    from cli.main import app

    return CliRunner().invoke(app, [str(a) for a in args])


EVAL = ["--n-tokens", "64", "--seq-len", "16"]


def test_probe_and_analyze_print_one_plan_line_and_record_the_swap_bound(cell):
    from depthtools.analysis.tables import load_settings

    result = cli("ablate", "--ckpt", "preln_L4", "--mode", "swap", "--pairs", "all", "--swap-pairs-max", "3", *EVAL)
    assert result.exit_code == 0, result.output
    plans = [line for line in result.stderr.splitlines() if line.startswith("plan ")]
    assert len(plans) == 1 and "ablate_swap" in plans[0] and "ETA" in plans[0]
    assert load_settings(cell, "ablate_swap")["swap_pairs_max"] == 3
    assert result.stdout.count("preln_L4") >= 3
    result = cli("analyze", "--grid", cell.parent, *EVAL, "--only", "ablate_swap,lens_logit", "--swap-pairs-max", "3")
    assert result.exit_code == 0, result.output
    line = [line for line in result.stdout.splitlines() if line.startswith("plan ")]
    assert len(line) == 1 and "lens_logit" in line[0] and "1 saved table(s) reused" in line[0]


def test_prune_option_names_the_curve_and_bad_values_are_refused(cell):
    from depthtools.analysis.tables import load_table

    result = cli("ablate", "--ckpt", "preln_L4", "--mode", "prune", *EVAL, "--prune", "greedy")
    assert result.exit_code == 0, result.output
    assert set(load_table(cell, "ablate_prune")["method"]) == {"greedy", "gromov"}
    result = cli("analyze", "--ckpt", "preln_L4", *EVAL, "--only", "ablate_skip,ablate_prune")
    assert result.exit_code == 0, result.output
    assert set(load_table(cell, "ablate_prune")["method"]) == {"skip_order", "gromov"}
    for command in (["ablate", "--mode", "prune"], ["analyze"]):
        bad = cli(*command, "--ckpt", "preln_L4", *EVAL, "--prune", "best")
        assert bad.exit_code == 2 and "unknown --prune 'best'; valid: order, greedy" in bad.output
        assert len([line for line in bad.output.splitlines() if line.strip()]) == 1


def test_dtype_bfloat16_and_float16_run_close_to_float32_and_bad_values_are_refused(cell):
    from depthtools.analysis.tables import load_settings

    for dtype in ("float32", "bfloat16", "float16"):
        result = cli("lens", "--ckpt", "preln_L4", *EVAL, "--dtype", dtype, "--out", cell.parent / f"{dtype}.csv")
        assert result.exit_code == 0, result.output
        assert load_settings(cell, "lens_logit").get("dtype", "float32") == dtype  # the table says its dtype
    import pandas as pd

    f32, bf16, f16 = (pd.read_csv(cell.parent / f"{d}.csv") for d in ("float32", "bfloat16", "float16"))
    for low, bound in ((bf16, 0.05), (f16, 0.01)):  # float16 has 3 more mantissa bits than bfloat16
        assert (f32["ce"] - low["ce"]).abs().max() < bound * f32["ce"].abs().max()
        assert not f32["ce"].equals(low["ce"])  # it really ran in the low precision
    bad = cli("lens", "--ckpt", "preln_L4", *EVAL, "--dtype", "int8")
    assert bad.exit_code == 2 and "--dtype" in bad.output and "bfloat16, float16" in bad.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
@pytest.mark.parametrize("command", ["lens", "ablate", "causal", "similarity", "contrib", "routing", "analyze",
                                     "depthbench"])
def test_device_cuda_is_refused_in_one_line_without_cuda(cell, command):
    result = cli(command, "--ckpt", "preln_L4", *EVAL, "--device", "cuda")
    assert result.exit_code == 2 and "no CUDA device" in result.output
    assert len([line for line in result.output.splitlines() if line.strip()]) == 1


def test_retime_after_the_first_analysis_prints_a_corrected_eta_only_on_drift():
    """Issue 47: within 20% of the plan nothing is printed; off by more, one batch is re-timed and one
    line gives the corrected ETA of the remaining forward equivalents."""
    from depthtools.analysis.cost import forward_seconds, retime_note

    model, tokens = tiny("preln", n_layer=3), windows(n=4, length=13)
    assert retime_note(model, tokens, 2, "similarity", 1.1, 10, 0.1, 50) is None
    line = retime_note(model, tokens, 2, "similarity", 3.0, 10, 0.1, 50)
    assert line.startswith("re-timed after similarity: it took 3 s against 1 s planned (3.00x)")
    assert "corrected ETA of the rest ~" in line and "\n" not in line
    assert forward_seconds(model, tokens, 2) > 0


def test_similarity_plan_includes_its_timed_statistics():
    """Issue 47: the plan counted similarity as L blocks; its CKA, spectra and collapse cost more than that
    at a real width, so they are timed on 2 sequences and added (block-equivalents)."""
    from depthtools.analysis.cost import describe, similarity_seconds

    model, tokens = tiny("preln", n_layer=3), windows(n=4, length=13)
    args = analysis_args("similarity", batch_size=2)
    assert similarity_seconds(model, tokens, 2, args) > 0
    _, costs = describe(model, {"similarity": args}, tokens, 2)
    assert costs[0].blocks > analysis_cost("similarity", model, args, 4, 12, 2).blocks


def test_sequence_profile_and_skip_share_one_sweep_in_the_suite():
    """Issue 47: inside `shared_sweeps` (analyze_grid's block per model) ablate_skip's default rule reuses the
    sweep sequence_profile ran: no block call, the same table as alone; the plan counts exactly that."""
    from depthtools.analysis import suite
    from depthtools.analysis.sweep import shared_sweeps

    model = tiny("preln", n_layer=4)
    tokens = windows(n=4, length=13)
    alone = suite.ANALYSES["ablate_skip"].run(model, tokens, suite.Probe(), **analysis_args("ablate_skip", batch_size=2))
    names = ["sequence_profile", "ablate_skip"]
    assert suite.shared_sweep(names, model) == "ablate_skip"
    assert suite.shared_sweep(names, model, rule=model.scheme.skip_rules[-1]) in (None, "ablate_skip")
    with shared_sweeps():
        suite.ANALYSES["sequence_profile"].run(model, tokens, suite.Probe(), **analysis_args("sequence_profile",
                                                                                                batch_size=2))
        counter = Counter(model, 2 * 12)
        shared = suite.ANALYSES["ablate_skip"].run(model, tokens, suite.Probe(),
                                                   **analysis_args("ablate_skip", batch_size=2))
    cost = analysis_cost("ablate_skip", model, analysis_args("ablate_skip"), 4, 12, 2, shared=True)
    assert counter.blocks == cost.blocks and counter.heads == pytest.approx(cost.heads)
    import pandas as pd

    pd.testing.assert_frame_equal(shared, alone, check_exact=False, rtol=0, atol=1e-12)
    counter = Counter(model, 2 * 12)  # outside the block nothing is remembered
    suite.ANALYSES["ablate_skip"].run(model, tokens, suite.Probe(), **analysis_args("ablate_skip", batch_size=2))
    assert counter.blocks == analysis_cost("ablate_skip", model, analysis_args("ablate_skip"), 4, 12, 2).blocks


def test_one_intact_forward_per_batch_serves_the_suite():
    """Issue 47: inside `shared_sweeps` each batch's intact states are computed once for all probes; the
    tables equal those of probes run alone, and the plan's `sharing_states` counts the block calls exactly."""
    from depthtools.analysis import suite
    from depthtools.analysis.cost import intact_passes, plan_cost, sharing_states
    from depthtools.analysis.sweep import shared_sweeps

    model = tiny("preln", n_layer=4)
    tokens = windows(n=4, length=13)
    names = ["similarity", "causal", "lens_logit", "ablate_swap_adjacent", "ablate_skip"]
    args = {name: analysis_args(name, batch_size=2) for name in names}
    alone = {name: suite.ANALYSES[name].run(model, tokens, suite.Probe(), **args[name]) for name in names}
    counter = Counter(model, 2 * 12)
    with shared_sweeps():
        together = {name: suite.ANALYSES[name].run(model, tokens, suite.Probe(), **args[name]) for name in names}
    h = head_ratio(model)
    skips_from = suite.causal_skips(names, model)
    assert skips_from == "ablate_skip"  # causal's skip runs are its default rule's plans: decoded, not run again
    costs = sharing_states(plan_cost(model, args, 4, 12, 2, h, skips_from=skips_from),
                           {n: intact_passes(n, model, args[n]) for n in names}, model.n_layer, 2, h)
    assert counter.blocks == sum(c.blocks for c in costs)
    assert counter.blocks < sum(c.blocks for c in plan_cost(model, args, 4, 12, 2, h))
    import pandas as pd

    for name in names:
        a, b = alone[name], together[name]
        a, b = (a["lens_logit"], b["lens_logit"]) if isinstance(a, dict) else (a, b)
        pd.testing.assert_frame_equal(a, b)


def test_contrib_plan_times_its_jacobian_vector_products(monkeypatch):
    """Issue 47: contrib's JVPs are timed (the first blocks, one batch) instead of assumed to cost 3 blocks each."""
    from depthtools.analysis import cost as cost_module

    model, tokens = tiny("preln", n_layer=3), windows(n=4, length=13)
    seconds = cost_module.jvp_seconds(model, tokens, 2)
    assert seconds is not None and seconds > 0
    monkeypatch.setattr(cost_module, "jvp_seconds", lambda *a, **k: 1.75)  # fixed timings: the arithmetic is exact
    monkeypatch.setattr(cost_module, "time_parts", lambda *a, **k: (0.25, 0.5))  # a block 0.25 s, the head 0.5 s
    monkeypatch.setattr(cost_module, "contrib_seconds", lambda *a, **k: 1.25)  # its statistics: 5 blocks
    args = analysis_args("contrib", batch_size=2)
    _, (cost,) = cost_module.describe(model, {"contrib": args}, tokens, 2)
    static = analysis_cost("contrib", model, args, 4, 12, 2)
    assert cost.blocks == static.blocks + 5 + (7.0 - cost_module.FULL_JVP_BLOCKS) * 2 * 3 * 2  # probes · L · batches


def test_jvp_seconds_times_the_block_work_contrib_runs(monkeypatch):
    """Issue 47: the JVP share is timed on what `jacobian_deviation` runs per block (`block_deviation`: the draws,
    the batched JVP and the float64 reductions), once on block 0 to warm up and once on each of the first blocks,
    with the batch's sequences and the probes asked for; None where contrib runs no JVP."""
    from depthtools.analysis import contrib as contrib_module, cost as cost_module

    model, tokens = tiny("preln", n_layer=4), windows(n=6, length=13)
    calls = []
    real = contrib_module.block_deviation

    def counted(model_, position, state, gen, exclude_first, probes):
        calls.append((position, state.shape[0], probes))
        return real(model_, position, state, gen, exclude_first, probes)

    monkeypatch.setattr(cost_module, "block_deviation", counted)
    assert cost_module.jvp_seconds(model, tokens, 2, probes=3, blocks=3) > 0
    assert calls == [(0, 2, 3), (0, 2, 3), (1, 2, 3), (2, 2, 3)]
    monkeypatch.setattr(cost_module, "block_deviation", lambda *a, **k: None)
    assert cost_module.jvp_seconds(model, tokens, 2) is None


def test_contrib_seconds_times_the_statistics_contrib_runs(monkeypatch):
    """Issue 47: contrib's per-block statistics are timed on a sample and scaled by the sequences: the
    function timed is the one `contributions` calls (counted), once per repeat."""
    from depthtools.analysis import contrib as contrib_module, cost as cost_module

    model, tokens = tiny("preln", n_layer=3), windows(n=6, length=13)
    calls = []
    real = contrib_module.block_statistics

    def counted(*a, **k):
        calls.append(a[1][0].shape[0])  # the sequences of the batch it got
        return real(*a, **k)

    monkeypatch.setattr(cost_module, "block_statistics", counted)
    seconds = cost_module.contrib_seconds(model, tokens, analysis_args("contrib", batch_size=2), sample=2, repeats=3)
    assert calls == [2, 2, 2] and seconds > 0


def test_lens_plan_times_its_final_depth_and_a_mean_of_depths(monkeypatch):
    """Issue 47: the lens is planned from its own steps, timed as it runs them: the final depth (`lens.final_depth`,
    its reference: once per chunk, after a warm-up) and a mean over the first depths (`lens.depth_step`, after one
    untimed step); the plan then charges the final depth once and the mean L times per batch."""
    from depthtools.analysis import cost as cost_module, lens as lens_module

    model, tokens = tiny("preln", n_layer=4), windows(n=4, length=13)
    finals, steps = [], []
    real_final, real_step = lens_module.final_depth, lens_module.depth_step

    def final_counted(model_, rows, *a, **k):
        finals.append(rows.shape[0])
        return real_final(model_, rows, *a, **k)

    def step_counted(model_, rows, depth, *a, **k):
        steps.append(depth)
        return real_step(model_, rows, depth, *a, **k)

    monkeypatch.setattr(lens_module, "final_depth", final_counted)
    monkeypatch.setattr(lens_module, "depth_step", step_counted)
    t_final, per_depth = cost_module.lens_seconds(model, tokens, 2, depths=3)
    assert t_final > 0 and per_depth > 0
    assert finals == [2 * (12 - 1)] * 2 and steps == [0, 0, 1, 2]  # the scored rows of one batch of 2 windows

    monkeypatch.setattr(cost_module, "lens_seconds", lambda *a, **k: (1.0, 0.75))  # fixed timings: exact arithmetic
    monkeypatch.setattr(cost_module, "time_parts", lambda *a, **k: (0.25, 0.5))  # a block 0.25 s, the head 0.5 s
    args = analysis_args("lens_logit", batch_size=2)
    _, (cost,) = cost_module.describe(model, {"lens_logit": args}, tokens, 2)
    static = analysis_cost("lens_logit", model, args, 4, 12, 2)
    assert cost.blocks == static.blocks + ((1.0 - 0.5) + (0.75 - 0.5) * 4) / 0.25 * 2  # per batch, 2 batches


@pytest.mark.parametrize("name,options", [
    ("ablate_skip", {}),
    ("sequence_profile", {}),
    ("ablate_swap", {"swap_pairs_max": 4}),
    ("ablate_swap_adjacent", {}),
    ("ablate_mean", {}),
    ("ablate_linear", {}),
    ("ablate_prune", {"tau": 0.0}),
    ("ablate_prune", {"tau": 0.0, "prune": "greedy"}),
    ("lens_logit", {}),
    ("causal", {}),
])
def test_sweep_references_equal_counted_intact_references(monkeypatch, name, options):
    """Issue 47: the plan charges each sweep's intact reference (`sweep.intact_reference`, ~3 heads) as timed, once
    per sweep and batch; `sweep_references` says how many there are, counted here as each analysis runs."""
    import importlib

    from depthtools.analysis import cost as cost_module, suite

    sweep_module = importlib.import_module("depthtools.analysis.sweep")  # the package exports the function `sweep`
    model, tokens = tiny("preln", n_layer=4), windows(n=4, length=13)  # 2 batches of 2
    calls = []
    real = sweep_module.intact_reference

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(sweep_module, "intact_reference", counted)
    args = analysis_args(name, batch_size=2, **options)
    suite.ANALYSES[name].run(model, tokens, suite.Probe(), **args)
    planned = 2 * cost_module.sweep_references(name, model, args)
    if options.get("prune") == "greedy":  # its curve may stop early: the plan is a bound, as its blocks are
        assert 0 < len(calls) <= planned
    else:
        assert len(calls) == planned


def test_plan_charges_each_sweep_reference_as_timed(monkeypatch):
    """Issue 47: with fixed timings the arithmetic is exact: (reference − head) / block per reference and batch."""
    from depthtools.analysis import cost as cost_module

    model, tokens = tiny("preln", n_layer=3), windows(n=4, length=13)
    monkeypatch.setattr(cost_module, "reference_seconds", lambda *a, **k: 1.25)  # a reference: 2.5 heads
    monkeypatch.setattr(cost_module, "time_parts", lambda *a, **k: (0.25, 0.5))  # a block 0.25 s, the head 0.5 s
    args = analysis_args("ablate_swap_adjacent", batch_size=2)
    _, (cost,) = cost_module.describe(model, {"ablate_swap_adjacent": args}, tokens, 2)
    static = analysis_cost("ablate_swap_adjacent", model, args, 4, 12, 2)
    assert cost.blocks == static.blocks + (1.25 - 0.5) / 0.25 * 2  # one sweep, 2 batches
    assert cost_module.reference_seconds(model, tokens, 2) > 0


def test_causal_plan_times_its_row_runs(monkeypatch):
    """Issue 47: causal's row runs (each cut below the largest runs its rows ≥ c) are counted as (T − c)/T of a block
    but cost more (attention over all keys, a fixed part): the plan adds their timed excess per skipped block,
    timed on the runs causal makes (`causal._rows_run`: the largest cut whole, then each other cut's rows, beside
    the whole rows), and nothing where the future effect is off or runs whole sequences."""
    from depthtools.analysis import causal as causal_module, cost as cost_module

    model, tokens = tiny("preln", n_layer=5), windows(n=4, length=13)
    args = analysis_args("causal", batch_size=2, cuts=[3, 9, 5, 9])
    starts = []
    real = causal_module._rows_run

    def counted(model_, s, first, start, past):
        starts.append((s, start, first.shape[1]))
        return real(model_, s, first, start, past)

    monkeypatch.setattr(causal_module, "_rows_run", counted)
    excess = cost_module.suffix_excess(model, tokens, 2, args, blocks=2, repeats=2)
    assert excess > -1.0  # a ratio of times: positive on a real machine, bounded below by −Σ share
    run = [(2, 0, 12), (2, 3, 9), (2, 5, 7)]  # blocks 3..4: the whole rows, then rows ≥ 3 and ≥ 5 (9 runs whole)
    assert starts == [(2, 0, 12)] + run + run
    assert cost_module.suffix_excess(model, tokens, 2, analysis_args("causal", batch_size=2, future=False)) == 0.0
    assert cost_module.suffix_excess(tiny("hc", n_layer=3), tokens, 2, args) == 0.0  # whole sequences per cut

    monkeypatch.setattr(cost_module, "suffix_excess", lambda *a, **k: 0.5)  # fixed timings: the arithmetic is exact
    monkeypatch.setattr(cost_module, "time_parts", lambda *a, **k: (0.25, 0.5))
    _, (cost,) = cost_module.describe(model, {"causal": args}, tokens, 2)
    static = analysis_cost("causal", model, args, 4, 12, 2)
    assert cost.blocks == static.blocks + 0.5 * (4 + 3 + 2 + 1) * 2  # per skipped block s: its L − s − 1 blocks
