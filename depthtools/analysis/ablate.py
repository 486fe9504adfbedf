"""Causal depth ablations through the sweep engine (docs/reference/metrics.md §2.1, §2.2, DepthBench).

    ablate(model, tokens, mode="skip")                 bypass one block (every skip rule of the scheme)
    ablate(model, tokens, mode="swap", pairs="all")    exchange blocks i<j (DepthBench permutation score)
    ablate(model, tokens, mode="prune", tau=0.05)      single-skip-order removal curve + Gromov's contiguous block
    ablate(..., mode="prune", prune="greedy")          the greedy re-measured removal curve instead (L²/2 plans)
    ablate(model, tokens, mode="linear")               DepthBench usefulness: block -> fitted affine map
    ablate(model, tokens, mode="mean")                 block update -> its token-mean

Every row compares the plan with the intact model on the scored tokens (position 0 excluded):
ce, ce_intact, delta_ce = ce - ce_intact, kl_intact_ablated = KL(p_intact || p_ablated),
top1_agree (ablated top-1 = intact top-1), top1_acc and top1_retention = top1_acc / intact top1_acc
(Lad et al.'s relative accuracy). Summaries are repeated on every row of their (model, mode, rule,
method) group: n_skip = exp(H(π)), π = normalised importances I_l = KL(intact || ablated) (and
n_skip_dce from max(ΔCE, 0)), for the one-row-per-layer modes; perm_score for swaps, with the
mean over the evaluated pairs, its standard error as a sample of all pairs (perm_score_mean,
perm_score_se: 0 when every pair is evaluated) and n_pairs_total;
usefulness_ratio = ce / ce_intact, significant (> 1.1) and usefulness (fraction significant) for
linear; f_tau (prunable fraction at tolerance tau) for prune.

Pruning curves (`method` column): `skip_order` (default) removes blocks cumulatively in ascending
order of their single-skip ΔCE (the `ablate_skip` sweep, reused when the suite has it), L plans;
`greedy` (`prune="greedy"`, opt-in) re-measures every remaining block after each removal, Σ_k (L−k)
plans ≈ L²/2; `gromov` (always) removes for each size n the contiguous block whose input and output
states are closest in angle, L−1 plans.

Rows: one per model × plan. `layer` is the block index l (0-based; the first of a swapped pair,
the block removed at a greedy step, the first block of a Gromov block), `layer2` the second block
of a swap, `layers` the full set as text, rel_depth = layer / L.

Linear and mean replacement need a state they can move: a plain tensor (mean), whose geometry is
the tensor itself flattened over the trailing dims (linear: the affine map acts on geometry and is
reshaped back, so [B,T,d] and HC's [B,T,n,d] both work). Architectures whose state is not a tensor
(source banks, MoDA's depth memory) raise `UnsupportedAblation` with the reason: replacing a block
there would also have to invent its depth-attention sources, which the contract does not define.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import numpy as np
import pandas as pd
import torch

from depthtools.analysis.sweep import PlanStats, SweepResult, intact_states, sweep
from depthtools.analysis.tables import model_columns
from depthtools.analysis.tokens import FIRST_SCORED, batches, check_tokens, split_inputs
from depthtools.arch.model import Plan
from depthtools.errors import DepthToolsError

MODES = ("skip", "swap", "prune", "linear", "mean")
PAIRS = ("adjacent", "all")
NO_RULE = "-"
SIGNIFICANT_RATIO = 1.1  # DepthBench: a layer is significant if loss / baseline > 1.1

Progress = Callable[[float], None]


class UnsupportedAblation(DepthToolsError):
    """This ablation mode cannot be applied to this architecture's depth state."""


# -- rows and summaries --------------------------------------------------------------------------
def _row(model, mode: str, rule: str, layers: Sequence[int], stats: PlanStats, intact: PlanStats, **extra) -> dict:
    L = model.n_layer
    retention = stats.top1_acc / intact.top1_acc if intact.top1_acc > 0 else float("nan")
    return {
        **model_columns(model), "mode": mode, "rule": rule,
        "layer": layers[0] if layers else None, "layer2": layers[1] if mode == "swap" else None,
        "layers": ",".join(map(str, layers)), "n_removed": len(layers) if mode == "prune" else None,
        "rel_depth": layers[0] / L if layers else float("nan"),
        "ce": stats.ce, "ce_intact": intact.ce, "delta_ce": stats.ce - intact.ce,
        "kl_intact_ablated": stats.kl, "top1_agree": stats.top1_agree, "top1_acc": stats.top1_acc,
        "top1_retention": retention, "n_tokens": stats.n_tokens, **extra,
    }


def effective_count(importances: Iterable[float]) -> float:
    """exp(entropy) of importances normalised to a distribution (N_skip); NaN if all are zero."""
    values = np.clip(np.asarray(list(importances), dtype=np.float64), 0, None)
    if values.sum() <= 0:
        return float("nan")
    pi = values / values.sum()
    pi = pi[pi > 0]
    return float(np.exp(-(pi * np.log(pi)).sum()))


def _add_n_skip(df: pd.DataFrame) -> pd.DataFrame:
    """n_skip / n_skip_dce (and / L) per (model, mode, rule) group of one-row-per-layer modes."""
    for name, source in (("n_skip", "kl_intact_ablated"), ("n_skip_dce", "delta_ce")):
        df[name] = df.groupby(["model", "mode", "rule"], dropna=False)[source].transform(effective_count)
        df[f"{name}_over_L"] = df[name] / df["n_layer"]
    return df


def _frame(rows: list[dict]) -> pd.DataFrame:
    df = pd.DataFrame(rows)
    for column in ("layer", "layer2", "n_removed"):
        if column in df:
            df[column] = df[column].astype("Int64")
    return df


# -- plan families -------------------------------------------------------------------------------
def _rules(model, rules: Sequence[str] | None) -> list[str]:
    valid = list(model.scheme.skip_rules)
    default = [r for r in valid if r not in model.scheme.on_request_skip_rules]
    chosen = default if rules is None else list(rules)
    bad = [r for r in chosen if r not in valid]
    if bad or not chosen:
        raise DepthToolsError(f"unknown skip rule(s) {bad} for {model.config.arch}; valid: {', '.join(valid)}")
    return chosen


def swap_pairs(n_layer: int, pairs: str = "adjacent") -> list[tuple[int, int]]:
    """Adjacent pairs (i, i+1), or every pair i < j."""
    if pairs not in PAIRS:
        raise DepthToolsError(f"unknown pairs {pairs!r}; valid: {', '.join(PAIRS)}")
    if pairs == "adjacent":
        return [(i, i + 1) for i in range(n_layer - 1)]
    return [(i, j) for i in range(n_layer) for j in range(i + 1, n_layer)]


def chosen_pairs(n_layer: int, pairs: str = "adjacent", max_pairs: int | None = None) -> list[tuple[int, int]]:
    """The swap pairs evaluated: `swap_pairs`, or at most `max_pairs` of them spread evenly over that
    list (i-major order, first and last kept), so a 30-layer model's 435 all-pairs swaps can be bounded.
    Each evaluated pair's row means what it always means; the permutation score's mean becomes a
    mean over the evenly spread sample (recorded as `swap_pairs_max` in the table's settings)."""
    every = swap_pairs(n_layer, pairs)
    if max_pairs is None or max_pairs >= len(every):
        return every
    if max_pairs < 1:
        raise DepthToolsError(f"--swap-pairs-max must be >= 1, got {max_pairs}")
    if max_pairs == 1:
        return every[:1]
    picks = sorted({round(k * (len(every) - 1) / (max_pairs - 1)) for k in range(max_pairs)})
    return [every[i] for i in picks]


def _run(model, tokens, plans, batch_size, progress) -> SweepResult:
    return sweep(model, tokens, plans, batch_size=batch_size, progress=progress)


def ablate_skip(model, tokens, rules=None, batch_size=8, progress: Progress | None = None) -> pd.DataFrame:
    """Single-block bypass at every position, once per skip rule of the architecture."""
    L, rows = model.n_layer, []
    for rule in _rules(model, rules):
        result = _run(model, tokens, [Plan.skipping(l, rule=rule) for l in range(L)], batch_size, progress)
        rows += [_row(model, "skip", rule, [l], s, result.intact) for l, s in enumerate(result.plans)]
    return _add_n_skip(_frame(rows))


def ablate_swap(model, tokens, pairs="adjacent", batch_size=8, progress: Progress | None = None,
                swap_pairs_max: int | None = None) -> pd.DataFrame:
    """Exchange blocks i and j; perm_score = |L_swap - L| / L (DepthBench permutation score).
    `swap_pairs_max` bounds the pairs evaluated (`chosen_pairs`)."""
    L = model.n_layer
    chosen = chosen_pairs(L, pairs, swap_pairs_max)
    result = _run(model, tokens, [Plan.swapping(i, j, L) for i, j in chosen], batch_size, progress)
    rows = [
        _row(model, "swap", NO_RULE, [i, j], s, result.intact, pairs=pairs,
             perm_score=abs(s.ce - result.intact.ce) / result.intact.ce)
        for (i, j), s in zip(chosen, result.plans)
    ]
    mean, se = sample_mean_se([r["perm_score"] for r in rows], len(swap_pairs(L, pairs)))
    return _frame([{**r, "perm_score_mean": mean, "perm_score_se": se, "n_pairs_total": len(swap_pairs(L, pairs))}
                   for r in rows])


def sample_mean_se(values: Sequence[float], population: int) -> tuple[float, float]:
    """(mean, standard error of that mean) of `values` sampled without replacement from `population` items:
    s/√n · √(1 − n/N) (finite-population correction: 0 when every pair is evaluated; NaN with one of many).
    The evenly spread pairs (`chosen_pairs`) are treated as a simple random sample of the pairs."""
    x = np.asarray(values, dtype=np.float64)
    n = len(x)
    if n == 0:
        return float("nan"), float("nan")
    if n >= population:
        return float(x.mean()), 0.0
    if n < 2:
        return float(x.mean()), float("nan")
    return float(x.mean()), float(x.std(ddof=1) / np.sqrt(n) * np.sqrt(1 - n / population))


# -- pruning -------------------------------------------------------------------------------------
def greedy_prune(model, tokens, rule: str, tau: float, batch_size=8, max_steps: int | None = None,
                 progress: Progress | None = None) -> list[dict]:
    """Repeatedly remove the block whose removal (with those already removed) hurts least, re-measuring
    each time, until ΔCE > tau (that crossing step is kept) or no block is left."""
    L, removed, rows = model.n_layer, [], []
    steps = L if max_steps is None else min(L, max_steps)
    for _ in range(steps):
        candidates = [l for l in range(L) if l not in removed]
        plans = [Plan(skip=frozenset([*removed, l]), skip_rule=rule) for l in candidates]
        result = _run(model, tokens, plans, batch_size, progress)
        best = int(np.argmin([s.ce for s in result.plans]))
        removed.append(candidates[best])
        stats = result.plans[best]
        rows.append(_row(model, "prune", rule, list(removed), stats, result.intact, method="greedy",
                         layer_removed=candidates[best]))
        if stats.ce - result.intact.ce > tau:
            break
    return rows


@torch.no_grad()
def angular_distances(model, tokens: torch.Tensor, batch_size: int = 8) -> np.ndarray:
    """[L+1, L+1] mean over sequences of arccos(cos(g_i, g_j))/π, g = geometry(z) at the last token
    (Gromov et al. 2024)."""
    tokens = check_tokens(model, tokens)
    L = model.n_layer
    total, count = torch.zeros(L + 1, L + 1, dtype=torch.float64), 0
    for batch in batches(tokens, batch_size):
        states = intact_states(model, split_inputs(batch)[0])
        g = torch.stack([model.geometry(s)[:, -1].double() for s in states])  # [L+1, B, k]
        g = g / g.norm(dim=-1, keepdim=True).clamp_min(1e-30)
        cos = torch.einsum("ibk,jbk->bij", g, g).clamp(-1, 1)
        total += (torch.arccos(cos) / torch.pi).sum(0).cpu()
        count += g.shape[1]
    return (total / count).numpy()


def gromov_prune(model, tokens, rule: str, batch_size=8, progress: Progress | None = None) -> list[dict]:
    """For each block size n, remove the n consecutive blocks l*..l*+n-1 whose input and output
    states are closest in angle (l* = argmin_l d(z_l, z_{l+n}))."""
    L = model.n_layer
    dist = angular_distances(model, tokens, batch_size)
    choices = []
    for n in range(1, L):
        candidates = [dist[l, l + n] for l in range(L - n + 1)]
        start = int(np.argmin(candidates))
        choices.append((n, start, float(candidates[start])))
    plans = [Plan(skip=frozenset(range(s, s + n)), skip_rule=rule) for n, s, _ in choices]
    result = _run(model, tokens, plans, batch_size, progress)
    return [
        _row(model, "prune", rule, list(range(s, s + n)), stats, result.intact, method="gromov",
             angular_distance=d)
        for (n, s, d), stats in zip(choices, result.plans)
    ]


def skip_deltas(model, tokens, rule: str, batch_size=8, progress: Progress | None = None) -> list[float]:
    """Single-skip ΔCE of every block under `rule` (the `ablate_skip` sweep's delta_ce column)."""
    L = model.n_layer
    result = _run(model, tokens, [Plan.skipping(l, rule=rule) for l in range(L)], batch_size, progress)
    return [s.ce - result.intact.ce for s in result.plans]


def skip_order(delta_ce: Sequence[float]) -> list[int]:
    """Blocks in ascending single-skip ΔCE (ties: lower block first): the default pruning order."""
    return [int(l) for l in np.argsort(np.asarray(delta_ce, dtype=np.float64), kind="stable")]


def order_prune(model, tokens, rule: str, batch_size=8, max_steps: int | None = None,
                progress: Progress | None = None, delta_ce: Sequence[float] | None = None) -> list[dict]:
    """Remove blocks cumulatively in single-skip order (`skip_order` of `delta_ce`, measured here when not
    given): step k skips the k least harmful single blocks together. One sweep of at most L plans,
    instead of the greedy curve's L²/2, at the price of not re-measuring after each removal."""
    L = model.n_layer
    if delta_ce is None:
        delta_ce = skip_deltas(model, tokens, rule, batch_size, progress)
    if len(delta_ce) != L:
        raise DepthToolsError(f"the single-skip order needs {L} ΔCE values (one per block), got {len(delta_ce)}")
    order = skip_order(delta_ce)
    steps = L if max_steps is None else min(L, max_steps)
    plans = [Plan(skip=frozenset(order[:k]), skip_rule=rule) for k in range(1, steps + 1)]
    result = _run(model, tokens, plans, batch_size, progress)
    return [_row(model, "prune", rule, order[:k], stats, result.intact, method="skip_order",
                 layer_removed=order[k - 1]) for k, stats in zip(range(1, steps + 1), result.plans)]


def prunable_fraction(delta_ce: Sequence[float], n_layer: int, tau: float) -> float:
    """F_tau: blocks removed (in curve order, 1 per step) before ΔCE first exceeds tau, over L."""
    kept = 0
    for value in delta_ce:
        if value > tau:
            break
        kept += 1
    return kept / n_layer


PRUNE_CURVES = ("order", "greedy")  # the removal curve beside Gromov's: single-skip order (default) or greedy


def check_prune(curve: str) -> str:
    """`curve` if it is a pruning curve (order, greedy); else a one-line error."""
    if curve not in PRUNE_CURVES:
        raise DepthToolsError(f"unknown --prune {curve!r}; valid: {', '.join(PRUNE_CURVES)}")
    return curve


def ablate_prune(model, tokens, rules=None, tau=0.05, batch_size=8, max_steps=None,
                 progress: Progress | None = None, curve: str = "order",
                 skip_delta: dict[str, Sequence[float]] | None = None) -> pd.DataFrame:
    """A removal curve (`curve`: single-skip order, or greedy re-measured) and Gromov's contiguous-block
    curve, per skip rule, with F_tau. `skip_delta` {rule: single-skip ΔCE per block} reuses an
    `ablate_skip` sweep already measured on the same tokens (the order curve's only input)."""
    if tau < 0:
        raise DepthToolsError(f"tau must be >= 0 nats, got {tau}")
    check_prune(curve)
    rows = []
    for rule in _rules(model, rules):
        if curve == "greedy":
            removal = greedy_prune(model, tokens, rule, tau, batch_size, max_steps, progress)
        else:
            removal = order_prune(model, tokens, rule, batch_size, max_steps, progress, (skip_delta or {}).get(rule))
        for method_rows in (removal, gromov_prune(model, tokens, rule, batch_size, progress)):
            f_tau = prunable_fraction([r["delta_ce"] for r in method_rows], model.n_layer, tau)
            rows += [{**r, "tau": tau, "f_tau": f_tau} for r in method_rows]
    return _frame(rows)


# -- replacement (linear / mean) -----------------------------------------------------------------
def _require_tensor_states(model, states: list, mode: str, need_flat_geometry: bool) -> None:
    """Refuse states the replacement cannot map (see the module docstring)."""
    arch = model.config.arch
    for state in states:
        if not isinstance(state, torch.Tensor):
            raise UnsupportedAblation(
                f"ablation mode {mode!r} is unsupported for {arch}: its depth state is a "
                f"{type(state).__name__}, not a tensor (replacing a block would have to invent its depth sources)"
            )
        if need_flat_geometry:
            geometry = model.geometry(state)
            if geometry.shape != (*state.shape[:2], state[0, 0].numel()) or not torch.equal(
                geometry, state.reshape(*state.shape[:2], -1)
            ):
                raise UnsupportedAblation(
                    f"ablation mode {mode!r} is unsupported for {arch}: geometry(state) is not the state "
                    "flattened over its trailing dims, so a map fitted on geometry cannot be applied to the state"
                )


def fit_affine(xtx: torch.Tensor, xty: torch.Tensor, ridge: float = 1e-10) -> tuple[torch.Tensor, torch.Tensor]:
    """Least-squares Y ≈ X W + b from the normal equations of [X, 1] (float64, tiny relative ridge).

    xtx: [k+1, k+1] = [X,1]ᵀ[X,1]; xty: [k+1, m] = [X,1]ᵀY. Returns W [k, m], b [m].
    """
    xtx, xty = xtx.double().cpu(), xty.double().cpu()
    scale = float(torch.diagonal(xtx).mean()) or 1.0
    solution = torch.linalg.solve(xtx + ridge * scale * torch.eye(xtx.shape[0], dtype=xtx.dtype), xty)
    return solution[:-1], solution[-1]


def _augment(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, x.new_ones(x.shape[0], 1)], dim=1)


@torch.no_grad()
def _block_statistics(model, tokens, batch_size: int, mode: str, max_bytes: float = 2**30) -> dict[int, tuple]:
    """Per block l, from the intact states on scored positions: linear -> (xᵀx, xᵀy) of
    [geometry(z_l), 1] against geometry(z_{l+1}); mean -> (sum of z_{l+1} - z_l, count).

    Linear accumulators are (k+1)² float64 per block; blocks are grouped so they fit `max_bytes`,
    one pass over the tokens per group.
    """
    L = model.n_layer
    first = split_inputs(tokens[:1])[0]
    probe = intact_states(model, first)
    _require_tensor_states(model, probe, mode, need_flat_geometry=(mode == "linear"))
    k = probe[0][0, 0].numel()
    per_block = 8 * (k + 1) * (2 * k + 1) if mode == "linear" else 8 * k
    group = max(1, int(max_bytes // per_block))
    out: dict[int, tuple] = {}
    for lo in range(0, L, group):
        blocks = range(lo, min(L, lo + group))
        acc = {l: None for l in blocks}
        count = 0
        for batch in batches(tokens, batch_size):
            states = intact_states(model, split_inputs(batch)[0])
            for l in blocks:
                x = states[l][:, FIRST_SCORED:].reshape(-1, k).double()
                y = states[l + 1][:, FIRST_SCORED:].reshape(-1, k).double()
                if mode == "linear":
                    xa = _augment(x)
                    terms = (xa.T @ xa, xa.T @ y)
                else:
                    terms = ((y - x).sum(0),)
                acc[l] = terms if acc[l] is None else tuple(a + t for a, t in zip(acc[l], terms))
            count += states[0][:, FIRST_SCORED:].shape[0] * states[0][:, FIRST_SCORED:].shape[1]
        for l in blocks:
            out[l] = (*acc[l], count)
    return out


def affine_replacement(weight: torch.Tensor, bias: torch.Tensor) -> Callable:
    """State -> state: the affine map on the flattened trailing dims, reshaped back."""

    def replace(state: torch.Tensor) -> torch.Tensor:
        flat = state.reshape(*state.shape[:2], -1)
        out = flat @ weight.to(flat) + bias.to(flat)
        return out.reshape(state.shape)

    return replace


def mean_replacement(mean_update: torch.Tensor) -> Callable:
    """State -> state + the block's token-mean update."""

    def replace(state: torch.Tensor) -> torch.Tensor:
        return state + mean_update.to(state).reshape(state.shape[2:])

    return replace


def ablate_linear(model, tokens, batch_size=8, fit_tokens=None, progress: Progress | None = None) -> pd.DataFrame:
    """DepthBench usefulness: replace block l by the least-squares affine map from its input geometry to
    its output geometry (fitted on `fit_tokens`, default the evaluation tokens); ratio = ce / ce_intact."""
    tokens = check_tokens(model, tokens)
    fit_tokens = tokens if fit_tokens is None else check_tokens(model, fit_tokens)
    stats = _block_statistics(model, fit_tokens, batch_size, "linear")
    plans = [Plan(replace={l: affine_replacement(*fit_affine(xtx, xty))}) for l, (xtx, xty, _) in sorted(stats.items())]
    result = _run(model, tokens, plans, batch_size, progress)
    rows = []
    for l, s in enumerate(result.plans):
        ratio = s.ce / result.intact.ce
        rows.append(_row(model, "linear", NO_RULE, [l], s, result.intact, usefulness_ratio=ratio,
                         significant=bool(ratio > SIGNIFICANT_RATIO)))
    df = _add_n_skip(_frame(rows))
    df["usefulness"] = df["significant"].mean()
    return df


def ablate_mean(model, tokens, batch_size=8, fit_tokens=None, progress: Progress | None = None) -> pd.DataFrame:
    """Mean-ablation: block l's update z_{l+1} - z_l replaced by its mean over the (fit) tokens."""
    tokens = check_tokens(model, tokens)
    fit_tokens = tokens if fit_tokens is None else check_tokens(model, fit_tokens)
    stats = _block_statistics(model, fit_tokens, batch_size, "mean")
    plans = [Plan(replace={l: mean_replacement(total / count)}) for l, (total, count) in sorted(stats.items())]
    result = _run(model, tokens, plans, batch_size, progress)
    rows = [_row(model, "mean", NO_RULE, [l], s, result.intact) for l, s in enumerate(result.plans)]
    return _add_n_skip(_frame(rows))


# -- the entry point -----------------------------------------------------------------------------
def n_plans(model, mode: str, pairs: str = "adjacent", rules: Sequence[str] | None = None,
            swap_pairs_max: int | None = None, prune: str = "order", max_prune_steps: int | None = None,
            skip_measured: bool = False) -> int | None:
    """How many plans `ablate` evaluates (for progress bars); None when data-dependent (greedy prune).
    The order curve: its steps + Gromov's L−1 (+ the single-skip sweep unless `skip_measured`)."""
    L = model.n_layer
    if mode == "prune" and prune == "order":
        steps = L if max_prune_steps is None else min(L, max_prune_steps)
        return (steps + L - 1 + (0 if skip_measured else L)) * len(_rules(model, rules))
    if mode == "skip":
        return L * len(_rules(model, rules))
    if mode == "swap":
        return len(chosen_pairs(L, pairs, swap_pairs_max))
    if mode in ("linear", "mean"):
        return L
    return None


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise DepthToolsError(f"unknown ablation mode {mode!r}; valid: {', '.join(MODES)}")
    return mode


def ablate(
    model,
    tokens: torch.Tensor,
    mode: str = "skip",
    pairs: str = "adjacent",
    rules: Sequence[str] | None = None,
    tau: float = 0.05,
    batch_size: int = 8,
    fit_tokens: torch.Tensor | None = None,
    max_prune_steps: int | None = None,
    progress: Progress | None = None,
    swap_pairs_max: int | None = None,
    prune: str = "order",
    skip_delta: dict[str, Sequence[float]] | None = None,
) -> pd.DataFrame:
    """One tidy row per model × plan for an ablation `mode` (see the module docstring).

    `rules`: skip rules to run (default every rule in `model.scheme.skip_rules` but its
    `on_request_skip_rules`; rows labelled by rule). `tau`: pruning tolerance in nats. `fit_tokens`: tokens for the linear/mean fits.
    `prune`: the removal curve (order: single-skip order, default; greedy: re-measured, L²/2 plans);
    `skip_delta`: {rule: single-skip ΔCE per block} already measured on `tokens` (the order curve reuses it).
    """
    check_mode(mode)
    check_prune(prune)
    if mode == "swap":
        chosen_pairs(model.n_layer, pairs, swap_pairs_max)
    tokens = check_tokens(model, tokens)
    if mode == "skip":
        return ablate_skip(model, tokens, rules, batch_size, progress)
    if mode == "swap":
        return ablate_swap(model, tokens, pairs, batch_size, progress, swap_pairs_max)
    if mode == "prune":
        return ablate_prune(model, tokens, rules, tau, batch_size, max_prune_steps, progress, prune, skip_delta)
    if mode == "linear":
        return ablate_linear(model, tokens, batch_size, fit_tokens, progress)
    return ablate_mean(model, tokens, batch_size, fit_tokens, progress)

