"""Depth analyses on the depth-state contract: similarity, lenses, ablations; tidy tables and plots.

    tokens = sample_windows("data/default", n_tokens=8192, seq_len=128)     # fixed, seeded
    logit_lens(model, tokens)                  -> per-depth lens table
    ablate(model, tokens, mode="skip")         -> per-plan ablation table
    save_table(df, model.checkpoint_dir, "ablate_skip", settings)
"""

from depthtools.analysis.ablate import (
    MODES, PAIRS, UnsupportedAblation, ablate, ablate_linear, ablate_mean, ablate_prune, ablate_skip,
    ablate_swap, affine_replacement, angular_distances, effective_count, fit_affine, mean_replacement,
    prunable_fraction, swap_pairs,
)
from depthtools.analysis.lens import (
    LensResult, TunedLens, fit_tuned_lens, lens_analysis, load_tuned_lens, logit_lens, prediction_depth,
    prediction_depths, save_tuned_lens, train_tuned_lens,
)
from depthtools.analysis.plots import plot_ablation, plot_lens, plot_prune_curve
from depthtools.analysis.similarity import *  # noqa: F401,F403 (existing exports stay importable)
from depthtools.analysis.similarity import __all__ as _similarity_all
from depthtools.analysis.sweep import PlanStats, SweepResult, intact_states, plan_logits, sweep
from depthtools.analysis.tables import load_table, model_columns, save_table, write_frame
from depthtools.analysis.tokens import check_tokens, recorded_data_dir, sample_windows, token_fingerprint

__all__ = [
    *_similarity_all,
    "MODES", "PAIRS", "UnsupportedAblation", "ablate", "ablate_linear", "ablate_mean", "ablate_prune",
    "ablate_skip", "ablate_swap", "affine_replacement", "angular_distances", "effective_count", "fit_affine",
    "mean_replacement", "prunable_fraction", "swap_pairs",
    "LensResult", "TunedLens", "fit_tuned_lens", "lens_analysis", "load_tuned_lens", "logit_lens",
    "prediction_depth", "prediction_depths", "save_tuned_lens", "train_tuned_lens",
    "plot_ablation", "plot_lens", "plot_prune_curve",
    "PlanStats", "SweepResult", "intact_states", "plan_logits", "sweep",
    "load_table", "model_columns", "save_table", "write_frame",
    "check_tokens", "recorded_data_dir", "sample_windows", "token_fingerprint",
]
from depthtools.analysis.causal import causal_scores, causal_summary, mix_by_position, partial_skip  # noqa: E402
from depthtools.analysis.contrib import contributions, jacobian_deviation  # noqa: E402
from depthtools.analysis.geometry import depth_similarity, pair_matrix, tidy_frame  # noqa: E402
from depthtools.analysis.routing import routing_matrix, routing_stats  # noqa: E402
from depthtools.analysis.summary import (  # noqa: E402
    effective_depth_row, grid_slopes, grid_summary, load_results, model_summaries, sequence_profile,
)

__all__ += [
    "causal_scores", "causal_summary", "mix_by_position", "partial_skip", "contributions", "jacobian_deviation",
    "depth_similarity", "pair_matrix", "tidy_frame", "routing_matrix", "routing_stats", "effective_depth_row",
    "grid_slopes", "grid_summary", "load_results", "model_summaries", "sequence_profile",
]
