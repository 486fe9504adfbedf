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

import functools
import inspect
import math
import numbers
import re
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Iterable

from depthtools.config import ModelConfig, TrainConfig, check_json_fields, check_json_value, round_up
from depthtools.data import prepare, prepare_inputs
from depthtools.errors import DepthToolsError
from depthtools.fsutil import atomic_write_json, check_file_target, check_name, read_json_object

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

    def width_step(self) -> int:
        """The narrowest allowed d_model; every allowed width is a multiple of it."""
        if self.n_heads is not None:
            return self.n_heads * math.lcm(self.head_dim_multiple, 2)
        return self.head_dim

    def width_candidates(self, max_width: int) -> list[int]:
        """Every d_model allowed by the rules, ascending, up to max_width."""
        step = self.width_step()
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
        """The cell's ModelConfig, checked against the architecture registry (one-line refusals)."""
        from depthtools.arch.registry import validate_model_config  # lazy: arch/ imports torch

        return validate_model_config(ModelConfig.from_dict(self.model))


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
    """Exact parameter counts of the model `cfg` describes, built on the meta device (once per config
    and process: planning and then checking a grid spec count the same shapes)."""
    return dict(_counts_of(cfg.to_json()))


@functools.lru_cache(maxsize=4096)
def _counts_of(config_json: str) -> dict[str, int]:
    import torch  # lazy: reading, writing and checking grid specs' JSON needs no torch until a count is asked

    from depthtools.arch import DepthModel  # lazy: arch/ imports torch

    with torch.device("meta"):
        return DepthModel(ModelConfig.from_json(config_json)).param_counts()


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
    archs = [arch] if isinstance(arch, str) else list(arch)
    if not archs:
        raise DepthToolsError("no architecture given; name at least one (see `depthtools archs`)")
    from depthtools.arch.registry import canonical_name, get_arch  # lazy: arch/ imports torch

    archs = [canonical_name(a) for a in archs]
    if len(set(archs)) != len(archs):
        raise DepthToolsError(f"architectures {archs} name one twice; every cell needs its own name")
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
        if not depths or any(isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1 for n in depths):
            raise DepthToolsError(f"layers must be positive integers, got {depths}")
        if len(set(depths)) != len(depths):
            how = "" if layers is not None else f" (aspect ratios {list(aspect_ratios)} chose them)"
            raise DepthToolsError(f"depths {depths}{how} name one depth twice; every cell needs its own name")
        for n_layer in depths:
            cell = _plan_cell(name, int(n_layer), budget, basis, tolerance, rules, base, get_arch(name))
            cells += [replace(cell, seed=s, name=cell_name(name, cell.n_layer, s)) for s in seed_list]
    return cells


def _fewest_params(arch, n_layer, basis, rules, base) -> int:
    """A lower bound on the count (on `basis`) of any allowed shape with n_layer blocks, from two tiny
    meta builds: the narrowest width's count at 1 and 2 blocks, extended linearly (per-block extras
    never shrink with depth, and counts grow with width). Lets the planner refuse a depth no width
    can fit (e.g. --layers 100000000) without building that model, which would take hours."""
    key = "total" if basis == "total" else "non_embedding"
    width = rules.width_step()
    one, two = (count_params(_config(arch, n, width, rules, base))[key] for n in (1, 2))
    return one + (n_layer - 1) * max(two - one, 0)


def _plan_cell(arch, n_layer, budget, basis, tolerance, rules, base, spec) -> Cell:
    key = "total" if basis == "total" else "non_embedding"
    if n_layer > 64:
        fewest = _fewest_params(arch, n_layer, basis, rules, base)
        if fewest > budget * (1 + tolerance):
            raise DepthToolsError(
                f"no shape for {arch}_L{n_layer} within ±{tolerance:.1%} of {budget:,} params ({basis}): even the "
                f"narrowest allowed width has at least {fewest:,}; use fewer layers or a larger --budget")
    cfg, counts = best_width(arch, n_layer, budget, basis, rules, base)
    deviation = (counts[key] - budget) / budget
    if abs(deviation) > tolerance:
        raise DepthToolsError(
            f"no shape for {arch}_L{n_layer} within ±{tolerance:.1%} of {budget:,} params ({basis}): "
            f"closest is d_model={cfg.d_model} with {counts[key]:,} ({deviation:+.1%}); "
            f"relax --tolerance, change the depths or the head/FFN rules"
        )
    from depthtools.arch.registry import baseline_config  # lazy: arch/ imports torch

    baseline = baseline_config(cfg)  # Pre-LN of this shape (the cell itself for a Pre-LN cell)
    preln = counts["total"] if baseline is cfg else count_params(baseline)["total"]
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
        if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real) or not (math.isfinite(ratio) and ratio > 0):
            raise DepthToolsError(f"aspect ratios must be positive finite numbers, got {ratio!r}")
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
    """A JSON-able grid spec: the planned cells plus the shared recipe and data settings.

    `name` becomes the grid's folder under the checkpoint root, so it must pass `check_name`."""
    check_name(name, "grid name (--name)")
    return {"name": name, "plan": plan or {}, "train": train, "data": data, "cells": [asdict(c) for c in cells]}


def save_grid(spec: dict[str, Any], path: str | Path) -> Path:
    check_file_target(path, "grid spec file (--out)")
    atomic_write_json(Path(path), spec)
    return Path(path)


def load_grid(path: str | Path) -> dict[str, Any]:
    """Read and check a grid spec (`check_spec`); cells come back as `Cell` objects under 'cells'."""
    path = Path(path)
    if not path.is_file():
        raise DepthToolsError(f"grid spec {path} not found; create one with `depthtools grid plan --out {path}`")

    spec = read_json_object(path, "a grid spec", hint=" (the grid spec is not valid; write one with `depthtools grid plan --out`)")
    return check_spec(spec, f"grid spec {path}")


# The grid spec's schema, checked in one place (`check_spec`) wherever a spec comes from (a file, a
# preset, a dict in a notebook) before anything is created: the top-level keys and their JSON types,
# and every cell (`check_cell`).
SPEC_KEYS = {"name": (str,), "plan": (dict,), "train": (dict, type(None)), "data": (dict, type(None)), "cells": (list,)}
REQUIRED_SPEC_KEYS = ("cells",)
# A cell's model must state its shape: a missing field would silently be ModelConfig's default.
REQUIRED_MODEL_FIELDS = ("arch", "vocab_size", "d_model", "n_layer", "n_heads", "d_ff", "max_seq_len")
# Entries of a grid folder that are not cells (summaries, the recorded spec): no cell may take them.
RESERVED_CELL_NAMES = ("analysis", "grid.json")
_STATED_NAME = re.compile(r"(?P<arch>.+?)_L(?P<n_layer>[0-9]+)(?:_s(?P<seed>[0-9]+))?")


def check_spec(spec: Any, where: str = "grid spec") -> dict[str, Any]:
    """The grid spec `spec` with its cells as checked `Cell`s, or a one-line DepthToolsError naming the
    problem: not an object; an unknown key (named as a key); a missing 'cells'; a key of the wrong JSON
    type ("data": 5); an invalid grid name (`check_name`); a "data" section `check_data_section`
    refuses; a "train" recipe TrainConfig refuses; no cells; a cell that `check_cell` refuses;
    two cells with one name (also when they differ only in case: one folder on macOS/Windows).
    A missing name is "grid", as it always was."""
    if not isinstance(spec, dict):
        raise DepthToolsError(f"{where} must be a JSON object, not {type(spec).__name__}")
    unknown = sorted(str(k) for k in spec if k not in SPEC_KEYS)
    if unknown:
        raise DepthToolsError(f"{where}: unknown key(s) {unknown}; valid: {list(SPEC_KEYS)}")
    for key in REQUIRED_SPEC_KEYS:
        if key not in spec:
            raise DepthToolsError(f"{where} has no {key!r} list; write one with `depthtools grid plan --out`")
    for key, kinds in SPEC_KEYS.items():
        if key in spec and not isinstance(spec[key], kinds):
            valid = " or ".join({dict: "a JSON object", list: "a JSON list", str: "a string",
                                 type(None): "null"}[k] for k in kinds)
            raise DepthToolsError(f"{where}: {key!r} must be {valid}, not {type(spec[key]).__name__} {spec[key]!r}"[:300])
    name = check_name(spec.get("name", "grid"), f"{where}: grid name")
    check_data_section(spec.get("data"), f"{where}: 'data'")
    if spec.get("train") is not None:
        try:
            TrainConfig.from_dict(spec["train"])  # the recipe's keys, types and values (cells add their seed)
        except DepthToolsError as exc:
            raise DepthToolsError(f"{where}: 'train': {exc}") from None
    if not spec["cells"]:
        raise DepthToolsError(f"{where} has no cells; plan some with `depthtools grid plan`")
    cells = [check_cell(cell, f"{where}: cells[{i}]") for i, cell in enumerate(spec["cells"])]
    seen: dict[str, int] = {}
    for i, cell in enumerate(cells):
        first = seen.setdefault(cell.name.lower(), i)
        if first != i:
            other = cells[first].name
            case = "" if other == cell.name else f" ({other!r} and {cell.name!r} differ only in case)"
            raise DepthToolsError(f"{where}: cell name {cell.name!r} appears twice (cells[{first}] and cells[{i}]){case}; "
                                  "every cell needs its own name")
    return {**spec, "name": name, "cells": cells}


DATA_NOTES = ("needs", "prepare")  # descriptive fields of a grid's data spec (what to prepare, and how)
_NOT_DATA_KEYS = ("out_dir", "log", "inputs")  # prepare()'s arguments that a spec does not set (--data-root, ...)


def check_data_section(data: Any, where: str = "grid spec: 'data'") -> None:
    """A grid spec's "data" in one line: null, or an object of one of three forms — {"dir": FOLDER}
    (a prepared folder, plus the notes "needs"/"prepare"), {"input": FILES, ...} (the arguments of
    `depthtools.data.prepare_inputs`) or {"corpus": ..., ...} (those of `depthtools.data.prepare`) —
    whose keys are that form's arguments and whose values have their annotated JSON types; a dataset
    "name" must pass `check_name`."""
    if data is None:
        return
    if not isinstance(data, dict):
        raise DepthToolsError(f"{where} must be a JSON object or null, not {type(data).__name__} {data!r}"[:300])
    if "dir" in data:
        params, form = {"dir": "str"}, "with 'dir'"
    else:
        function, form = (prepare_inputs, "with 'input'") if "input" in data else (prepare, "for a corpus")
        params = {k: p.annotation for k, p in inspect.signature(function).parameters.items() if k not in _NOT_DATA_KEYS}
        if "input" in data:
            params["input"] = "str | list[str]"
    params.update({note: "str" for note in DATA_NOTES})
    unknown = sorted(str(k) for k in data if k not in params)
    if unknown:
        raise DepthToolsError(f"{where}: unknown key(s) {unknown} {form}; valid: {sorted(params)}")
    for key, value in data.items():
        check_json_value(value, params[key], f"{where}: {key!r}")
    if data.get("name") is not None:
        check_name(data["name"], f"{where}: 'name' (the dataset folder)")


def check_cell(cell: Any, where: str = "cell") -> Cell:
    """A `Cell` from a spec entry (a dict or a Cell) whose name and fields agree with its model.

    Refused in one line: unknown or missing fields, values of the wrong JSON type, a name that is not
    one path component (`check_name`) or is a reserved grid-folder entry, a model that misses a shape
    field (REQUIRED_MODEL_FIELDS) or is not a valid ModelConfig, a cell field (arch, n_layer, d_model,
    n_heads, head_dim, d_ff, parameter counts) that differs from its model, and a name of the form
    ARCH_L<n>[_s<seed>] that states another depth or seed — or, when ARCH is an architecture name,
    another architecture — than the cell trains. The name is never trusted: other names are labels.
    """
    data = asdict(cell) if isinstance(cell, Cell) else cell
    data = check_json_fields(data, Cell, where)
    missing = [f.name for f in fields(Cell) if f.name not in data and f.name != "seed"]  # seed: 0 before seeds existed
    if missing:
        raise DepthToolsError(f"{where}: missing field(s) {missing}; re-plan it with `depthtools grid plan`")
    name = check_name(data["name"], f"{where}: cell name")
    where = f"{where} ({name})"
    if name in RESERVED_CELL_NAMES:
        raise DepthToolsError(f"{where}: the cell name {name!r} is reserved in a grid folder; "
                              f"no cell may be named {' or '.join(RESERVED_CELL_NAMES)}")
    if data.get("seed", 0) < 0:
        raise DepthToolsError(f"{where}: seed must be >= 0, got {data['seed']}")
    model = data["model"]
    lacking = [k for k in REQUIRED_MODEL_FIELDS if k not in model]
    if lacking:
        raise DepthToolsError(f"{where}: model lacks {lacking} (it would train the default shape); "
                              "re-plan it with `depthtools grid plan`")
    from depthtools.arch.registry import validate_model_config  # lazy: arch/ imports torch

    try:
        cfg = validate_model_config(ModelConfig.from_dict(model))
    except DepthToolsError as exc:
        raise DepthToolsError(f"{where}: model: {exc}") from None
    made = Cell(**data)
    _check_cell_against_model(made, cfg, where)
    return made


def _check_cell_against_model(cell: Cell, cfg: ModelConfig, where: str) -> None:
    """The cell's restated shape, parameter counts and name against the model it trains."""
    from depthtools.arch.registry import canonical_name  # lazy: arch/ imports torch

    try:
        arch = canonical_name(cell.arch)
    except DepthToolsError as exc:
        raise DepthToolsError(f"{where}: {exc}") from None
    stated = {"arch": arch, "n_layer": cell.n_layer, "d_model": cell.d_model, "n_heads": cell.n_heads,
              "head_dim": cell.head_dim, "d_ff": cell.d_ff}
    for key, value in stated.items():
        if getattr(cfg, key) != value:
            raise DepthToolsError(f"{where}: the cell says {key}={value!r} but its model has {key}={getattr(cfg, key)!r}; "
                                  "re-plan it with `depthtools grid plan`")
    counts = count_params(cfg)
    for key, count in (("params_total", counts["total"]), ("params_non_embedding", counts["non_embedding"])):
        if getattr(cell, key) != count:
            raise DepthToolsError(f"{where}: the cell says {key}={getattr(cell, key):,} but its model has {count:,} "
                                  "(token budgets are computed from it); re-plan it with `depthtools grid plan`")
    match = _STATED_NAME.fullmatch(cell.name)
    if match is None:
        return
    said = {"n_layer": int(match["n_layer"]), "seed": int(match["seed"] or 0)}
    try:
        said["arch"] = canonical_name(match["arch"])
    except DepthToolsError:
        pass  # not an architecture name: a label such as hc4_L8
    actual = {"arch": cfg.arch, "n_layer": cfg.n_layer, "seed": cell.seed}
    wrong = [k for k in said if said[k] != actual[k]]
    if wrong:
        right = cell_name(cfg.arch, cfg.n_layer, cell.seed)
        raise DepthToolsError(f"{where}: the name states {', '.join(f'{k}={said[k]}' for k in wrong)} but the cell "
                              f"trains {', '.join(f'{k}={actual[k]}' for k in wrong)}; name it {right!r}")
