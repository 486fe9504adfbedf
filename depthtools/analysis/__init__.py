"""Depth analyses on the depth-state contract: similarity, lenses, ablations; tidy tables and plots.

    tokens = sample_windows("data/default", n_tokens=8192, seq_len=128)     # fixed, seeded
    logit_lens(model, tokens)                  -> per-depth lens table
    ablate(model, tokens, mode="skip")         -> per-plan ablation table
    save_table(df, model.checkpoint_dir, "ablate_skip", settings)
"""

import importlib
import sys

# Public names and the submodule each lives in. They are imported on first use (PEP 562), so importing
# one light module of this package (e.g. depthtools.analysis.suite's constants for the CLI) does not
# load torch and TransformerLens (~4 s).
_EXPORTS = {
    "depthtools.analysis.ablate": (
        "MODES", "PAIRS", "UnsupportedAblation", "ablate", "ablate_linear", "ablate_mean", "ablate_prune",
        "ablate_skip", "ablate_swap", "affine_replacement", "angular_distances", "effective_count", "fit_affine",
        "mean_replacement", "prunable_fraction", "swap_pairs"),
    "depthtools.analysis.lens": (
        "LensResult", "TunedLens", "fit_tuned_lens", "lens_analysis", "load_tuned_lens", "logit_lens",
        "prediction_depth", "prediction_depths", "save_tuned_lens", "train_tuned_lens"),
    "depthtools.analysis.plots": ("plot_ablation", "plot_lens", "plot_prune_curve"),
    "depthtools.analysis.similarity": (
        "centre_features", "gram_linear", "u_centre", "hsic_biased", "hsic_unbiased", "linear_cka",
        "top_outlier_dims", "remove_dims", "zscore_features", "CKAAccumulator", "angular_distance_matrix",
        "adjacent_angular_distance", "effective_rank", "participation_ratio", "TokenCollapse", "token_collapse",
        "adjacent_cka", "block_fraction", "n_rep"),
    "depthtools.analysis.sweep": ("PlanStats", "SweepResult", "intact_states", "plan_logits", "sweep"),
    "depthtools.analysis.tables": ("load_table", "model_columns", "save_table", "write_frame"),
    "depthtools.analysis.tokens": ("check_tokens", "recorded_data_dir", "sample_windows", "token_fingerprint"),
    "depthtools.analysis.causal": ("causal_scores", "causal_summary", "mix_by_position", "partial_skip"),
    "depthtools.analysis.contrib": ("contributions", "jacobian_deviation"),
    "depthtools.analysis.geometry": ("depth_similarity", "pair_matrix", "tidy_frame"),
    "depthtools.analysis.routing": ("routing_matrix", "routing_stats"),
    "depthtools.analysis.depthbench": ("depthbench_checkpoint", "depthbench_metrics"),
    "depthtools.analysis.summary": (
        "effective_depth_row", "grid_slopes", "grid_summary", "load_results", "model_summaries", "sequence_profile"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
# Exports named like their own submodule: importing the submodule sets the package attribute to the
# module, so these are resolved on every access (as before, `depthtools.analysis.ablate` is the function).
_SHADOWED = frozenset(name for name, module in _WHERE.items() if module.rsplit(".", 1)[1] == name)

__all__ = list(_WHERE)


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'depthtools.analysis' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(sys.modules[__name__].__class__):
    def __getattribute__(self, name: str):
        if name in _SHADOWED:
            return getattr(importlib.import_module(_WHERE[name]), name)
        return super().__getattribute__(name)


sys.modules[__name__].__class__ = _Package
