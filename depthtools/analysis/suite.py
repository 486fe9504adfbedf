"""The whole depth-probe suite over a checkpoint or a grid, resumable (what `depthtools analyze` runs).

Every analysis of the suite reads the same fixed evaluation windows (`eval_tokens`: sampled from the
checkpoint's recorded data directory) and saves its tidy table(s) beside the checkpoint with the
settings it ran with (`table_settings`: the analysis, its arguments, the token-set hash and the
weight hash). A table already saved with identical settings is not recomputed, so an interrupted
`analyze_grid` resumes where it stopped and a changed setting never reuses a stale result.

    from depthtools.analysis.suite import analyze_grid
    report = analyze_grid("checkpoints/tiny", n_tokens=2048, seq_len=64)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from depthtools.errors import DepthToolsError

# (analysis name) -> the tables it writes, when they differ from its own name
OUTPUTS = {"lens_logit": ("lens_logit", "lens_logit_summary", "prediction_depth"),
           "lens_tuned": ("lens_tuned", "lens_tuned_summary", "prediction_depth_tuned")}


# -- the evaluation token set and what a saved table depends on ------------------------------------

def eval_tokens(ckpt_dir: str | Path, data: str | Path | None, n_tokens: int, seq_len: int, split: str = "val",
                seed: int = 0):
    """The fixed evaluation windows [n, seq_len] of a checkpoint (from `data` or its recorded data dir,
    checked against the checkpoint's tokenizer and data fingerprint: `tokens.checkpoint_data_dir`)."""
    from depthtools.analysis.tokens import checkpoint_data_dir, sample_windows

    data_dir = checkpoint_data_dir(Path(ckpt_dir), data)
    return sample_windows(data_dir, n_tokens, seq_len, split=split, seed=seed)


def table_settings(name: str, args: dict[str, Any], model, tokens) -> dict[str, Any]:
    """What a saved table depends on: the analysis, its arguments, the token set and the weights."""
    from depthtools.analysis.lens import model_fingerprint
    from depthtools.analysis.tokens import token_fingerprint

    return {"analysis": name, **args, "tokens": token_fingerprint(tokens), "tokens_shape": list(tokens.shape),
            "model": model_fingerprint(model)}


# -- the single analyses (thin, keyword-complete wrappers so the suite can record their arguments) ---

def run_causal(model, tokens, batch_size=8, exclude_first=1, rule=None, future=True, cuts=None):
    from depthtools.analysis.causal import causal_scores

    return causal_scores(model, tokens, batch_size=batch_size, rule=rule, exclude_first=exclude_first,
                         future=future, cuts=cuts)


def run_similarity(model, tokens, batch_size=8, exclude_first=1, cka_batch=256, outlier_k=1):
    from depthtools.analysis.geometry import depth_similarity

    return depth_similarity(model, tokens, batch_size=batch_size, exclude_first=exclude_first,
                            cka_batch=cka_batch, outlier_k=outlier_k)


def run_contrib(model, tokens, batch_size=8, exclude_first=1, jacobian=True, probes=2):
    from depthtools.analysis.contrib import contributions

    return contributions(model, tokens, batch_size=batch_size, exclude_first=exclude_first, jacobian=jacobian,
                         probes=probes)


def run_routing(model, tokens, exclude_first=1, long_range_k=4):
    from depthtools.analysis.routing import routing_stats

    return routing_stats(model, tokens, exclude_first=exclude_first, long_range_k=long_range_k)


def _lens(model, tokens, batch_size):
    from depthtools.analysis.lens import lens_analysis

    result = lens_analysis(model, tokens, batch_size=batch_size)
    return {"lens_logit": result.depths, "lens_logit_summary": result.summary, "prediction_depth": result.tokens}


def _ablate(mode: str):
    def runner(model, tokens, **args):
        from depthtools.analysis.ablate import ablate

        return {f"ablate_{mode}": ablate(model, tokens, mode=mode, **args)}
    return runner


def _single(name: str, fn: Callable):
    return lambda model, tokens, **args: {name: fn(model, tokens, **args)}


def analysis_suite(swap_pairs: str = "all", tau: float = 0.05, batch_size: int = 8,
                   exclude_first: int = 1) -> dict[str, tuple[dict[str, Any], Callable]]:
    """name -> (arguments, runner(model, tokens, **arguments) -> {table name: DataFrame})."""
    from depthtools.analysis.summary import sequence_profile

    return {
        "similarity": (dict(batch_size=batch_size, exclude_first=exclude_first, cka_batch=256, outlier_k=1),
                       _single("similarity", run_similarity)),
        "causal": (dict(batch_size=batch_size, exclude_first=exclude_first, rule=None, future=True, cuts=None),
                   _single("causal", run_causal)),
        "contrib": (dict(batch_size=batch_size, exclude_first=exclude_first, jacobian=True, probes=2),
                    _single("contrib", run_contrib)),
        "routing": (dict(exclude_first=exclude_first, long_range_k=4), _single("routing", run_routing)),
        "sequence_profile": (dict(batch_size=batch_size, rule=None), _single("sequence_profile", sequence_profile)),
        "lens_logit": (dict(batch_size=batch_size), lambda m, t, batch_size: _lens(m, t, batch_size)),
        "ablate_skip": (dict(batch_size=batch_size), _ablate("skip")),
        "ablate_prune": (dict(batch_size=batch_size, tau=tau), _ablate("prune")),
        "ablate_swap": (dict(batch_size=batch_size, pairs=swap_pairs), _ablate("swap")),
    }


# -- running it --------------------------------------------------------------------------------------

@dataclass
class AnalyzeReport:
    """What `analyze_grid` did: counts, and one line per analysis that did not apply."""

    checkpoints: int = 0
    ran: int = 0
    reused: int = 0
    not_applicable: list[str] = field(default_factory=list)


def choose(only: str | list[str] | None, suite: dict[str, Any], tuned_lens: bool = False) -> list[str]:
    """The analyses to run, validated against the suite (`only` is a comma list or a list)."""
    names = list(suite) + (["lens_tuned"] if tuned_lens else [])
    if only is None:
        return names
    chosen = [s for s in (only.replace(" ", "").split(",") if isinstance(only, str) else only) if s]
    unknown = [s for s in chosen if s not in suite and s != "lens_tuned"]
    if unknown:
        raise DepthToolsError(f"unknown analysis {unknown}; valid: {', '.join([*suite, 'lens_tuned'])}")
    return chosen


def _tuned_lens_tables(model, tokens, ckpt_dir, data, n_tokens, seq_len, seed, batch_size):
    """Fit a tuned lens on train-split windows, then evaluate it on the evaluation windows."""
    from depthtools.analysis.lens import fit_tuned_lens, lens_analysis
    from depthtools.analysis.tokens import check_tokens

    train_tokens = check_tokens(model, eval_tokens(ckpt_dir, data, 4 * n_tokens, seq_len, "train", seed))
    lens = fit_tuned_lens(model, train_tokens, ckpt_dir, batch_size=batch_size)
    result = lens_analysis(model, tokens, lens, batch_size=batch_size)
    return {"lens_tuned": result.depths, "lens_tuned_summary": result.summary, "prediction_depth_tuned": result.tokens}


def analyze_grid(grid: str | Path, data: str | Path | None = None, n_tokens: int = 4096, seq_len: int = 128,
                 split: str = "val", seed: int = 0, batch_size: int = 8, exclude_first: int = 1,
                 only: str | list[str] | None = None, swap_pairs: str = "all", tau: float = 0.05,
                 tuned_lens: bool = False, force: bool = False,
                 progress: Callable[[str, int, int], None] | None = None) -> AnalyzeReport:
    """Run the suite over every checkpoint of a grid directory; tables with identical settings are reused.

    `progress(description, done, total)` is called before each analysis and once at the end.
    An analysis that does not apply to an architecture (e.g. linear ablation of a bank state) is
    recorded in `not_applicable`, not raised.
    """
    from depthtools.analysis.summary import checkpoint_dirs
    from depthtools.analysis.tables import load_table, save_table
    from depthtools.analysis.tokens import check_tokens
    from depthtools.checkpoint import load

    suite = analysis_suite(swap_pairs, tau, batch_size, exclude_first)
    chosen = choose(only, suite, tuned_lens)
    dirs = checkpoint_dirs(grid)
    report = AnalyzeReport(checkpoints=len(dirs))
    total, step = len(dirs) * len(chosen), 0
    for ckpt_dir in dirs:
        model = load(ckpt_dir)
        tokens = check_tokens(model, eval_tokens(ckpt_dir, data, n_tokens, seq_len, split, seed))
        for name in chosen:
            if progress is not None:
                progress(f"{ckpt_dir.name}: {name}", step, total)
            step += 1
            args, runner = suite.get(name, (dict(batch_size=batch_size), None))
            settings = table_settings(name, args, model, tokens)
            outputs = OUTPUTS.get(name, (name,))
            if not force and all(load_table(ckpt_dir, o, settings) is not None for o in outputs):
                report.reused += 1
                continue
            try:
                if name == "lens_tuned":
                    tables = _tuned_lens_tables(model, tokens, ckpt_dir, data, n_tokens, seq_len, seed, batch_size)
                else:
                    tables = runner(model, tokens, **args)
            except DepthToolsError as exc:
                report.not_applicable.append(f"{ckpt_dir.name}: {name}: {exc}")
                continue
            for table_name, df in tables.items():
                save_table(df, ckpt_dir, table_name, settings)
            report.ran += 1
    if progress is not None:
        progress("analyze: done", total, total)
    return report


def summarize_grid(grid: str | Path, n_boot: int = 1000, seed: int = 0, save: bool = True):
    """Effective-depth summary per model and marginal effective depth per architecture (saved under the grid)."""
    from depthtools.analysis.summary import SUMMARY_FIELDS, grid_summary, model_summaries
    from depthtools.analysis.tables import save_table

    models = model_summaries(grid)
    slopes = grid_summary(grid, n_boot=n_boot, seed=seed)
    if save:
        save_table(models, grid, "effective_depth_models", {"fields": list(SUMMARY_FIELDS)})
        save_table(slopes, grid, "effective_depth_grid", {"n_boot": n_boot, "seed": seed})
    return models, slopes
