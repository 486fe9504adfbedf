"""Effective depth: one row per model from the saved tables, and grid-level marginal effective depth.

Per model (`effective_depth_row`), each field read from a table another analysis saved, by its name
(`load_results`; NaN and a note when that table is missing):

    n_skip_over_L        N_skip/L, N_skip = exp(H(π)), π ∝ KL(intact‖skip l) (ablate skip, default rule)
    f_tau                prunable fraction at τ of the removal curve (ablate prune, default rule): greedy
                         re-measured where the table has it (--prune greedy), else the single-skip order;
                         `prune_curve` names which
    n_lens_over_L        N_lens/L, N_lens = exp(H(π)) of the lens CE progress g_l⁺ (docs/reference/metrics.md §1.4,
                         `lens.lens_progress` on the lens depth table; tuned lens preferred)
    kl_depth_over_L      first depth from which KL(p_L‖p_l) ≤ `kl_threshold` (0.1 nats) at every
                         later depth, / L (lens depth table) — the threshold reading of "N_lens"
    pd_mean_over_L       mean prediction depth / L (lens summary, of the same lens)
    n_rep_over_L1        N_rep/(L+1) of the debiased CKA matrix (similarity)
    cka_block_fraction   longest all-pairs CKA > 0.9 run / L (similarity)
    causal_pair_fraction late pairs with C > 0.45 (causal; DepthBench)
    perm_pair_fraction   late pairs (both blocks in the last 3/4) with permutation score > 0.15
                         (ablate_swap: all pairs, DepthBench's number; else ablate_swap_adjacent, noted)

Grid level (`grid_summary`): for each architecture, least-squares slopes over its depth sweep of
N_skip against n_layer (marginal effective depth, docs/reference/metrics.md §9.12) and of the final loss against
log n_layer, fitted once per training seed and averaged. The main interval is the Student-t
interval across training seeds (the larger noise at CPU scale; none with one seed). A second,
named interval (`_boot_lo/_boot_hi`) is a percentile bootstrap over evaluation sequences: each
resample draws N of the N sequences with replacement — the same indices for every model of the
architecture when they share one token set (paired) — recomputes every model's N_skip and loss from
its per-sequence profile (`sequence_profile`: per-sequence intact CE and per-block skip KL) and
refits the per-seed slopes.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd

from depthtools.analysis.ablate import effective_count
from depthtools.analysis.causal import late_start
from depthtools.analysis.lens import lens_progress
from depthtools.analysis.profile import sequence_profile  # noqa: F401  (re-exported: summary's input)
from depthtools.analysis.suite import read_result
from depthtools.analysis.tables import checkpoint_dirs, save_table, training_seed  # noqa: F401  (re-exported)
from depthtools.checkpoint import CONFIG, read_json

PERM_THRESHOLD = 0.15
KL_THRESHOLD = 0.1
SUMMARY_FIELDS = ("n_skip_over_L", "f_tau", "n_lens_over_L", "kl_depth_over_L", "pd_mean_over_L", "n_rep_over_L1",
                  "cka_block_fraction", "causal_pair_fraction", "perm_pair_fraction")



def _nanmean(a: np.ndarray) -> np.ndarray:
    """Column means ignoring NaN, NaN for an all-NaN column -- without numpy's "Mean of empty slice"
    RuntimeWarning (one model has no slope: every bootstrap column is NaN, which is the answer, not a fault)."""
    a = np.asarray(a, dtype=np.float64)
    counts = (~np.isnan(a)).sum(axis=0)
    return np.where(counts > 0, np.nansum(a, axis=0) / np.maximum(counts, 1), np.nan)

def _profile_arrays(profile: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """(ce [N], skip_kl [N, L]) of one model's sequence profile."""
    ce = profile[profile["metric"] == "ce_intact"].sort_values("seq")["value"].to_numpy()
    kl = profile[profile["metric"] == "skip_kl"].pivot(index="seq", columns="layer", values="value").sort_index()
    return ce, kl.to_numpy(dtype=np.float64)


# -- reading saved tables ------------------------------------------------------------------------

RESULT_TABLES = ("ablate_skip", "ablate_prune", "ablate_swap", "ablate_swap_adjacent", "lens_logit",
                 "lens_logit_summary", "lens_tuned", "lens_tuned_summary", "similarity", "causal", "sequence_profile")


def load_results(ckpt_dir: str | Path) -> dict[str, pd.DataFrame]:
    """The probe tables saved under `<ckpt>/analysis/`, by name (`suite.read_result`: the names
    `analyze` and the probe commands share; tables saved under older names are translated)."""
    found = {name: read_result(ckpt_dir, name) for name in RESULT_TABLES}
    return {name: df for name, df in found.items() if df is not None}


# -- one row per model ----------------------------------------------------------------------------

def _first_rule(df: pd.DataFrame) -> pd.DataFrame:
    """Rows of the first skip rule listed (ablate iterates the scheme's rules, default first)."""
    if "rule" not in df or df.empty:
        return df
    return df[df["rule"] == df["rule"].iloc[0]]


REMOVAL_CURVES = ("greedy", "skip_order")  # the removal curve f_tau is read from, preferred first


def removal_curve(prune: pd.DataFrame) -> tuple[pd.DataFrame, str | None]:
    """(rows, method) of a prune table's removal curve: the greedy re-measured one when the table has it
    (`ablate --prune greedy`, and tables saved before issue 47), else the single-skip-order curve."""
    if "method" not in prune:
        return prune, None
    for method in REMOVAL_CURVES:
        if (prune["method"] == method).any():
            return prune[prune["method"] == method], method
    return prune.iloc[:0], None


def _kl_depth(depths: pd.DataFrame, threshold: float) -> float:
    """First depth from which kl_final_lens ≤ threshold at every later depth, / L."""
    d = depths.sort_values("depth")
    kl = d["kl_final_lens"].to_numpy()
    L = int(d["depth"].max())
    below = kl <= threshold
    first = L
    for i in range(len(kl) - 1, -1, -1):
        if not below[i]:
            break
        first = int(d["depth"].iloc[i])
    return first / L if L else math.nan


def _perm_pair_fraction(swaps: pd.DataFrame, n_layer: int, threshold: float) -> tuple[float, str]:
    start = late_start(n_layer)
    late = swaps[(swaps["layer"] >= start) & (swaps["layer2"] >= start)]
    if late.empty:
        return math.nan, "no late swap pairs"
    note = "" if "pairs" not in late or (late["pairs"] == "all").all() else "perm_pair_fraction over adjacent pairs only"
    return float((late["perm_score"] > threshold).mean()), note


def effective_depth_row(info: dict[str, Any], results: dict[str, pd.DataFrame], kl_threshold: float = KL_THRESHOLD,
                        perm_threshold: float = PERM_THRESHOLD) -> dict[str, Any]:
    """The effective-depth summary of one model from its result tables (see the module docstring)."""
    L = int(info["n_layer"])
    row: dict[str, Any] = {**info, **{f: math.nan for f in SUMMARY_FIELDS}}
    notes: list[str] = []

    def missing(field: str, table: str) -> None:
        notes.append(f"{field}: no {table} table")

    if "ablate_skip" in results:
        skip = _first_rule(results["ablate_skip"].query("mode == 'skip'"))
        row["n_skip_over_L"] = effective_count(skip["kl_intact_ablated"]) / L
    else:
        missing("n_skip_over_L", "ablate skip")
    if "ablate_prune" in results:
        prune, row["prune_curve"] = removal_curve(results["ablate_prune"].query("mode == 'prune'"))
        prune = _first_rule(prune)
        row["f_tau"] = float(prune["f_tau"].iloc[0]) if len(prune) else math.nan
    else:
        missing("f_tau", "ablate prune")
    kind = "tuned" if "lens_tuned" in results else "logit"  # N_lens from the CE curve; tuned lens preferred
    if f"lens_{kind}" in results:
        row["lens"] = kind
        depths = results[f"lens_{kind}"].sort_values("depth")
        row["n_lens_over_L"] = lens_progress(depths["ce"].to_numpy())[1] / L
        row["kl_depth_over_L"] = _kl_depth(depths, kl_threshold)
    else:
        missing("n_lens_over_L, kl_depth_over_L", "lens depth")
    if f"lens_{kind}_summary" in results:
        row["pd_mean_over_L"] = float(results[f"lens_{kind}_summary"]["pd_mean_over_L"].iloc[0])
    else:
        missing("pd_mean_over_L", "lens summary")
    if "similarity" in results:
        sim = results["similarity"].set_index("metric")["value"]
        sim = sim[~sim.index.duplicated()]
        row["n_rep_over_L1"] = float(sim.get("n_rep_debiased", math.nan)) / (L + 1)
        row["cka_block_fraction"] = float(sim.get("cka_block_fraction_debiased", math.nan))
    else:
        missing("n_rep_over_L1, cka_block_fraction", "similarity")
    if "causal" in results:
        causal = results["causal"]
        row["causal_pair_fraction"] = float(causal.loc[causal["metric"] == "late_pair_fraction", "value"].iloc[0])
    else:
        missing("causal_pair_fraction", "causal")
    swaps = results.get("ablate_swap", results.get("ablate_swap_adjacent"))
    if swaps is not None:
        value, note = _perm_pair_fraction(swaps.query("mode == 'swap'"), L, perm_threshold)
        row["perm_pair_fraction"] = value
        if note:
            notes.append(note)
    else:
        missing("perm_pair_fraction", "ablate swap")
    row["notes"] = "; ".join(notes)
    return row



def _info_from_config(ckpt_dir: Path) -> dict[str, Any]:
    config = read_json(ckpt_dir / CONFIG)
    cfg = config.get("model", {})
    return {"model": ckpt_dir.name, "arch": cfg.get("arch"), "n_layer": int(cfg.get("n_layer", 0)),
            "d_model": int(cfg.get("d_model", 0)), "seed": training_seed(config)}


def model_summaries(grid: str | Path, **kwargs) -> pd.DataFrame:
    """One effective-depth row per checkpoint of a grid, from the tables saved beside each."""
    return pd.DataFrame([effective_depth_row(_info_from_config(d), load_results(d), **kwargs) for d in checkpoint_dirs(grid)])


# -- grid level -----------------------------------------------------------------------------------

def _slope(x: np.ndarray, y: np.ndarray) -> float:
    ok = ~(np.isnan(x) | np.isnan(y))
    if ok.sum() < 2 or np.ptp(x[ok]) == 0:
        return math.nan
    return float(np.polyfit(x[ok], y[ok], 1)[0])


def _fit(layers: np.ndarray, arrays, indices) -> tuple[float, float]:
    """(dN_skip/dL, dLoss/dlog L) of one seed's depth sweep on the given sequence indices per model."""
    n_skip = np.array([effective_count(kl[idx].mean(0)) for (_, kl), idx in zip(arrays, indices)])
    loss = np.array([ce[idx].mean() for (ce, _), idx in zip(arrays, indices)])
    return _slope(layers, n_skip), _slope(np.log(layers), loss)


def grid_slopes(profiles: Sequence[tuple], n_boot: int = 1000, seed: int = 0, ci: float = 0.95) -> dict[str, Any]:
    """Slopes of N_skip vs n_layer and of loss vs log n_layer for one architecture, with two intervals.

    profiles: (n_layer, sequence_profile table) or (n_layer, sequence_profile table, training seed) per
    model. The slopes are fitted per training seed (over that seed's depth sweep) and averaged:

      slope_*            mean of the per-seed slopes
      slope_*_lo/_hi     Student-t interval across training seeds (NaN with one seed: no noise estimate)
      slope_*_boot_lo/hi percentile bootstrap over evaluation sequences of the same mean (a second,
                         smaller noise source). Resampling is paired (same sequence indices for every
                         model) when all profiles have the same number of sequences, else per model.
    """
    from depthtools.analysis.seeds import seed_interval  # heavy, one path: scipy (~1.5 s) for multi-seed intervals only

    by_seed: dict[int, list[tuple[int, pd.DataFrame]]] = {}
    for item in profiles:
        by_seed.setdefault(int(item[2]) if len(item) > 2 else 0, []).append((int(item[0]), item[1]))
    sweeps = []  # per seed: (layers, arrays)
    for s in sorted(by_seed):
        models = sorted(by_seed[s], key=lambda p: p[0])
        sweeps.append((np.array([n for n, _ in models], dtype=np.float64), [_profile_arrays(p) for _, p in models]))
    all_arrays = [a for _, arrays in sweeps for a in arrays]
    n_seqs = {len(ce) for ce, _ in all_arrays}
    paired = len(n_seqs) == 1

    def per_seed(draw) -> np.ndarray:
        return np.array([_fit(layers, arrays, draw(arrays)) for layers, arrays in sweeps], dtype=np.float64)

    point = per_seed(lambda arrays: [np.arange(len(ce)) for ce, _ in arrays])  # [n_seeds, 2]
    rng = np.random.default_rng(seed)
    boots = []
    for _ in range(n_boot):
        if paired:
            idx = rng.integers(0, next(iter(n_seqs)), next(iter(n_seqs)))
            boots.append(_nanmean(per_seed(lambda arrays: [idx] * len(arrays))))
        else:
            boots.append(_nanmean(per_seed(lambda arrays: [rng.integers(0, len(ce), len(ce)) for ce, _ in arrays])))
    boots_arr = np.array(boots, dtype=np.float64) if boots else np.full((1, 2), np.nan)
    lo_q, hi_q = (1 - ci) / 2 * 100, (1 + ci) / 2 * 100

    def boot_interval(col: int) -> tuple[float, float]:
        vals = boots_arr[:, col]
        vals = vals[~np.isnan(vals)]
        return (float(np.percentile(vals, lo_q)), float(np.percentile(vals, hi_q))) if len(vals) else (math.nan, math.nan)

    out: dict[str, Any] = {
        "n_models": len(all_arrays), "n_seeds": len(sweeps),
        "n_layers": ",".join(str(n) for n in sorted({int(n) for layers, _ in sweeps for n in layers})),
        "seeds": ",".join(str(s) for s in sorted(by_seed)),
        "n_sequences": ",".join(str(n) for n in sorted(n_seqs)), "paired_bootstrap": paired,
    }
    for col, name in enumerate(("slope_n_skip", "slope_loss_log_L")):
        iv = seed_interval(point[:, col], ci)
        b_lo, b_hi = boot_interval(col)
        out.update({name: iv.mean, f"{name}_lo": iv.lo, f"{name}_hi": iv.hi, f"{name}_sd": iv.sd,
                    f"{name}_boot_lo": b_lo, f"{name}_boot_hi": b_hi})
    out.update({"n_boot": n_boot, "ci": ci, "interval": "t over seeds" if len(sweeps) > 1 else "none (one seed)"})
    return out


def grid_summary(grid: str | Path, n_boot: int = 1000, seed: int = 0, ci: float = 0.95) -> pd.DataFrame:
    """One row per architecture of a grid: marginal effective depth and loss-vs-depth slopes, fitted per
    training seed, with intervals across seeds and over evaluation sequences (see `grid_slopes`)."""
    by_arch: dict[str, list[tuple[int, pd.DataFrame, int]]] = {}
    missing: dict[str, list[str]] = {}
    for d in checkpoint_dirs(grid):
        info = _info_from_config(d)
        profile = load_results(d).get("sequence_profile")
        if profile is None:
            missing.setdefault(info["arch"], []).append(d.name)
            continue
        by_arch.setdefault(info["arch"], []).append((info["n_layer"], profile, info["seed"]))
    rows = []
    for arch in sorted(set(by_arch) | set(missing)):
        profiles = by_arch.get(arch, [])
        row = {"arch": arch, **(grid_slopes(profiles, n_boot, seed, ci) if profiles else {"n_models": 0})}
        row["notes"] = f"no sequence profile for {', '.join(missing[arch])}" if arch in missing else ""
        rows.append(row)
    return pd.DataFrame(rows)

def summarize_grid(grid: str | Path, n_boot: int = 1000, seed: int = 0, save: bool = True):
    """Effective-depth summary per model and marginal effective depth per architecture (saved under the grid)."""
    models = model_summaries(grid)
    slopes = grid_summary(grid, n_boot=n_boot, seed=seed)
    if save:
        save_table(models, grid, "effective_depth_models", {"fields": list(SUMMARY_FIELDS)})
        save_table(slopes, grid, "effective_depth_grid", {"n_boot": n_boot, "seed": seed})
    return models, slopes
