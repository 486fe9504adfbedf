"""Causal skip-effect scores between blocks (DepthBench causal score; Csordás et al. 2025, §2.3).

With u_l = geometry(z_{l+1}) − geometry(z_l) the update of block l (0-based, l = 0..L-1), skipping
block s changes every later update; the causal score is

    C(s, l) = mean_t ‖u_l^{skip s}(t) − u_l(t)‖ / ‖u_l(t)‖            for every s < l

(DepthBench `compute_causal_score.py`; Csordás' "current" matrix is the same ratio with a max
over tokens, reported here as `causal_score_max`). Skipped runs reuse the cached prefix: one
intact forward per batch, then for each s `run_states(plan=Plan.skipping(s, rule), start=s,
from_state=states[s])` (L−s blocks, not L). The skip rule is the architecture's own (default or
`rule`; docs/reference/architectures.md §4). These runs are the single-skip sweep's plans: within the
suite (`sweep.shared_sweeps`) each run's final hidden state is kept (`sweep.remember_hidden`), so the
skip sweep of sequence_profile / ablate_skip decodes it instead of running its blocks again.

Future effect (Csordás "future" matrix): block s is skipped only at positions 1 ≤ t < cut and the
updates are compared only at positions t ≥ cut, isolating what reaches later tokens through
attention. Implemented with `Plan(replace={s: f})`, f(state) = position-wise mix of the skipped and
the intact block output (state_out = where(t < cut, skip_state, block_state)); the run starts from the
intact z_s, so the intact block output is the cached z_{s+1} (L−s−1 blocks per cut, not L−s). Attention is
causal, so the runs of two cuts c < c' agree at every position < c in every later layer: where the scheme
has a suffix step (`suffix_support`: the normalisation family, every imported Hugging Face family included)
the largest cut runs whole and keeps each block's keys and values, and every smaller cut c runs only its
rows t ≥ c, reading the keys and values of rows < c from it ((L−s−1)·(T−c)/T block-equivalents, not L−s−1);
only rows ≥ c are compared, so the scores are those of whole runs. Other schemes run whole sequences. The mix is defined
for tensor states and for states whose skipped and intact versions have the same structure with
tensor leaves [B,T,...] (e.g. DenseFormer); otherwise (a skip that changes the state's structure,
such as AttnRes' source deletion or MoDA's masked depth slots) it is *unsupported*: the rows are
NaN and the table's notes say why.

Summaries (`causal_summary`): fraction of late-layer pairs with C > 0.45 (both blocks in the last
3/4 of the network; DepthBench, docs/reference/architectures.md §0.3), DepthBench's global score
(1/√L)(1/L)Σ_{s<L−1} mean_{l>s} C, and downstream influence DI_s = mean_{l>s} C(s,l) with its
second-half mean over s ≥ L/2.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import pandas as pd
import torch

from depthtools.analysis.geometry import check_positions, model_inputs, tidy_frame
from depthtools.analysis.sweep import intact_states, remember_hidden
from depthtools.analysis.tokens import batches, token_fingerprint
from depthtools.arch.model import Plan
from depthtools.arch.torch_private import is_hooked
from depthtools.errors import DepthToolsError

F64 = torch.float64
LATE_FRACTION = 0.75
CAUSAL_THRESHOLD = 0.45


class UnsupportedState(DepthToolsError):
    """The intervention is not defined for this architecture's depth state."""


def _updates(model, states: Sequence[Any]) -> list[torch.Tensor]:
    """u_l = geometry(z_{l+1}) − geometry(z_l) for consecutive states, float32 [B,T,k]."""
    g = [model.geometry(s).float() for s in states]
    return [b - a for a, b in zip(g[:-1], g[1:])]


def _ratio(changed: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """‖changed − base‖ / ‖base‖ per token [B,T]; 0/0 counts as 0."""
    num = (changed - base).norm(dim=-1)
    den = base.norm(dim=-1)
    return torch.where(num == 0, torch.zeros_like(num), num / den.clamp_min(torch.finfo(den.dtype).tiny))


class _PairStats:
    """Sum / count / max of per-token ratios for each (s, l) pair, float64."""

    def __init__(self, L: int):
        self.sum = torch.zeros(L, L, dtype=F64)
        self.count = torch.zeros(L, L, dtype=F64)
        self.max = torch.full((L, L), -math.inf, dtype=F64)

    def add(self, s: int, l: int, ratios: torch.Tensor) -> None:
        if ratios.numel() == 0:
            return
        r = ratios.to(F64)
        self.sum[s, l] += r.sum()
        self.count[s, l] += r.numel()
        self.max[s, l] = max(float(self.max[s, l]), float(r.max()))

    def mean(self) -> torch.Tensor:
        M = self.sum / self.count
        M[self.count == 0] = math.nan
        return M

    def maximum(self) -> torch.Tensor:
        M = self.max.clone()
        M[self.count == 0] = math.nan
        return M


# -- position-wise mixing of two states ----------------------------------------------------------

def mix_by_position(skipped: Any, intact: Any, mask: torch.Tensor) -> Any:
    """where(mask[b,t], skipped, intact) leaf by leaf; `mask` [B,T] bool.

    Tensor states mix directly; tuples, NamedTuples and dataclasses mix field by field when both
    versions have the same structure. Raises `UnsupportedState` when they do not (a skip that adds
    or removes state entries) or when a tensor leaf has no [B,T] leading axes.
    """
    if torch.is_tensor(skipped) and torch.is_tensor(intact):
        if skipped.shape != intact.shape or tuple(skipped.shape[:2]) != tuple(mask.shape):
            raise UnsupportedState(
                f"state tensors of shape {tuple(skipped.shape)} / {tuple(intact.shape)} cannot be mixed by position"
            )
        m = mask.reshape(*mask.shape, *([1] * (skipped.dim() - 2)))
        return torch.where(m, skipped, intact)
    if type(skipped) is not type(intact):
        raise UnsupportedState(f"skipped and intact states differ in type ({type(skipped).__name__})")
    if dataclasses.is_dataclass(skipped):
        fields = {f.name: mix_by_position(getattr(skipped, f.name), getattr(intact, f.name), mask)
                  for f in dataclasses.fields(skipped)}
        return dataclasses.replace(skipped, **fields)
    if isinstance(skipped, (tuple, list)):
        if len(skipped) != len(intact):
            raise UnsupportedState(
                f"the skip changes the state's structure ({len(intact)} -> {len(skipped)} entries)"
            )
        mixed = [mix_by_position(a, b, mask) for a, b in zip(skipped, intact)]
        if hasattr(skipped, "_fields"):  # NamedTuple
            return type(skipped)(*mixed)
        return type(skipped)(mixed)
    if skipped is None and intact is None:
        return None
    try:
        same = bool(skipped == intact)
    except Exception:  # noqa: BLE001 - anything not comparable cannot be mixed
        same = False
    if not same:
        raise UnsupportedState(f"the skip changes a non-tensor part of the state ({skipped!r} vs {intact!r})")
    return skipped


def partial_skip(model, position: int, mask: torch.Tensor, rule: str | None = None, intact_out: Any = None):
    """A Plan.replace function: the scheme's skip at positions where `mask`, the block elsewhere.
    `intact_out`: the block's output on the state it will be given, when already known (the intact
    z_{s+1} for a run from the intact z_s), so the block is not run again: one block per cut saved."""
    skip_plan = Plan.skipping(position, rule=rule)

    def replace(state):
        skipped = model.apply_position(position, state, skip_plan)
        intact = model.block_step(position, state) if intact_out is None else intact_out
        return mix_by_position(skipped, intact, mask)

    return replace


def default_cuts(seq_len: int, n_cuts: int = 4) -> list[int]:
    """Cut points: up to n_cuts evenly spread over {8, 16, …} < T−4 (Csordás), else T//2."""
    candidates = list(range(8, seq_len - 4, 8))
    if not candidates:
        return [max(2, seq_len // 2)] if seq_len >= 3 else []
    if len(candidates) <= n_cuts:
        return candidates
    if n_cuts <= 1:
        return [candidates[len(candidates) // 2]]
    picks = [candidates[round(i * (len(candidates) - 1) / (n_cuts - 1))] for i in range(n_cuts)]
    return sorted(set(picks))


# -- the analysis --------------------------------------------------------------------------------

@torch.no_grad()
def causal_scores(
    model,
    tokens: torch.Tensor,
    batch_size: int = 8,
    rule: str | None = None,
    exclude_first: int = 1,
    future: bool = True,
    cuts: Sequence[int] | None = None,
    threshold: float = CAUSAL_THRESHOLD,
    late_fraction: float = LATE_FRACTION,
    progress: Callable[[float], None] | None = None,
) -> pd.DataFrame:
    """Causal score matrix C(s,l) (+ max), optional future-effect matrix, and their summaries.

    tokens: a token set [N,T+1] (the model reads the first T). Rows (unit "block"): metric
    causal_score / causal_score_max with layer = s (skipped block) and layer_j = l > s (affected
    update); future_effect / future_effect_max likewise; model summaries from `causal_summary` (prefixed future_ for the future matrix).
    Positions < exclude_first are never measured (and never skipped in the future variant).
    `progress(advance)` is called after each skipped block on each batch (1 / number of batches), so a
    progress bar over the L skipped blocks reaches L.
    """
    inputs = model_inputs(model, tokens)
    check_positions(inputs, exclude_first)
    model.eval()
    L = model.n_layer
    T = inputs.shape[1]
    cuts = list(default_cuts(T) if cuts is None else cuts)
    bad = [c for c in cuts if not exclude_first < c < T]
    if future and bad:
        raise DepthToolsError(f"cut points {bad} must lie in {exclude_first + 1}..{T - 1}")
    current, fut = _PairStats(L), _PairStats(L)
    notes: list[str] = []
    future_ok = future and bool(cuts)
    if future and not cuts:
        notes.append("future effect skipped: sequences too short for a cut point")
    n_batches = -(-inputs.shape[0] // batch_size)
    for batch in batches(inputs, batch_size):
        states = intact_states(model, batch)  # shared with the suite's other probes (sweep.shared_sweeps)
        base = _updates(model, states)  # L x [B,T,k]
        for s in range(L):
            plan = Plan.skipping(s, rule=rule)
            skipped = model.run_states(plan=plan, start=s, from_state=states[s])
            remember_hidden(model, batch, plan, skipped[-1])  # the skip sweep's plan s: not run again in the suite
            changed = _updates(model, skipped)  # updates s..L-1
            for l in range(s + 1, L):
                current.add(s, l, _ratio(changed[l - s], base[l])[:, exclude_first:])
            if future_ok:
                future_ok = _future_effects(model, states, base, s, cuts, exclude_first, rule, fut, notes)
            if progress is not None:
                progress(1.0 / n_batches)
    rows: list[dict[str, Any]] = []
    matrices = {"causal_score": current.mean(), "causal_score_max": current.maximum()}
    if future:
        nan = torch.full((L, L), math.nan, dtype=F64)
        matrices["future_effect"] = fut.mean() if future_ok else nan
        matrices["future_effect_max"] = fut.maximum() if future_ok else nan
    for metric, M in matrices.items():
        for s in range(L):
            for l in range(s + 1, L):
                rows.append({"metric": metric, "unit": "block", "layer": s, "layer_j": l, "value": float(M[s, l])})
    for prefix, key in (("", "causal_score"), ("future_", "future_effect")):
        if key in matrices:
            for name, value in causal_summary(matrices[key], threshold, late_fraction).items():
                rows.append({"metric": prefix + name, "value": value})
    settings = dict(batch_size=batch_size, rule=rule, exclude_first=exclude_first, future=future, cuts=cuts,
                    threshold=threshold, late_fraction=late_fraction,
                    n_sequences=int(inputs.shape[0]), seq_len=T, tokens=token_fingerprint(tokens))
    return tidy_frame(model, rows, settings, notes)


def suffix_support(model) -> str | None:
    """None when the future-effect runs may share their first rows (`_future_effects_by_rows`); else why
    each cut runs whole sequences: the scheme has no suffix step (`NormFamilyScheme.step_suffix` states the
    contract), or a hook is attached (a suffix step calls no hook point on whole tensors; with
    DEPTHTOOLS_TORCH_FALLBACKS set every module counts as hooked, so this fast path is off too)."""
    if not _defines_suffix(model.scheme) or not hasattr(model, "rope_cos"):
        return f"{model.config.arch} has no suffix step"
    if is_hooked(*model.modules()):
        return "a hook is attached to the model"
    return None


def _defines_suffix(scheme) -> bool:
    """Whether the class that defines the scheme's `step` also defines `step_suffix` (a subclass that changes
    the step does not inherit a suffix step written for its parent's)."""
    for cls in type(scheme).__mro__:
        if "step" in vars(cls):
            return "step_suffix" in vars(cls)
    return False


def _rows_run(model, s: int, first: torch.Tensor, start: int, past: list | None) -> tuple[list, list]:
    """Blocks s+1..L−1 on the rows at positions start.. of z_{s+1} (`first`, those rows), each block reading
    the keys and values of rows < start from `past` (one (k, v) per block; None at start 0): the states
    z_{s+1}.. of those rows and each block's (k, v) of all rows."""
    rope, out, caches = (model.rope_cos, model.rope_sin), [first], []
    for i, p in enumerate(range(s + 1, model.n_layer)):
        block = model.blocks[p]
        h, kv = model.scheme.step_suffix(p, block, out[-1], block, rope, start, None if past is None else past[i])
        out.append(h)
        caches.append(kv)
    return out, caches


def _future_effects_by_rows(model, states: list, base: list[torch.Tensor], s: int, cuts: Sequence[int],
                            exclude_first: int, rule: str | None, fut: _PairStats) -> None:
    """`_future_effects` with shared rows: the largest cut c* runs whole from z_s (its block-s output mixed as
    `partial_skip` mixes it) and keeps every block's keys and values; each smaller cut c starts from the
    intact z_{s+1} at rows ≥ c (block s is intact there) and runs only those rows, with the keys and values
    of rows < c from c*'s run: both runs skip block s at the same positions < c, so (causal attention) their
    rows < c agree in every later block."""
    B, T = base[0].shape[:2]
    positions = torch.arange(T)
    order = sorted(cuts, reverse=True)
    top = order[0]
    mask = ((positions >= exclude_first) & (positions < top)).expand(B, T)
    first = partial_skip(model, s, mask, rule, intact_out=states[s + 1])(states[s])
    part, caches = _rows_run(model, s, first, 0, None)
    for cut in order:
        if cut != top:
            part, _ = _rows_run(model, s, states[s + 1][:, cut:], cut,
                                [(k[:, :cut], v[:, :cut]) for k, v in caches])
        g = [model.geometry(z).float() for z in part]  # z_{s+1}..z_L: rows ≥ cut (all rows for the top cut)
        for l in range(s + 1, model.n_layer):
            changed = g[l - s] - g[l - s - 1]  # block l's update
            fut.add(s, l, _ratio(changed[:, cut:] if cut == top else changed, base[l][:, cut:]))


def _future_effects(model, states: list, base: list[torch.Tensor], s: int, cuts: Sequence[int], exclude_first: int,
                    rule: str | None, fut: _PairStats, notes: list[str]) -> bool:
    """Add the future effects of skipping block s before each cut to `fut` (one suffix run per cut, or
    shared rows: `_future_effects_by_rows`); False (with a note) when the partial skip is not defined for
    this state."""
    if suffix_support(model) is None:
        try:
            _future_effects_by_rows(model, states, base, s, cuts, exclude_first, rule, fut)
        except UnsupportedState as exc:
            notes.append(f"future effect unsupported for {model.config.arch}: {exc}")
            return False
        return True
    L = model.n_layer
    B, T = base[0].shape[:2]  # geometry updates [B,T,k]
    positions = torch.arange(T)
    for cut in cuts:
        mask = ((positions >= exclude_first) & (positions < cut)).expand(B, T)
        plan = Plan(replace={s: partial_skip(model, s, mask, rule, intact_out=states[s + 1])})  # from z_s
        try:
            part = model.run_states(plan=plan, start=s, from_state=states[s])
        except UnsupportedState as exc:
            notes.append(f"future effect unsupported for {model.config.arch}: {exc}")
            return False
        changed_f = _updates(model, part)
        for l in range(s + 1, L):
            fut.add(s, l, _ratio(changed_f[l - s], base[l])[:, cut:])
    return True


def late_start(n_layer: int, late_fraction: float = LATE_FRACTION) -> int:
    """First block (0-based) of the last `late_fraction` of the network: L − round(fraction·L)."""
    return n_layer - int(round(late_fraction * n_layer))


def causal_summary(C: torch.Tensor, threshold: float = CAUSAL_THRESHOLD,
                   late_fraction: float = LATE_FRACTION) -> dict[str, float]:
    """Summaries of an L×L score matrix (entries with l > s used; NaN elsewhere ignored).

    late_pair_fraction: share of pairs s < l with both blocks ≥ late_start(L) and C > threshold.
    global_score: DepthBench (1/√L)(1/L) Σ_{s<L−1} mean_{l>s} C(s,l).
    downstream_influence_second_half: mean over s ≥ L/2 (with some l > s) of DI_s = mean_{l>s} C(s,l).
    downstream_influence_first_half: the same over s < L/2.
    """
    L = C.shape[0]
    start = late_start(L, late_fraction)
    late = [float(C[s, l]) for s in range(start, L) for l in range(s + 1, L)]
    late = [v for v in late if not math.isnan(v)]
    di = []
    for s in range(L - 1):
        vals = [float(C[s, l]) for l in range(s + 1, L) if not math.isnan(float(C[s, l]))]
        di.append(sum(vals) / len(vals) if vals else math.nan)
    valid_di = [d for d in di if not math.isnan(d)]
    second = [d for s, d in enumerate(di) if s >= L / 2 and not math.isnan(d)]
    first = [d for s, d in enumerate(di) if s < L / 2 and not math.isnan(d)]
    mean = lambda xs: sum(xs) / len(xs) if xs else math.nan  # noqa: E731
    return {
        "late_pair_fraction": mean([float(v > threshold) for v in late]),
        "global_score": (sum(valid_di) / L / math.sqrt(L)) if valid_di else math.nan,
        "downstream_influence_second_half": mean(second),
        "downstream_influence_first_half": mean(first),
    }

