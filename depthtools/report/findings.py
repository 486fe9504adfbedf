"""Findings: plain sentences computed from the report's tables, so a reader sees the numbers' story.

Every sentence states a number read from a saved table (final losses, effective-depth slopes,
depth-task accuracies); none is hand-written. Comparisons carry their training-seed noise
(`depthtools.analysis.seeds`): two architectures are ranked, or a trend is called, only when the
95% intervals across seeds separate (or exclude zero); otherwise the sentence says "within seed
noise (±x over n seeds)", and with one seed it says that no noise estimate exists. Functions return lists of
strings; the template escapes them like every other string.
"""

from __future__ import annotations

import math

import pandas as pd

from depthtools.analysis.seeds import Interval, contrast, depth_effects, seed_means, with_seed
from depthtools.report.data import finite

REFERENCE_ARCH = "preln"  # the baseline every architecture's depth effect is contrasted with


def _nats(x: float) -> str:
    return f"{abs(x):.3f}"


def _ci(row, column: str) -> str:
    lo, hi = row.get(f"{column}_lo"), row.get(f"{column}_hi")
    return f" [{lo:.3g}, {hi:.3g}]" if finite(lo) and finite(hi) else ""


def _row_interval(row, column: str) -> Interval:
    """The seed interval stored in a table row as <column>, <column>_lo, <column>_hi, n_seeds."""
    n = row.get("n_seeds")
    n = int(n) if finite(n) else 1
    lo, hi = row.get(f"{column}_lo"), row.get(f"{column}_hi")
    sd = row.get(f"{column}_sd")
    return Interval(float(row[column]), float(lo) if finite(lo) else math.nan, float(hi) if finite(hi) else math.nan,
                    n, float(sd) if finite(sd) else math.nan)


def seed_noise(cells: pd.DataFrame) -> list[str]:
    """How many training seeds stand behind each cell, and what the intervals below are."""
    done = with_seed(cells.dropna(subset=["val_loss"]))
    if done.empty:
        return []
    counts = done.groupby(["arch", "n_layer"])["seed"].nunique()
    if counts.max() <= 1:
        return ["One training seed per cell: no seed-noise estimate exists, so no difference between architectures "
                "or depths below is resolved; rerun the grid with --seeds 0,1,2 to measure it."]
    seeds = ",".join(str(s) for s in sorted(done["seed"].unique()))
    spread = "" if counts.min() == counts.max() else f" (some cells have only {counts.min()})"
    return [f"{counts.max()} training seeds per cell (seeds {seeds}){spread}: every interval below is a 95% "
            "t-interval across seeds, and a difference inside it is called a tie."]


def loss_vs_depth(cells: pd.DataFrame) -> list[str]:
    """Per architecture, how the final val loss changes from its shallowest to its deepest cell (over seeds),
    and how that change compares with the reference architecture's (DepthBench's question)."""
    effects = depth_effects(cells.dropna(subset=["val_loss"]))
    if effects.empty:
        return []
    parts = []
    for row in effects.sort_values("effect").to_dict(orient="records"):
        iv = _row_interval(row, "effect")
        span = f"from L{row['shallow']} to L{row['deep']}"
        if iv.excludes_zero():
            verb = "improves" if iv.mean < 0 else "worsens"
            parts.append(f"{row['arch']} {verb} by {_nats(iv.mean)} nats {span} ({iv.noise()})")
        elif iv.has_noise:
            parts.append(f"{row['arch']} changes by {iv.mean:+.3f} nats {span}, within seed noise ({iv.noise()})")
        else:
            parts.append(f"{row['arch']} changes by {iv.mean:+.3f} nats {span} ({iv.noise()})")
    out = ["Deeper at fixed parameters: " + "; ".join(parts) + "."]
    by_arch = effects.set_index("arch")
    if REFERENCE_ARCH in by_arch.index and len(by_arch) > 1:
        base = by_arch.loc[REFERENCE_ARCH]
        bits, contrasts = [], []
        for arch, row in by_arch.drop(REFERENCE_ARCH).iterrows():
            if (row["shallow"], row["deep"]) != (base["shallow"], base["deep"]):
                continue
            c = contrast(row["per_seed"], base["per_seed"])
            contrasts.append(c)
            if c.excludes_zero():
                verb = "less" if c.mean < 0 else "more"
                bits.append(f"{arch} loses {_nats(c.mean)} nats {verb} than {REFERENCE_ARCH} "
                            f"(Welch ±{c.half_width:.3g}, {c.n}+ seeds)")
            elif c.has_noise:
                bits.append(f"{arch} vs {REFERENCE_ARCH}: {c.mean:+.3f} nats, a tie within seed noise "
                            f"(Welch ±{c.half_width:.3g}, {c.n}+ seeds)")
            else:
                bits.append(f"{arch} vs {REFERENCE_ARCH}: {c.mean:+.3f} nats ({c.noise()})")
        if bits:
            out.append(f"Going deep-narrow, each architecture's loss change minus {REFERENCE_ARCH}'s: "
                       + "; ".join(bits) + ".")
        if contrasts and all(c.has_noise and not c.excludes_zero() for c in contrasts):
            widest = max(c.half_width for c in contrasts)
            out.append(f"No architecture's depth effect differs from {REFERENCE_ARCH}'s beyond seed noise (up to "
                       f"±{widest:.3g} nats): at this scale the grid is a pipeline check, not evidence for or "
                       "against a depth advantage.")
    return out


def lowest_loss(cells: pd.DataFrame) -> list[str]:
    """The (arch, depth) with the lowest mean final val loss over seeds, and whether the runner-up ties it."""
    done = cells.dropna(subset=["val_loss"])
    if done.empty:
        return []
    means = seed_means(done, keys=("arch", "n_layer", "d_model")).sort_values("val_loss").reset_index(drop=True)
    best = means.iloc[0]
    iv = _row_interval(best, "val_loss")
    sentence = (f"Lowest final val loss: {best['arch']} L{int(best['n_layer'])} (d_model {int(best['d_model'])}) at "
                f"{best['val_loss']:.3f} nats ({iv.noise()})")
    if len(means) > 1:
        second = means.iloc[1]
        other = _row_interval(second, "val_loss")
        name = f"{second['arch']} L{int(second['n_layer'])} ({second['val_loss']:.3f})"
        if not iv.has_noise:
            sentence += f"; next is {name}, not ranked without a noise estimate"
        elif iv.overlaps(other):
            sentence += f"; tied within seed noise with {name}"
        else:
            sentence += f"; ahead of the next, {name}, beyond seed noise"
    out = [sentence + "."]
    per_arch = means.loc[means.groupby("arch")["val_loss"].idxmin()].sort_values("val_loss")
    if 1 < len(per_arch) < len(means):
        out.append("Best depth per architecture (mean over seeds): " + ", ".join(
            f"{r.arch} L{int(r.n_layer)} ({r.val_loss:.3f})" for r in per_arch.itertuples()) + ".")
    return out


def marginal_depth(slopes: pd.DataFrame | None) -> list[str]:
    """Which architecture turns extra layers into the most effective layers (dN_skip/dL), ranked only when
    the seed intervals separate; and whether loss falls or rises with log depth beyond seed noise."""
    if slopes is None or "slope_n_skip" not in slopes:
        return []
    rows = slopes[[finite(v) for v in slopes["slope_n_skip"]]].sort_values("slope_n_skip", ascending=False)
    if rows.empty:
        return []
    records = rows.to_dict(orient="records")
    top = records[0]
    top_iv = _row_interval(top, "slope_n_skip")
    sentence = (f"Largest marginal effective depth: {top['arch']}, dN_skip/dL = {top['slope_n_skip']:.3g}"
                f"{_ci(top, 'slope_n_skip')} ({top_iv.noise()}; each added layer adds that many effective layers)")
    if len(records) > 1:
        second = records[1]
        second_iv = _row_interval(second, "slope_n_skip")
        if not top_iv.has_noise:
            sentence += f"; next is {second['arch']} at {second['slope_n_skip']:.3g}, not ranked without a noise estimate"
        elif top_iv.overlaps(second_iv):
            sentence += (f"; {second['arch']} at {second['slope_n_skip']:.3g}{_ci(second, 'slope_n_skip')} is "
                         f"within seed noise of it, so the ranking is not resolved")
        else:
            sentence += (f"; ahead of {second['arch']} at {second['slope_n_skip']:.3g}{_ci(second, 'slope_n_skip')} "
                         "beyond seed noise")
        if len(records) > 2:
            low = records[-1]
            sentence += f"; smallest is {low['arch']} at {low['slope_n_skip']:.3g}{_ci(low, 'slope_n_skip')}"
    out = [sentence + "."]
    if "slope_loss_log_L" in rows:
        falls, rises, flat = [], [], []
        for r in records:
            if not finite(r.get("slope_loss_log_L")):
                continue
            iv = _row_interval(r, "slope_loss_log_L")
            text = f"{r['arch']} ({iv.mean:+.3g} nats per e-fold of L, {iv.noise()})"
            if iv.excludes_zero():
                (falls if iv.hi < 0 else rises).append(text)
            else:
                flat.append(text)
        bits = []
        if falls:
            bits.append("loss falls with depth for " + ", ".join(falls))
        if rises:
            bits.append("rises for " + ", ".join(rises))
        if flat:
            bits.append("no trend beyond seed noise (interval spans 0, or one seed) for " + ", ".join(flat))
        if bits:
            out.append("Loss against log depth: " + "; ".join(bits) + ".")
    return out


def deepest_usage(models: pd.DataFrame | None) -> list[str]:
    """At each architecture's deepest setting: which keeps the largest share of its layers effective
    (mean N_skip/L over seeds), ranked only when the seed intervals separate."""
    if models is None or "n_skip_over_L" not in models or models.empty:
        return []
    deep = models[models["n_layer"] == models.groupby("arch")["n_layer"].transform("max")]
    means = seed_means(deep, value="n_skip_over_L", keys=("arch", "n_layer"))
    if len(means) < 2:
        return []
    means = means.sort_values("n_skip_over_L", ascending=False)
    hi, lo = means.iloc[0], means.iloc[-1]
    hi_iv, lo_iv = _row_interval(hi, "n_skip_over_L"), _row_interval(lo, "n_skip_over_L")
    values = (f"{hi['arch']} N_skip/L = {hi['n_skip_over_L']:.2f} at L{int(hi['n_layer'])} ({hi_iv.noise()}), "
              f"{lo['arch']} {lo['n_skip_over_L']:.2f} at L{int(lo['n_layer'])} ({lo_iv.noise()})")
    if not (hi_iv.has_noise and lo_iv.has_noise):
        return [f"At the deepest setting, layer usage is not ranked without a seed-noise estimate: {values}."]
    if hi_iv.overlaps(lo_iv):
        return [f"At the deepest setting, every architecture's share of effective layers is within seed noise: {values}."]
    return [f"At its deepest setting, {hi['arch']} keeps the largest share of layers effective and {lo['arch']} the "
            f"smallest, beyond seed noise: {values}."]


def tasks(summary: pd.DataFrame) -> list[str]:
    """Per depth task: the (arch, depth) with the best mean accuracy beyond the training range of k, over seeds."""
    if summary is None or summary.empty:
        return []
    column = "accuracy_out_of_range" if summary["accuracy_out_of_range"].notna().any() else "accuracy_in_range"
    where = "beyond the trained k" if column == "accuracy_out_of_range" else "on the trained k"
    out = []
    for task, sub in summary.groupby("task"):
        means = seed_means(sub.dropna(subset=[column]), value=column, keys=("arch", "n_layer"))
        if means.empty:
            continue
        means = means.sort_values(column, ascending=False)
        best, worst = means.iloc[0], means.iloc[-1]
        if best[column] == worst[column]:  # a tie (often: nobody solves anything) ranks nothing
            out.append(f"Depth task {task}: every model has accuracy {best[column]:.2f} {where}.")
            continue
        b_iv, w_iv = _row_interval(best, column), _row_interval(worst, column)
        names = (f"{best['arch']} L{int(best['n_layer'])} ({best[column]:.2f}, {b_iv.noise()}) and "
                 f"{worst['arch']} L{int(worst['n_layer'])} ({worst[column]:.2f}, {w_iv.noise()})")
        if not b_iv.has_noise:
            out.append(f"Depth task {task}: accuracy {where} ranges between {names}; not ranked without a "
                       "seed-noise estimate.")
        elif b_iv.overlaps(w_iv):
            out.append(f"Depth task {task}: accuracy {where} is within seed noise between {names}.")
        else:
            out.append(f"Depth task {task}: best accuracy {where} is {best['arch']} L{int(best['n_layer'])} "
                       f"({best[column]:.2f}), worst {worst['arch']} L{int(worst['n_layer'])} ({worst[column]:.2f}), "
                       f"beyond seed noise ({b_iv.noise()}).")
    return out


def depth_reached(reached: pd.DataFrame | None) -> list[str]:
    """Per task: the largest k solved at the accuracy threshold (tasks_depth_reached), per (arch, depth) over seeds."""
    if reached is None or reached.empty or "depth_reached" not in reached:
        return []
    out = []
    for task, sub in reached.groupby("task"):
        means = seed_means(sub, value="depth_reached", keys=("arch", "n_layer")).sort_values(
            "depth_reached", ascending=False)
        best = means.iloc[0]
        if float(best["depth_reached"]) == 0:
            out.append(f"Depth task {task}: no model reaches the accuracy threshold even at the smallest k, so the "
                       "task was not learned at this budget: its accuracy differences measure heuristics (e.g. "
                       "guessing a digit of the prompt), not serial computation.")
            continue
        first = sub.iloc[0]
        threshold = f" at accuracy ≥ {first['threshold']:.2g}" if finite(first.get("threshold")) else ""
        k_max = first.get("k_max_evaluated")
        tested = f" (of k ≤ {int(k_max)} evaluated)" if finite(k_max) else ""
        iv = _row_interval(best, "depth_reached")
        others = [f"{r['arch']} L{int(r['n_layer'])} {r['depth_reached']:.3g} ({_row_interval(r, 'depth_reached').noise()})"
                  for i, r in means.sort_values(["arch", "n_layer"]).iterrows() if i != means.index[0]]
        every = f"; per model: {', '.join(others)}" if len(means) > 1 else ""
        out.append(f"Depth task {task}: {best['arch']} L{int(best['n_layer'])} solves up to k = "
                   f"{best['depth_reached']:.3g}{threshold}{tested}, mean over seeds ({iv.noise()}){every}.")
    return out


def depth_separation(tasks: pd.DataFrame | None, threshold: float = 0.9) -> list[str]:
    """Per depth task and architecture: where, in k, the deepest model's accuracy differs from the shallowest's
    beyond training-seed noise (Welch t-interval over their per-seed accuracies excludes 0).

    This is the question the tasks exist for: at a fixed parameter count, does trading width for depth buy
    serial steps? A k where the interval covers 0 is a tie and is never reported as a difference; with one
    seed per model no noise estimate exists and nothing is compared. A task that no model learned (no
    model's seed-mean accuracy reaches `threshold` at the smallest k evaluated) is not compared at all:
    its accuracy differences measure heuristics, which `depth_reached` says in words.
    """
    if tasks is None or tasks.empty or not {"metric", "task", "k", "value", "arch", "n_layer"} <= set(tasks.columns):
        return []
    acc = with_seed(tasks[tasks["metric"] == "accuracy"]).dropna(subset=["value"])
    smallest = acc[acc["k"] == acc.groupby("task")["k"].transform("min")]
    learned = {task for task, sub in smallest.groupby("task")
               if sub.groupby(["arch", "n_layer"])["value"].mean().max() >= threshold}
    out = []
    for (task, arch), sub in acc[acc["task"].isin(learned)].groupby(["task", "arch"], sort=True):
        depths = sorted(sub["n_layer"].astype(int).unique())
        if len(depths) < 2:
            continue
        shallow, deep = depths[0], depths[-1]
        gaps = []
        for k, at_k in sub.groupby("k", sort=True):
            a = at_k[at_k["n_layer"] == deep]["value"].astype(float).tolist()
            b = at_k[at_k["n_layer"] == shallow]["value"].astype(float).tolist()
            if a and b:
                gaps.append((int(k), float(pd.Series(a).mean()), float(pd.Series(b).mean()), contrast(a, b)))
        if not gaps:
            continue
        who = f"Depth task {task} ({arch}, deep-narrow L{deep} vs shallow-wide L{shallow})"
        widest = max(gaps, key=lambda g: abs(g[3].mean))
        if not widest[3].has_noise:
            out.append(f"{who}: the largest accuracy gap is {widest[3].mean:+.2f} at k = {widest[0]} "
                       f"({widest[1]:.2f} vs {widest[2]:.2f}); not compared without a seed-noise estimate "
                       f"({widest[3].noise()}).")
            continue
        deeper = [g for g in gaps if g[3].excludes_zero() and g[3].mean > 0]
        shallower = [g for g in gaps if g[3].excludes_zero() and g[3].mean < 0]
        if not deeper and not shallower:
            out.append(f"{who}: accuracy is within seed noise at every k evaluated (largest gap {widest[3].mean:+.2f} "
                       f"at k = {widest[0]}, Welch {widest[3].noise()}): no depth difference is resolved at this budget and "
                       "number of seeds.")
            continue
        parts = []
        for group, winner in ((deeper, f"L{deep} is more accurate"), (shallower, f"L{shallow} is more accurate")):
            if group:
                top = max(group, key=lambda g: abs(g[3].mean))
                parts.append(f"{winner} beyond seed noise at k = {', '.join(str(g[0]) for g in group)} (largest at "
                             f"k = {top[0]}: {top[1]:.2f} vs {top[2]:.2f}, difference {top[3].mean:+.2f}, "
                             f"Welch {top[3].noise()})")
        tie = len(gaps) - len(deeper) - len(shallower)
        tail = f"; at the other {tie} k the two are within seed noise" if tie else ""
        out.append(f"{who}: {'; '.join(parts)}{tail}.")
    return out


def missing(n_missing: int, n_cells_affected: int) -> list[str]:
    if not n_missing:
        return []
    return [f"{n_missing} input(s) are missing across {n_cells_affected} cell(s) or grid summaries; "
            "figures leave those out (see Missing data)."]


# -- single checkpoints ----------------------------------------------------------------------------

def model_findings(name: str, skip: pd.DataFrame | None, lens: pd.DataFrame | None, summary: pd.DataFrame | None,
                   val: float) -> list[str]:
    """A few numbers about one checkpoint: loss, most important block, where the lens converges."""
    out = []
    if finite(val):
        out.append(f"{name}: final val loss {val:.3f} nats.")
    if skip is not None and len(skip) and "delta_ce" in skip:
        s = skip[skip["mode"] == "skip"] if "mode" in skip else skip
        s = s[s["rule"] == s["rule"].iloc[0]] if "rule" in s and len(s) else s
        if len(s):
            top = s.loc[s["delta_ce"].idxmax()]
            n = s["n_skip_over_L"].iloc[0] if "n_skip_over_L" in s else math.nan
            out.append(f"{name}: skipping block {int(top['layer'])} costs the most "
                       f"(ΔCE {top['delta_ce']:.3g} nats)" + (f"; N_skip/L = {n:.2f}." if finite(n) else "."))
    if lens is not None and len(lens) and "kl_final_lens" in lens:
        logit = lens[lens["lens"] == "logit"] if "lens" in lens else lens
        settled = None
        for row in logit.sort_values("depth", ascending=False).itertuples():
            if not row.kl_final_lens <= 0.1:
                break
            settled = row
        if settled is not None:
            d = {"depth": settled.depth, "rel_depth": settled.rel_depth}
            out.append(f"{name}: the logit lens is within 0.1 nats of the output from depth {int(d['depth'])} "
                       f"(l/L = {d['rel_depth']:.2f}).")
    if summary is not None and len(summary) and "pd_mean_over_L" in summary:
        v = summary["pd_mean_over_L"].iloc[0]
        if finite(v):
            out.append(f"{name}: mean prediction depth {v:.2f} L.")
    return out
