"""The depth-task grid (issue 17 §2-§3): the `tasks` preset, a task-only demo run and report, and the finding
that says where in k a deep-narrow model beats a shallow-wide one beyond training-seed noise."""

from __future__ import annotations

import re

import pandas as pd
import pytest
from scipy import stats

from depthtools.presets import PRESETS, Preset, get_preset
from depthtools.report import findings

from tiny_models import one_thread  # noqa: F401  (autouse: one intra-op thread)


# -- the preset ------------------------------------------------------------------------------------
def test_tasks_preset_plans_iso_parameter_task_only_cells_with_seeds():
    from depthtools.grid import parse_seeds  # noqa: F401  (the preset's seeds go through the planner)

    preset = get_preset("tasks")
    spec = preset.grid_spec()
    cells = spec["cells"]
    assert sorted({c["model"]["n_layer"] for c in cells}) == [2, 4, 8]
    assert sorted({c.get("seed", 0) for c in cells}) == [0, 1, 2] or len(cells) == 9
    assert {c["name"] for c in cells} >= {"preln_L2", "preln_L8", "preln_L8_s2"}
    from depthtools.arch import DepthModel
    from depthtools.config import ModelConfig

    sizes = [sum(p.numel() for p in DepthModel(ModelConfig(**c["model"]), seed=0).parameters()) for c in cells]
    assert max(sizes) / min(sizes) < 1.1, sizes  # iso-parameter: width traded for depth
    mix = spec["train"]["task_mix"]
    assert mix["fraction"] == 1.0 and mix["answer_only"] and mix["curriculum"]["threshold"] == 0.9
    assert preset.probes is False and preset.task_eval["tasks"] == ["s5"]


# -- the finding -----------------------------------------------------------------------------------
def _tasks(per_depth: dict[int, dict[int, list[float]]], task: str = "s5", arch: str = "preln") -> pd.DataFrame:
    """A long tasks_eval frame: per depth, per k, one accuracy per seed."""
    rows = []
    for n_layer, per_k in per_depth.items():
        for k, values in per_k.items():
            for seed, v in enumerate(values):
                name = f"{arch}_L{n_layer}" + (f"_s{seed}" if seed else "")
                rows.append(dict(model=name, arch=arch, n_layer=n_layer, d_model=64, task=task, k=k, metric="accuracy",
                                 value=v, in_train_range=True, seed=seed))
    return pd.DataFrame(rows)


def test_depth_separation_reports_the_k_where_depth_wins_beyond_seed_noise():
    deep, shallow = [0.80, 0.86, 0.93], [0.005, 0.0, 0.015]
    frame = _tasks({2: {1: [1.0, 1.0, 1.0], 2: [0.9, 1.0, 0.95], 3: shallow},
                    8: {1: [1.0, 1.0, 1.0], 2: [1.0, 0.92, 0.99], 3: deep}})
    (sentence,) = findings.depth_separation(frame)
    assert "L8 is more accurate beyond seed noise at k = 3 " in sentence, sentence
    # the Welch interval, computed independently with scipy
    ci = stats.ttest_ind(deep, shallow, equal_var=False).confidence_interval(0.95)
    half = (ci.high - ci.low) / 2
    assert f"±{half:.3g} over 3 seeds" in sentence, (sentence, half)
    assert f"difference {sum(deep) / 3 - sum(shallow) / 3:+.2f}" in sentence
    assert "at the other 2 k the two are within seed noise" in sentence


def test_depth_separation_calls_overlapping_seeds_a_tie_and_one_seed_no_estimate():
    tie = _tasks({2: {1: [1.0] * 3, 3: [0.1, 0.6, 0.3]}, 8: {1: [1.0] * 3, 3: [0.5, 0.2, 0.7]}})
    (sentence,) = findings.depth_separation(tie)
    assert "within seed noise at every k" in sentence and "more accurate" not in sentence, sentence
    assert "largest gap +0.13 at k = 3" in sentence, sentence
    one = _tasks({2: {1: [1.0], 3: [0.0]}, 8: {1: [1.0], 3: [0.9]}})
    (sentence,) = findings.depth_separation(one)
    assert "not compared without a seed-noise estimate" in sentence and "one seed" in sentence, sentence
    shallower = _tasks({2: {1: [0.9, 0.95, 0.92]}, 8: {1: [0.1, 0.05, 0.12]}})
    (sentence,) = findings.depth_separation(shallower)
    assert "L2 is more accurate beyond seed noise at k = 1" in sentence, sentence


def test_depth_separation_is_silent_on_a_task_no_model_learned():
    """Heuristic-level accuracies (the demo's 5% task rows: 0.00 vs 0.09 at k=1) are not a depth effect, even
    when their seed intervals separate: below the threshold at the smallest k, nothing is compared."""
    unlearned = _tasks({2: {1: [0.08, 0.10, 0.09], 2: [0.05, 0.06, 0.04]}, 8: {1: [0.0, 0.0, 0.01], 2: [0.0] * 3}},
                       task="chase")
    assert findings.depth_separation(unlearned) == []
    learned_elsewhere = pd.concat([unlearned, _tasks({2: {1: [1.0] * 3}, 8: {1: [1.0] * 3}}, task="s5")])
    assert [s.split(" (")[0] for s in findings.depth_separation(learned_elsewhere)] == ["Depth task s5"]


# -- a task-only grid end to end through the demo runner ---------------------------------------------
@pytest.fixture(scope="module")
def task_demo(data_dir, tmp_path_factory, request):
    """A tiny task-only preset (preln L1/L2 x 2 seeds on s5) run by `run_demo`: train, tasks eval, report."""
    from depthtools.demo import run_demo

    root = tmp_path_factory.mktemp("task_demo")
    preset = Preset(
        "tinytasks", "test: task-only grid",
        plan=dict(arch=["preln"], budget=30_000, vocab_size=256, layers=[1, 2], seeds=[0, 1], n_heads=2,
                  head_dim_multiple=2, ffn_multiple=8, tolerance=0.15, max_seq_len=64),
        train=dict(tokens=250 * 16 * 64, batch_size=16, seq_len=64, lr=3e-3, eval_every=0, eval_tokens=512,
                   log_every=25, depth_stats_every=0, checkpoint_every=0, threads=1,
                   task_mix=dict(fraction=1.0, tasks=["s5"], k_min=1, k_max=3, answer_only=True,
                                 curriculum=dict(threshold=0.9, every=25, n=16))),
        data=dict(dir=str(data_dir)), probes=False, task_eval=dict(tasks=["s5"], ks="1-3", n=32))
    PRESETS["tinytasks"] = preset
    request.addfinalizer(lambda: PRESETS.pop("tinytasks", None))
    stages = []
    result = run_demo("tinytasks", root=root / "ckpt", data_root=root / "data", reports_root=root / "reports",
                      on_progress=lambda stage, fraction, detail: stages.append(stage), workers=1)
    return result, stages


def test_task_only_demo_skips_text_probes_and_evaluates_the_preset_tasks(task_demo):
    result, stages = task_demo
    assert "analyze" not in stages and "summary" not in stages and "tasks" in stages
    assert not list(result.grid_dir.glob("*/analysis/lens_logit*.parquet"))  # no text probe ran
    evaluated = pd.read_parquet(result.grid_dir / "analysis" / "tasks_eval.parquet")
    assert set(evaluated["task"]) == {"s5"} and sorted(evaluated["k"].unique()) == [1, 2, 3]
    assert set(evaluated[evaluated["metric"] == "n_samples"]["value"]) == {32}


def test_task_only_report_shows_tasks_curriculum_and_says_why_text_sections_are_absent(task_demo):
    from report_fixtures import parse_report

    result, _ = task_demo
    page = parse_report(result.report)
    assert page.sections == ["overview", "findings", "depth-tasks", "training-curves", "missing"], page.sections
    assert {"fig-depth-tasks", "fig-curriculum", "fig-training-curves"} <= set(page.figures)
    assert "fig-loss-vs-shape" not in page.figures
    said = " ".join(page.findings)
    assert "trained on the synthetic task stream alone" in said, said
    assert re.search(r"Depth task s5 \(preln, deep-narrow L2 vs shallow-wide L1\)", said), said
    # task-only cells are not expected to carry text-probe tables, so none is listed as missing
    assert "lens" not in " ".join(page.notes) and "summarize" not in " ".join(page.notes), page.notes
