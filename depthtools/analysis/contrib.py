"""Per-block contributions (Csordás et al. 2025) and block-Jacobian identity deviation
(docs/reference/metrics.md §2.3, §2.4).

On the contract's geometry, with Δ_l = geometry(z_{l+1}) − geometry(z_l) the update of block l (0-based):

* relative contribution r_l = ‖Δ_l‖/‖z_l‖ (mean and max over tokens), residual cosine
  cos(Δ_l, z_l) (< 0 erases, ≈ 0 writes new features, > 0 amplifies) and state cosine cos(z_{l+1}, z_l);
* the attention / MLP split (‖a‖/‖h‖, ‖m‖/‖h+a‖, cos(a,h), cos(m,h+a)) where a block declares a
  single residual stream (`hook_out_is_single_residual_stream`) AND the additivity identity
  geometry(z_l) = hook_resid_pre, hook_resid_pre + hook_attn_out + hook_mlp_out = geometry(z_{l+1})
  holds numerically at run time (relative tolerance `additive_tol`; in bfloat16/float16 against the sums
  rounded as the model rounds them; nnterp #51/#53). Where it fails
  (Post-LN, DeepNorm, Peri-LN's, ...) only the total Δ is reported and `additive` is 0 — a
  contract-level check, not an architecture branch;
* summary: late/early ratio ρ = mean_{l>L/2} r_l / mean_{l≤L/2} r_l (1-based l).

Block Jacobian identity deviation δ_l = E_{x,v} ‖J_l v − v‖²/‖v‖², J_l = ∂z_{l+1}/∂z_l over the whole
sequence (cross-token attention terms included), with Rademacher probes v (zero on the first
`exclude_first` positions, measured on the rest: the principal sub-Jacobian of the non-sink
positions), per sequence, averaged. Computed by forward-mode AD (`torch.func.jvp`) of
geometry-state -> next geometry-state, which exists when the state is a tensor that `geometry` only
reshapes (checked at run time), with the probes batched by `torch.func.vmap` so the block's primal runs once
per batch, not once per probe (`jvps`; each probe alone where vmap cannot batch a block, as for HC/mHC); a
no-op hook on `attn.hook_pattern` routes attention through its explicit form (PyTorch's fused CPU attention has no forward-mode derivative). If forward AD still
fails (e.g. a custom autograd Function without jvp) a central finite difference is used
(`jacobian_method` column). Non-tensor states: NaN with a note. near_identity_fraction = share of
blocks with δ < `identity_threshold` (0.1; docs/reference/metrics.md §2.4's stricter 0.01 is reported as
near_identity_fraction_strict).
"""

from __future__ import annotations

import math
import warnings
from contextlib import contextmanager
from typing import Any, Iterator

import pandas as pd
import torch
import torch.nn.functional as F

from depthtools.analysis.geometry import check_positions, model_inputs, tidy_frame
from depthtools.analysis.sweep import intact_states
from depthtools.analysis.tokens import batches, token_fingerprint

F64 = torch.float64
IDENTITY_THRESHOLD = 0.1
STRICT_IDENTITY_THRESHOLD = 0.01


def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.cosine_similarity(a, b, dim=-1, eps=1e-30)


def _capture_split(model, tokens: torch.Tensor):
    """(states, {l: (resid_pre, attn_out, mlp_out)}) for blocks declaring a single residual stream."""
    names = {}
    for l, block in enumerate(model.blocks):
        if getattr(block, "hook_out_is_single_residual_stream", False):
            for part in ("hook_resid_pre", "hook_attn_out", "hook_mlp_out"):
                names[f"blocks.{l}.{part}"] = (l, part)
    cache: dict[tuple[int, str], torch.Tensor] = {}

    def store(tensor, hook):
        cache[names[hook.name]] = tensor.detach()

    with model.hooks(fwd_hooks=[(name, store) for name in names]):
        states = model.run_states(tokens)
    split = {}
    for l in range(model.n_layer):
        parts = [cache.get((l, p)) for p in ("hook_resid_pre", "hook_attn_out", "hook_mlp_out")]
        if all(p is not None for p in parts):
            split[l] = tuple(p.float() for p in parts)
    return states, split


def _additive(split_parts, before: torch.Tensor, after: torch.Tensor, tol: float,
              dtype: torch.dtype = torch.float32) -> bool:
    """The additivity identity of one block, to relative tolerance (max over tokens). States of a lower
    precision than float32 (`dtype`, the model's) are compared with the residual sums rounded as the model
    rounds them -- (h + a) then + m, or h + (a + m) for a parallel block, each addition rounded to `dtype` --
    instead of their exact sum: two bfloat16 roundings are ~1e-2 of the state, more than the identity's
    tolerance and more than some designs that break it (Post-LN at init) miss it by."""
    h, a, m = split_parts
    if h.shape != before.shape or a.shape != h.shape or m.shape != h.shape:
        return False
    scale = after.norm(dim=-1).max().clamp_min(1e-30)
    if (h - before).norm(dim=-1).max() > tol * scale:
        return False
    if dtype.itemsize >= 4:
        sums = (h + a + m,)
    else:
        def rounded(x: torch.Tensor) -> torch.Tensor:
            return x.to(dtype).float()
        sums = (rounded(rounded(h + a) + m), rounded(h + rounded(a + m)))
    return any(bool((total - after).norm(dim=-1).max() <= tol * scale) for total in sums)


class _Mean:
    """Running float64 sums of per-block per-token quantities (mean and max)."""

    def __init__(self):
        self.sum: dict[tuple[str, int], float] = {}
        self.count: dict[tuple[str, int], int] = {}
        self.max: dict[tuple[str, int], float] = {}

    def add(self, name: str, l: int, values: torch.Tensor) -> None:
        v = values.to(F64)
        key = (name, l)
        self.sum[key] = self.sum.get(key, 0.0) + float(v.sum())
        self.count[key] = self.count.get(key, 0) + v.numel()
        self.max[key] = max(self.max.get(key, -math.inf), float(v.max()))

    def mean(self, name: str, l: int) -> float:
        key = (name, l)
        return self.sum[key] / self.count[key] if self.count.get(key) else math.nan


def block_statistics(model, states: list, split: dict, acc: "_Mean", additive: list[bool], exclude_first: int,
                     additive_tol: float) -> None:
    """Add one batch's per-block statistics to `acc` (norms, cosines, and the attention/MLP split where the
    block's additivity identity holds; `additive[l]` turns False where it fails). Also what
    `cost.contrib_seconds` times."""
    dtype = model.geometry(states[0]).dtype
    g = [model.geometry(s).float() for s in states]
    for l in range(model.n_layer):
        before, after = g[l][:, exclude_first:], g[l + 1][:, exclude_first:]
        delta = after - before
        acc.add("relative_contribution", l, delta.norm(dim=-1) / before.norm(dim=-1).clamp_min(1e-30))
        acc.add("residual_cosine", l, _cos(delta, before))
        acc.add("state_cosine", l, _cos(after, before))
        acc.add("update_norm", l, delta.norm(dim=-1))
        acc.add("state_norm", l, before.norm(dim=-1))
        parts = split.get(l)
        if parts is None or not _additive(parts, g[l], g[l + 1], additive_tol, dtype):
            additive[l] = False
            continue
        h, a, m = (p[:, exclude_first:] for p in parts)
        acc.add("attn_relative", l, a.norm(dim=-1) / h.norm(dim=-1).clamp_min(1e-30))
        acc.add("mlp_relative", l, m.norm(dim=-1) / (h + a).norm(dim=-1).clamp_min(1e-30))
        acc.add("attn_cosine", l, _cos(a, h))
        acc.add("mlp_cosine", l, _cos(m, h + a))


@torch.no_grad()
def contributions(
    model,
    tokens: torch.Tensor,
    batch_size: int = 8,
    exclude_first: int = 1,
    additive_tol: float = 1e-4,
    jacobian: bool = True,
    probes: int = 2,
    identity_threshold: float = IDENTITY_THRESHOLD,
    seed: int = 0,
) -> pd.DataFrame:
    """Relative contributions, residual cosines, attention/MLP split and Jacobian deviation per block.

    tokens: a token set [N,T+1] (the model reads the first T).
    Rows (unit "block", layer = block l): relative_contribution(_max), residual_cosine, state_cosine,
    update_norm, state_norm, additive (1/0), and where additive attn_relative, mlp_relative,
    attn_cosine, mlp_cosine; jacobian_deviation (+ jacobian_method column). Model rows:
    late_early_ratio, near_identity_fraction, near_identity_fraction_strict.
    """
    inputs = model_inputs(model, tokens)
    check_positions(inputs, exclude_first)
    model.eval()
    L = model.n_layer
    acc = _Mean()
    additive = [True] * L
    for batch in batches(inputs, batch_size):
        states, split = _capture_split(model, batch)
        block_statistics(model, states, split, acc, additive, exclude_first, additive_tol)
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    for l in range(L):
        for name in ("relative_contribution", "residual_cosine", "state_cosine", "update_norm", "state_norm"):
            rows.append({"metric": name, "unit": "block", "layer": l, "value": acc.mean(name, l)})
        rows.append({"metric": "relative_contribution_max", "unit": "block", "layer": l,
                     "value": acc.max.get(("relative_contribution", l), math.nan)})
        rows.append({"metric": "additive", "unit": "block", "layer": l, "value": float(additive[l])})
        if additive[l]:
            for name in ("attn_relative", "mlp_relative", "attn_cosine", "mlp_cosine"):
                rows.append({"metric": name, "unit": "block", "layer": l, "value": acc.mean(name, l)})
    if not all(additive):
        notes.append(f"attention/MLP split unavailable for blocks {[l for l in range(L) if not additive[l]]} "
                     "(not a single residual stream, or resid_pre + attn_out + mlp_out != next state)")
    r = [acc.mean("relative_contribution", l) for l in range(L)]
    late = [r[l - 1] for l in range(1, L + 1) if l > L / 2]
    early = [r[l - 1] for l in range(1, L + 1) if l <= L / 2]
    ratio = (sum(late) / len(late)) / (sum(early) / len(early)) if late and early and sum(early) > 0 else math.nan
    rows.append({"metric": "late_early_ratio", "value": ratio})
    if jacobian:
        dev, method, note = jacobian_deviation(model, inputs, batch_size, exclude_first, probes, seed)
        if note:
            notes.append(note)
        for l in range(L):
            rows.append({"metric": "jacobian_deviation", "unit": "block", "layer": l, "value": dev[l],
                         "jacobian_method": method[l]})
        valid = [d for d in dev if not math.isnan(d)]
        for name, thr in (("near_identity_fraction", identity_threshold),
                          ("near_identity_fraction_strict", STRICT_IDENTITY_THRESHOLD)):
            rows.append({"metric": name, "value": sum(d < thr for d in valid) / len(valid) if valid else math.nan})
    settings = dict(batch_size=batch_size, exclude_first=exclude_first, additive_tol=additive_tol, jacobian=jacobian,
                    probes=probes, identity_threshold=identity_threshold, seed=seed,
                    n_sequences=int(inputs.shape[0]), seq_len=int(inputs.shape[1]), tokens=token_fingerprint(tokens))
    return tidy_frame(model, rows, settings, notes)


# -- block Jacobian ------------------------------------------------------------------------------

def _explicit_attention_hooks(model):
    """No-op hooks on every attention pattern: the explicit attention path supports forward AD."""
    return model.hooks(fwd_hooks=[(lambda name: name.endswith("attn.hook_pattern"), lambda t, hook: None)])


@contextmanager
def _forward_ad(model) -> Iterator[None]:
    """What a forward-mode pass through a block needs (`jvp`, `jvps`): grad mode, the explicit attention path,
    and quiet about PyTorch's forward-AD decompositions, registered with torch.jit.script on first use."""
    with torch.enable_grad(), _explicit_attention_hooks(model), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.jit.script.*", category=DeprecationWarning)
        yield


def block_map(model, position: int, state):
    """(x, f) with x = geometry(state) and f: geometry -> geometry of the next state; None if the
    state is not a tensor that geometry merely reshapes."""
    if not torch.is_tensor(state):
        return None
    x = model.geometry(state)
    if x.numel() != state.numel() or not torch.equal(x.reshape(state.shape), state):
        return None
    if not torch.equal(model.geometry(x.reshape(state.shape)), x):
        return None
    shape = state.shape
    return x, lambda g: model.geometry(model.block_step(position, g.reshape(shape)))


def jvp(model, f, x: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, str]:
    """J_f(x) v by forward-mode AD, or by a central finite difference if AD is not available."""
    try:
        with _forward_ad(model):
            return torch.func.jvp(f, (x,), (v,))[1].detach(), "jvp"
    except (NotImplementedError, RuntimeError):
        eps = 1e-3 * float(x.norm()) / max(float(v.norm()), 1e-30)
        with torch.no_grad():
            return ((f(x + eps * v) - f(x - eps * v)) / (2 * eps)), "finite_difference"


def jvps(model, f, x: torch.Tensor, vs: torch.Tensor) -> tuple[torch.Tensor, str]:
    """J_f(x) v for each probe v in `vs` [P, *x.shape]: one forward-mode pass with the probes batched
    (`torch.func.vmap` over the tangents), so f's primal runs once, not once per probe: the same products on
    the same rows, each probe's J v as `jvp` gives it alone (tests/test_contrib.py compares every architecture).
    Where vmap cannot batch a block (an op without a batching rule), each probe goes through `jvp` alone."""
    def one(v):
        return torch.func.jvp(f, (x,), (v,))[1]

    try:
        with _forward_ad(model):
            return torch.func.vmap(one)(vs).detach(), "jvp"
    except (NotImplementedError, RuntimeError):
        results = [jvp(model, f, x, v) for v in vs]
        return torch.stack([r[0] for r in results]), results[-1][1]


def deviation_of(Jv: torch.Tensor, v: torch.Tensor, exclude_first: int) -> torch.Tensor:
    """Per sequence ‖(Jv − v)[:, k:]‖²/‖v[:, k:]‖² [B]."""
    diff = (Jv - v)[:, exclude_first:].to(F64).flatten(1)
    return diff.square().sum(1) / v[:, exclude_first:].to(F64).flatten(1).square().sum(1)


def rademacher(x: torch.Tensor, gen: torch.Generator, exclude_first: int) -> torch.Tensor:
    """A ±1 probe shaped like x, zero on the first `exclude_first` positions (drawn from `gen`)."""
    v = (torch.randint(0, 2, x.shape, generator=gen) * 2 - 1).to(x.dtype)
    v[:, :exclude_first] = 0
    return v


def block_deviation(model, position: int, state, gen: torch.Generator, exclude_first: int,
                    probes: int) -> tuple[torch.Tensor, str] | None:
    """Block `position`'s per-sequence deviations ‖J v − v‖²/‖v‖² [probes, B] at the intact `state`, with
    `probes` Rademacher probes drawn from `gen`, and the method ("jvp" / "finite_difference"); None where
    the state is not one `block_map` handles or there is no probe. All of one block's work, so that
    `cost.jvp_seconds` times exactly what `jacobian_deviation` runs per block (the draws and the float64
    reductions are ~5 % of it at the SmolLM-135M shape)."""
    mapped = block_map(model, position, state)
    if mapped is None or probes < 1:  # no probe: no deviation (NaN), as before the probes were batched
        return None
    x, f = mapped
    vs = torch.stack([rademacher(x, gen, exclude_first) for _ in range(probes)])
    Jvs, method = jvps(model, f, x, vs)
    return torch.stack([deviation_of(Jv, v, exclude_first) for Jv, v in zip(Jvs, vs)]), method


def jacobian_deviation(model, inputs, batch_size: int = 8, exclude_first: int = 1, probes: int = 2, seed: int = 0):
    """([δ_l], [method_l], note) for every block on model inputs [N,T]; NaN where the state is not
    a tensor that geometry() only reshapes."""
    L = model.n_layer
    gen = torch.Generator().manual_seed(seed)
    sums, counts, methods = [0.0] * L, [0] * L, ["none"] * L
    for batch in batches(inputs, batch_size):
        states = intact_states(model, batch)  # no_grad; shared with the suite's other probes
        for l in range(L):
            result = block_deviation(model, l, states[l], gen, exclude_first, probes)
            if result is None:
                continue
            deviations, methods[l] = result
            for d in deviations:  # probe by probe, in float64, as the sums were always added
                sums[l] += float(d.sum())
                counts[l] += d.numel()
    dev = [s / c if c else math.nan for s, c in zip(sums, counts)]
    note = "" if all(counts) else (
        f"Jacobian deviation unavailable for {model.config.arch}: the depth state is not a tensor that "
        "geometry() only reshapes")
    return dev, methods, note
