"""Training-seed statistics: every grid-level comparison carries the noise of retraining with another seed.

At the scales a CPU runs, the spread between two training seeds of the same cell is usually larger
than the spread between evaluation sequences, so intervals over evaluation sequences alone would
present seed noise as findings. These helpers turn per-seed values into a mean with an interval
across seeds, and tell whether a difference is resolved or a tie:

    seed_interval([2.41, 2.44, 2.39])        # mean, t-interval over 3 seeds
    depth_effects(cells)                     # per arch: loss(deepest) - loss(shallowest), per seed + interval
    contrast(effect_a, effect_b)             # difference of two per-seed samples, Welch t-interval

With 2-5 seeds the interval is Student's t on the seed means (stated as "t-interval over n seeds");
with one seed no noise estimate exists and every bound is NaN, which callers must word as such.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np
import pandas as pd
from scipy import stats

LEVEL = 0.95


@dataclass(frozen=True)
class Interval:
    """A mean over training seeds with its interval (lo, hi); NaN bounds when n < 2."""

    mean: float
    lo: float
    hi: float
    n: int
    sd: float
    level: float = LEVEL

    @property
    def half_width(self) -> float:
        return (self.hi - self.lo) / 2 if self.n >= 2 else math.nan

    @property
    def has_noise(self) -> bool:
        """Whether a seed-noise estimate exists (>= 2 seeds and finite bounds)."""
        return self.n >= 2 and math.isfinite(self.lo) and math.isfinite(self.hi)

    def excludes_zero(self) -> bool:
        return self.has_noise and (self.lo > 0 or self.hi < 0)

    def overlaps(self, other: "Interval") -> bool:
        """Whether the two intervals overlap (True when either has no noise estimate: nothing is resolved)."""
        if not (self.has_noise and other.has_noise):
            return True
        return self.lo <= other.hi and other.lo <= self.hi

    def noise(self) -> str:
        """'±0.012 over 3 seeds' or 'one seed: no noise estimate'."""
        if not self.has_noise:
            return "one seed: no noise estimate" if self.n <= 1 else f"no noise estimate over {self.n} seeds"
        return f"±{self.half_width:.3g} over {self.n} seeds"


def seed_interval(values: Iterable[float], level: float = LEVEL) -> Interval:
    """Mean of per-seed values with a Student-t interval across seeds (NaNs dropped)."""
    x = np.array([v for v in values if v is not None and math.isfinite(float(v))], dtype=np.float64)
    n = len(x)
    if n == 0:
        return Interval(math.nan, math.nan, math.nan, 0, math.nan, level)
    mean = float(x.mean())
    if n == 1:
        return Interval(mean, math.nan, math.nan, 1, math.nan, level)
    sd = float(x.std(ddof=1))
    half = float(stats.t.ppf((1 + level) / 2, n - 1)) * sd / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n, sd, level)


def contrast(a: Sequence[float], b: Sequence[float], level: float = LEVEL) -> Interval:
    """mean(a) - mean(b) with a Welch t-interval (the two are independent sets of training seeds).

    n is the smaller sample size; with fewer than 2 values on either side there is no noise estimate.
    """
    x = np.array([v for v in a if math.isfinite(v)], dtype=np.float64)
    y = np.array([v for v in b if math.isfinite(v)], dtype=np.float64)
    if not len(x) or not len(y):
        return Interval(math.nan, math.nan, math.nan, 0, math.nan, level)
    diff = float(x.mean() - y.mean())
    n = min(len(x), len(y))
    if n < 2:
        return Interval(diff, math.nan, math.nan, n, math.nan, level)
    va, vb = x.var(ddof=1) / len(x), y.var(ddof=1) / len(y)
    se = math.sqrt(va + vb)
    if se == 0:
        return Interval(diff, diff, diff, n, 0.0, level)
    dof = (va + vb) ** 2 / (va**2 / (len(x) - 1) + vb**2 / (len(y) - 1))
    half = float(stats.t.ppf((1 + level) / 2, dof)) * se
    return Interval(diff, diff - half, diff + half, n, se * math.sqrt(n), level)


def welch_combination(samples: Sequence[Sequence[float]], weights: Sequence[float], level: float = LEVEL) -> Interval:
    """Σ_k w_k mean(sample_k) with a Welch-Satterthwaite t-interval, the samples being independent sets of
    training seeds: var = Σ w_k² s_k²/n_k, dof = var² / Σ (w_k² s_k²/n_k)² / (n_k − 1). With weights
    (1, −1) it is `contrast`; with (1, −1, −1, 1) a difference of differences (an interaction: how much
    a contrast changes between two recipes). n is the smallest sample size; < 2 gives NaN bounds."""
    if len(samples) != len(weights):
        raise ValueError(f"{len(samples)} samples but {len(weights)} weights")
    xs = [np.array([v for v in s if math.isfinite(v)], dtype=np.float64) for s in samples]
    if any(not len(x) for x in xs):
        return Interval(math.nan, math.nan, math.nan, 0, math.nan, level)
    value = float(sum(w * x.mean() for w, x in zip(weights, xs)))
    n = min(len(x) for x in xs)
    if n < 2:
        return Interval(value, math.nan, math.nan, n, math.nan, level)
    parts = [w * w * x.var(ddof=1) / len(x) for w, x in zip(weights, xs)]
    var = float(sum(parts))
    if var == 0:
        return Interval(value, value, value, n, 0.0, level)
    dof = var**2 / sum(p**2 / (len(x) - 1) for p, x in zip(parts, xs))
    half = float(stats.t.ppf((1 + level) / 2, dof)) * math.sqrt(var)
    return Interval(value, value - half, value + half, n, math.sqrt(var * n), level)


def interval_columns(prefix: str, iv: Interval) -> dict[str, Any]:
    """Table columns of an interval: <prefix>, <prefix>_lo, <prefix>_hi, <prefix>_sd and n_seeds."""
    return {prefix: iv.mean, f"{prefix}_lo": iv.lo, f"{prefix}_hi": iv.hi, f"{prefix}_sd": iv.sd, "n_seeds": iv.n}


def with_seed(df: pd.DataFrame) -> pd.DataFrame:
    """`df` with a `seed` column (0 where a table predates seeds)."""
    if "seed" in df.columns:
        return df.assign(seed=pd.to_numeric(df["seed"], errors="coerce").fillna(0).astype(int))
    return df.assign(seed=0)


def seed_means(cells: pd.DataFrame, value: str = "val_loss", keys: Sequence[str] = ("arch", "n_layer"),
               level: float = LEVEL) -> pd.DataFrame:
    """One row per `keys` group: mean of `value` over seeds with its interval (value, _lo, _hi, _sd, n_seeds)."""
    data = with_seed(cells).dropna(subset=[value])
    rows = []
    for key, sub in data.groupby(list(keys), sort=True):
        key = key if isinstance(key, tuple) else (key,)
        iv = seed_interval(sub[value], level)
        rows.append({**dict(zip(keys, key)), **interval_columns(value, iv), "seeds": ",".join(map(str, sorted(sub["seed"])))})
    return pd.DataFrame(rows)


def depth_effects(cells: pd.DataFrame, value: str = "val_loss", level: float = LEVEL) -> pd.DataFrame:
    """Per architecture: value(deepest) - value(shallowest), one difference per seed that has both cells.

    Rows: arch, shallow, deep (n_layer), effect (mean over seeds), effect_lo/_hi/_sd, n_seeds, per_seed
    (the differences as a list). Positive = the deep-narrow model is worse (for a loss).
    """
    data = with_seed(cells).dropna(subset=[value])
    rows = []
    for arch, sub in data.groupby("arch", sort=True):
        depths = sorted({int(n) for n in sub["n_layer"]})
        if len(depths) < 2:
            continue
        shallow, deep = depths[0], depths[-1]
        by_seed = sub.pivot_table(index="seed", columns="n_layer", values=value, aggfunc="mean")
        diffs = (by_seed[deep] - by_seed[shallow]).dropna()
        iv = seed_interval(diffs, level)
        rows.append({"arch": arch, "shallow": shallow, "deep": deep, **interval_columns("effect", iv),
                     "per_seed": [float(v) for v in diffs]})
    return pd.DataFrame(rows)
