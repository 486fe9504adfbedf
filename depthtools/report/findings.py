"""Findings: plain sentences computed from the report's tables, so a reader sees the numbers' story.

Every sentence states a number read from a saved table (final losses, effective-depth slopes with
their bootstrap intervals, depth-task accuracies); none is hand-written. Functions return lists of
strings; the template escapes them like every other string.
"""

from __future__ import annotations

import math

import pandas as pd

from depthtools.report.data import finite

TIE = 0.005  # nats: loss differences below this are "about the same"


def _nats(x: float) -> str:
    return f"{abs(x):.3f}"


def _ci(row, column: str) -> str:
    lo, hi = row.get(f"{column}_lo"), row.get(f"{column}_hi")
    return f" [{lo:.3g}, {hi:.3g}]" if finite(lo) and finite(hi) else ""


def loss_vs_depth(cells: pd.DataFrame) -> list[str]:
    """Per architecture, how the final val loss changes from its shallowest to its deepest cell."""
    done = cells.dropna(subset=["val_loss"])
    parts = []
    for arch, sub in sorted(done.groupby("arch"), key=lambda kv: str(kv[0])):
        sub = sub.sort_values("n_layer")
        if sub["n_layer"].nunique() < 2:
            continue
        first, last = sub.iloc[0], sub.iloc[-1]
        delta = float(last["val_loss"] - first["val_loss"])
        span = f"from L{int(first['n_layer'])} to L{int(last['n_layer'])}"
        if abs(delta) < TIE:
            parts.append((delta, f"{arch} stays within {TIE} nats {span}"))
        else:
            verb = "improves" if delta < 0 else "worsens"
            parts.append((delta, f"{arch} {verb} by {_nats(delta)} nats {span}"))
    if not parts:
        return []
    return ["Deeper at fixed parameters: " + "; ".join(p for _, p in sorted(parts, key=lambda x: x[0])) + "."]


def lowest_loss(cells: pd.DataFrame) -> list[str]:
    """The model with the lowest final val loss, and (several architectures) the best depth of each."""
    done = cells.dropna(subset=["val_loss"])
    if done.empty:
        return []
    best = done.loc[done["val_loss"].idxmin()]
    out = [f"Lowest final val loss: {best['model']} ({best['arch']}, L{int(best['n_layer'])}, "
           f"d_model {int(best['d_model'])}) at {best['val_loss']:.3f} nats."]
    per_arch = done.loc[done.groupby("arch")["val_loss"].idxmin()].sort_values("val_loss")
    if len(per_arch) > 1 and len(per_arch) < len(done):
        out.append("Best depth per architecture: " + ", ".join(
            f"{r.arch} L{int(r.n_layer)} ({r.val_loss:.3f})" for r in per_arch.itertuples()) + ".")
    return out


def marginal_depth(slopes: pd.DataFrame | None) -> list[str]:
    """Which architecture turns extra layers into the most effective layers (dN_skip/dL), with CIs."""
    if slopes is None or "slope_n_skip" not in slopes:
        return []
    rows = slopes[[finite(v) for v in slopes["slope_n_skip"]]].sort_values("slope_n_skip", ascending=False)
    if rows.empty:
        return []
    out = []
    top = rows.iloc[0]
    sentence = (f"Largest marginal effective depth: {top['arch']}, dN_skip/dL = {top['slope_n_skip']:.3g}"
                f"{_ci(top, 'slope_n_skip')} (each added layer adds that many effective layers)")
    if len(rows) > 1:
        second = rows.iloc[1]
        overlap = all(finite(v) for v in (top.get("slope_n_skip_lo"), second.get("slope_n_skip_hi"))) and \
            top["slope_n_skip_lo"] <= second["slope_n_skip_hi"]
        sentence += (f"; next is {second['arch']} at {second['slope_n_skip']:.3g}{_ci(second, 'slope_n_skip')}"
                     + (", and the intervals overlap, so the ranking is not resolved" if overlap else
                        ", with non-overlapping intervals"))
        low = rows.iloc[-1]
        if len(rows) > 2:
            sentence += f"; smallest is {low['arch']} at {low['slope_n_skip']:.3g}{_ci(low, 'slope_n_skip')}"
    out.append(sentence + ".")
    if "slope_loss_log_L" in rows:
        falls, rises, flat = [], [], []
        for r in rows.to_dict(orient="records"):
            value, lo, hi = r.get("slope_loss_log_L"), r.get("slope_loss_log_L_lo"), r.get("slope_loss_log_L_hi")
            if not finite(value):
                continue
            text = f"{r['arch']} ({value:+.3g} nats per e-fold of L{_ci(r, 'slope_loss_log_L')})"
            if finite(hi) and hi < 0:
                falls.append(text)
            elif finite(lo) and lo > 0:
                rises.append(text)
            else:
                flat.append(text)
        bits = []
        if falls:
            bits.append("loss falls with depth for " + ", ".join(falls))
        if rises:
            bits.append("rises for " + ", ".join(rises))
        if flat:
            bits.append("shows no clear trend (interval spans 0 or is missing) for " + ", ".join(flat))
        if bits:
            out.append("Loss against log depth: " + "; ".join(bits) + ".")
    return out


def deepest_usage(models: pd.DataFrame | None) -> list[str]:
    """At each architecture's deepest cell: which keeps the largest share of its layers effective."""
    if models is None or "n_skip_over_L" not in models or models.empty:
        return []
    deep = models[models["n_layer"] == models.groupby("arch")["n_layer"].transform("max")]
    deep = deep[[finite(v) for v in deep["n_skip_over_L"]]].sort_values("n_skip_over_L", ascending=False)
    if len(deep) < 2:
        return []
    hi, lo = deep.iloc[0], deep.iloc[-1]
    return [f"At its deepest setting, {hi['arch']} keeps the largest share of layers effective "
            f"(N_skip/L = {hi['n_skip_over_L']:.2f} at L{int(hi['n_layer'])}); {lo['arch']} the smallest "
            f"({lo['n_skip_over_L']:.2f} at L{int(lo['n_layer'])})."]


def tasks(summary: pd.DataFrame) -> list[str]:
    """Per depth task: the model with the best accuracy beyond the training range of k."""
    if summary is None or summary.empty:
        return []
    column = "accuracy_out_of_range" if summary["accuracy_out_of_range"].notna().any() else "accuracy_in_range"
    where = "beyond the trained k" if column == "accuracy_out_of_range" else "on the trained k"
    out = []
    for task, sub in summary.groupby("task"):
        sub = sub.dropna(subset=[column])
        if sub.empty:
            continue
        best, worst = sub.loc[sub[column].idxmax()], sub.loc[sub[column].idxmin()]
        if best[column] == worst[column]:  # a tie (often: nobody solves anything) ranks nothing
            out.append(f"Depth task {task}: every model has accuracy {best[column]:.2f} {where}.")
            continue
        out.append(f"Depth task {task}: best accuracy {where} is {best['model']} ({best[column]:.2f}); "
                   f"worst {worst['model']} ({worst[column]:.2f}).")
    return out


def depth_reached(reached: pd.DataFrame | None) -> list[str]:
    """Per task: which model solves the largest k at the accuracy threshold (tasks_depth_reached)."""
    if reached is None or reached.empty or "depth_reached" not in reached:
        return []
    out = []
    for task, sub in reached.groupby("task"):
        best = sub.loc[sub["depth_reached"].idxmax()]
        if int(best["depth_reached"]) == 0:
            out.append(f"Depth task {task}: no model reaches the accuracy threshold even at the smallest k.")
            continue
        threshold = f" at accuracy ≥ {best['threshold']:.2g}" if finite(best.get("threshold")) else ""
        k_max = best.get("k_max_evaluated")
        tested = f" (of k ≤ {int(k_max)} evaluated)" if finite(k_max) else ""
        out.append(f"Depth task {task}: {best['model']} solves up to k = {int(best['depth_reached'])}{threshold}"
                   f"{tested}.")
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
