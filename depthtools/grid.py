"""Iso-parameter grid planner: for each depth, the width whose exact parameter count is closest
to a budget.

Counts are exact: each candidate is instantiated on the `meta` device (no memory, no init cost)
and its parameters summed, so architecture extras (HC routing, KEEL norms, ...) are included.
Shape rules: a fixed head count (head_dim a multiple of k) or a fixed head_dim, and d_ff either
round-up(ratio·d, multiple m) (DepthBench: 8/3, 16) or ratio·d exactly.

    plan_grid("preln", budget=405.4e6, vocab_size=50280, layers=[16, 20, 24, 28, 32],
              n_heads=16, head_dim_multiple=2, ffn_multiple=16)
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable

import torch

from depthtools.config import ModelConfig, round_up
from depthtools.errors import DepthToolsError


MAX_COUNT = 1e13  # parameters: far beyond any model this planner is for, far below float overflow


def parse_count(text: str | float | int) -> int:
    """'405.4M', '1.6m', '200k', '2e6', 1600000 -> integer parameter count."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgG]?)\s*", str(text))
        if not match:
            raise DepthToolsError(f"cannot read parameter count {text!r}; use e.g. 405.4M, 1.6M, 200k or 2e6")
        value = float(match.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9}[match.group(2).lower()]
    if not math.isfinite(value) or value > MAX_COUNT:
        raise DepthToolsError(f"parameter count {text!r} is not a usable size (at most {MAX_COUNT:.0e}); use e.g. 405.4M")
    return int(round(value))


@dataclass(frozen=True)
class ShapeRules:
    """How width determines heads and FFN size."""

    n_heads: int | None = 16  # fixed head count (DepthBench) ...
    head_dim: int | None = None  # ... or fixed head_dim (then n_heads = d / head_dim)
    head_dim_multiple: int = 2
    n_kv_heads: int | None = None  # None: MHA
    ffn_ratio: float = 8 / 3
    ffn_multiple: int | None = 16  # None: d_ff = round(ratio·d)

    def __post_init__(self):
        if (self.n_heads is None) == (self.head_dim is None):
            raise DepthToolsError("give exactly one of n_heads (fixed head count) or head_dim (fixed head size)")
        if self.head_dim is not None and self.head_dim % 2:
            raise DepthToolsError(f"head_dim={self.head_dim} must be even for RoPE")

    def width_candidates(self, max_width: int) -> list[int]:
        """Every d_model allowed by the rules, ascending, up to max_width."""
        if self.n_heads is not None:
            step = self.n_heads * math.lcm(self.head_dim_multiple, 2)
        else:
            step = self.head_dim
        return list(range(step, max_width + 1, step))

    def heads_for(self, d_model: int) -> int:
        return self.n_heads if self.n_heads is not None else d_model // self.head_dim

    def d_ff_for(self, d_model: int) -> int:
        raw = self.ffn_ratio * d_model
        return round_up(raw, self.ffn_multiple) if self.ffn_multiple else max(1, int(round(raw)))


@dataclass(frozen=True)
class Cell:
    """One planned model of the grid."""

    name: str
    arch: str
    n_layer: int
    d_model: int
    n_heads: int
    head_dim: int
    d_ff: int
    params_total: int
    params_non_embedding: int
    params_extra: int
    deviation: float  # (counted - budget) / budget, on the budget's basis
    aspect_ratio: float  # d_model / n_layer
    model: dict[str, Any] = field(default_factory=dict)
    seed: int = 0  # training seed (weights init + batch order); part of the name unless 0

    def model_config(self) -> ModelConfig:
        return ModelConfig.from_dict(self.model)


def cell_name(arch: str, n_layer: int, seed: int = 0) -> str:
    """The readable cell name: `hc_L8` for seed 0, `hc_L8_s1`, `hc_L8_s2`, ... for the other seeds."""
    return f"{arch}_L{n_layer}" if seed == 0 else f"{arch}_L{n_layer}_s{seed}"


def parse_seeds(seeds: Iterable[int] | str | int | None) -> list[int]:
    """Training seeds of a grid ('0,1,2', [0, 1, 2], 3 -> [0, 1, 2]; None -> [0]): distinct, >= 0."""
    if seeds is None:
        return [0]
    if isinstance(seeds, bool):
        raise DepthToolsError(f"seeds must be integers, got {seeds!r}")
    if isinstance(seeds, int):
        if seeds < 1:
            raise DepthToolsError(f"a seed count must be >= 1, got {seeds}")
        return list(range(seeds))
    if isinstance(seeds, str):
        try:
            seeds = [int(v) for v in seeds.replace(" ", "").split(",") if v]
        except ValueError:
            raise DepthToolsError(f"cannot read seeds {seeds!r}; use comma-separated integers like 0,1,2") from None
    out = list(seeds)
    if not out or any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in out):
        raise DepthToolsError(f"seeds must be non-negative integers, got {out!r}")
    if len(set(out)) != len(out):
        raise DepthToolsError(f"seeds must be distinct, got {out!r}")
    return out


def count_params(cfg: ModelConfig) -> dict[str, int]:
    """Exact parameter counts of the model `cfg` describes, built on the meta device."""
    from depthtools.arch import DepthModel

    with torch.device("meta"):
        return DepthModel(cfg).param_counts()


def _config(arch, n_layer, d_model, rules: ShapeRules, base: dict[str, Any]) -> ModelConfig:
    return ModelConfig(
        arch=arch, n_layer=n_layer, d_model=d_model, n_heads=rules.heads_for(d_model),
        n_kv_heads=rules.n_kv_heads, d_ff=rules.d_ff_for(d_model), **base,
    )


def best_width(arch: str, n_layer: int, budget: int, basis: str, rules: ShapeRules, base: dict[str, Any]):
    """(ModelConfig, counts) of the allowed width whose count on `basis` is closest to budget.

    Counts grow monotonically with width, so a binary search over the candidates needs only
    ~log2(#candidates) meta builds.
    """
    widths = rules.width_candidates(max_width=max(64, int(4 * math.sqrt(budget))))
    if not widths:
        raise DepthToolsError("shape rules allow no width; check n_heads/head_dim")
    key = "total" if basis == "total" else "non_embedding"
    cache: dict[int, tuple[ModelConfig, dict[str, int]]] = {}

    def counted(i: int):
        if i not in cache:
            cfg = _config(arch, n_layer, widths[i], rules, base)
            cache[i] = (cfg, count_params(cfg))
        return cache[i]

    lo, hi = 0, len(widths) - 1
    while lo < hi:  # first width whose count >= budget
        mid = (lo + hi) // 2
        if counted(mid)[1][key] < budget:
            lo = mid + 1
        else:
            hi = mid
    options = [counted(i) for i in {max(lo - 1, 0), lo}]
    return min(options, key=lambda item: abs(item[1][key] - budget))


def plan_grid(
    arch: str | Iterable[str],
    budget: int | float | str,
    vocab_size: int = 256,
    layers: Iterable[int] | None = None,
    aspect_ratios: Iterable[float] | None = None,
    basis: str = "total",
    tolerance: float = 0.03,
    n_heads: int | None = 16,
    head_dim: int | None = None,
    head_dim_multiple: int = 2,
    n_kv_heads: int | None = None,
    ffn_ratio: float = 8 / 3,
    ffn_multiple: int | None = 16,
    max_seq_len: int = 256,
    tie_embeddings: bool = False,
    options: dict[str, Any] | None = None,
    seeds: Iterable[int] | str | int | None = None,
) -> list[Cell]:
    """Plan an iso-parameter grid: one cell per (architecture, depth, training seed).

    `seeds` (default [0]) replicates every shape once per training seed, so grid-level comparisons can
    carry their seed noise; cells of seed s > 0 are named `<arch>_L<n>_s<s>` (see `cell_name`).

    `layers` lists depths; alternatively `aspect_ratios` (d_model/n_layer) picks, for each ratio,
    the depth whose best-fitting width gives the closest ratio. Raises a one-line error naming the
    cell when no allowed shape is within `tolerance` of the budget.
    """
    from depthtools.arch import canonical_name, get_arch

    archs = [arch] if isinstance(arch, str) else list(arch)
    archs = [canonical_name(a) for a in archs]
    budget = parse_count(budget)
    if budget <= 0:
        raise DepthToolsError(f"budget must be positive, got {budget}")
    if basis not in ("total", "non_embedding"):
        raise DepthToolsError(f"basis must be 'total' or 'non_embedding', got {basis!r}")
    if (layers is None) == (aspect_ratios is None):
        raise DepthToolsError("give exactly one of layers or aspect_ratios")
    seed_list = parse_seeds(seeds)
    rules = ShapeRules(n_heads, head_dim, head_dim_multiple, n_kv_heads, ffn_ratio, ffn_multiple)
    base = dict(vocab_size=vocab_size, max_seq_len=max_seq_len, tie_embeddings=tie_embeddings, options=options or {})
    cells = []
    for name in archs:
        depths = list(layers) if layers is not None else _depths_for_ratios(name, budget, basis, rules, base, aspect_ratios)
        if not depths or any(int(n) < 1 for n in depths):
            raise DepthToolsError(f"layers must be positive integers, got {depths}")
        for n_layer in depths:
            cell = _plan_cell(name, int(n_layer), budget, basis, tolerance, rules, base, get_arch(name))
            cells += [replace(cell, seed=s, name=cell_name(name, cell.n_layer, s)) for s in seed_list]
    return cells


def _plan_cell(arch, n_layer, budget, basis, tolerance, rules, base, spec) -> Cell:
    cfg, counts = best_width(arch, n_layer, budget, basis, rules, base)
    key = "total" if basis == "total" else "non_embedding"
    deviation = (counts[key] - budget) / budget
    if abs(deviation) > tolerance:
        raise DepthToolsError(
            f"no shape for {arch}_L{n_layer} within ±{tolerance:.1%} of {budget:,} params ({basis}): "
            f"closest is d_model={cfg.d_model} with {counts[key]:,} ({deviation:+.1%}); "
            f"relax --tolerance, change the depths or the head/FFN rules"
        )
    preln = count_params(cfg.replace(arch="preln", options={}))["total"] if arch != "preln" else counts["total"]
    return Cell(
        name=cell_name(arch, n_layer), arch=arch, n_layer=n_layer, d_model=cfg.d_model, n_heads=cfg.n_heads,
        head_dim=cfg.head_dim, d_ff=cfg.d_ff, params_total=counts["total"],
        params_non_embedding=counts["non_embedding"], params_extra=counts["total"] - preln,
        deviation=deviation, aspect_ratio=cfg.d_model / n_layer, model=cfg.to_dict(),
    )


def _depths_for_ratios(arch, budget, basis, rules, base, ratios) -> list[int]:
    """For each target d_model/n_layer, the depth whose best width gives the closest ratio.

    At a fixed budget the best width shrinks as depth grows, so d/L falls monotonically with L:
    binary-search the crossing, then compare its two neighbours.
    """
    ratio_at = {}

    def ratio_of(n_layer: int) -> float:
        if n_layer not in ratio_at:
            ratio_at[n_layer] = best_width(arch, n_layer, budget, basis, rules, base)[0].d_model / n_layer
        return ratio_at[n_layer]

    depths = []
    for ratio in ratios:
        if ratio <= 0:
            raise DepthToolsError(f"aspect ratios must be positive, got {ratio}")
        # N ≈ 12 L d² with d = r L  =>  L ≈ (N / 12 r²)^(1/3); the answer lies well inside [1, 4·guess].
        lo, hi = 1, 4 * max(1, round((budget / (12 * ratio**2)) ** (1 / 3)))
        while lo < hi:  # first depth whose ratio is <= target
            mid = (lo + hi) // 2
            if ratio_of(mid) > ratio:
                lo = mid + 1
            else:
                hi = mid
        candidates = [n for n in (lo - 1, lo) if n >= 1]
        depths.append(min(candidates, key=lambda n: abs(ratio_of(n) - ratio)))
    return depths


# -- grid spec files (consumed by training) ------------------------------------------------------
def grid_spec(cells: list[Cell], name: str = "grid", train: dict[str, Any] | None = None,
              data: dict[str, Any] | None = None, plan: dict[str, Any] | None = None) -> dict[str, Any]:
    """A JSON-able grid spec: the planned cells plus the shared recipe and data settings."""
    return {"name": name, "plan": plan or {}, "train": train, "data": data, "cells": [asdict(c) for c in cells]}


def save_grid(spec: dict[str, Any], path: str | Path) -> Path:
    from depthtools.checkpoint import atomic_write_json
    from depthtools.fsutil import check_file_target

    check_file_target(path, "grid spec file (--out)")
    atomic_write_json(Path(path), spec)
    return Path(path)


def load_grid(path: str | Path) -> dict[str, Any]:
    """Read a grid spec; cells come back as `Cell` objects under 'cells'."""
    path = Path(path)
    if not path.is_file():
        raise DepthToolsError(f"grid spec {path} not found; create one with `depthtools grid plan --out {path}`")
    from depthtools.fsutil import json_section, read_json_object

    spec = read_json_object(path, "a grid spec", hint=" (the grid spec is not valid; write one with `depthtools grid plan --out`)")
    cells = json_section(spec, "cells", path, list)
    try:
        spec["cells"] = [Cell(**cell) for cell in cells]
    except TypeError as exc:  # a cell that is not an object, or with unknown or missing fields
        raise DepthToolsError(f"grid spec {path} is not valid: {exc}") from None
    return spec
