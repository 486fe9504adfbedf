"""Architecture registry: name -> scheme factory, one-line description, family, extra parameters.

`extra_params(cfg)` is the closed-form count of parameters this architecture adds to (or removes
from) a Pre-LN model of the same shape; tests check it against the built model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from depthtools.config import ModelConfig
from depthtools.errors import DepthToolsError


@dataclass(frozen=True)
class ArchSpec:
    name: str
    family: str  # "baseline" | "normalisation" | "multi-stream" | "cross-layer"
    description: str
    extra_formula: str  # human-readable, in d (d_model), L (n_layer), n (streams)
    extra_params: Callable[[ModelConfig], int]
    paper: str
    scheme: Callable[[ModelConfig], object]
    in_depthbench: bool = False
    aliases: tuple[str, ...] = ()

    def build_scheme(self, cfg: ModelConfig):
        return self.scheme(cfg)


_REGISTRY: dict[str, ArchSpec] = {}
_ALIASES: dict[str, str] = {}


def register(spec: ArchSpec) -> ArchSpec:
    """Add an architecture (and its aliases) to the registry."""
    _REGISTRY[spec.name] = spec
    for alias in spec.aliases:
        _ALIASES[alias] = spec.name
    return spec


def canonical_name(name: str) -> str:
    """Registry name for `name` or an alias; a clear error listing valid names otherwise."""
    name = _ALIASES.get(name, name)
    if name not in _REGISTRY:
        valid = sorted(_REGISTRY) + sorted(f"{a} (= {t})" for a, t in _ALIASES.items())
        raise DepthToolsError(f"unknown architecture {name!r}; valid: {', '.join(valid)}")
    return name


def get_arch(name: str) -> ArchSpec:
    return _REGISTRY[canonical_name(name)]


def list_archs() -> list[ArchSpec]:
    return list(_REGISTRY.values())


def _register_norm_family() -> None:
    from depthtools.arch.norm_family import NormFamilyScheme

    zero = lambda c: 0  # noqa: E731
    rows = [
        ("preln", "baseline", "Pre-LN: h + f(Norm h)", "0", zero,
         "Xiong et al. 2020, arXiv 2002.04745", True, ()),
        ("postln", "normalisation", "Post-LN: Norm(h + f(h))", "0", zero,
         "Vaswani et al. 2017, arXiv 1706.03762", False, ()),
        ("periln", "normalisation", "Peri-LN / Sandwich: h + NormOut(f(NormIn h))", "2·d·L",
         lambda c: 2 * c.d_model * c.n_layer, "Kim et al. 2025, arXiv 2502.02732", True, ("sandwich",)),
        ("lns", "normalisation", "LayerNorm Scaling: h + f(Norm(h)/sqrt(b+1))", "0", zero,
         "Sun et al. 2025, arXiv 2502.05795", True, ()),
        ("deepnorm", "normalisation", "DeepNorm: Norm(a·h + f(h)), a=(2L)^1/4, init beta=(8L)^-1/4", "0", zero,
         "Wang et al. 2022, arXiv 2203.00555", True, ()),
        ("keel", "normalisation", "KEEL: Norm(2L·h + f(Norm h)), block 0 special", "(2L-1)·d",
         lambda c: (2 * c.n_layer - 1) * c.d_model, "Chen & Wei 2026, arXiv 2601.19895", True, ()),
        ("mixln", "normalisation", "Mix-LN: first floor(L/4) blocks Post-LN, rest Pre-LN", "0", zero,
         "Li et al. 2024, arXiv 2412.13795", False, ()),
        ("rezero", "normalisation", "ReZero: h + a·f(h), a=0 init, no block norms", "2·L − 2·d·L",
         lambda c: 2 * c.n_layer - 2 * c.d_model * c.n_layer, "Bachlechner et al. 2020, arXiv 2003.04887",
         False, ()),
        ("layerscale", "normalisation", "LayerScale: h + diag(λ)·f(Norm h), λ=ε init", "2·d·L",
         lambda c: 2 * c.d_model * c.n_layer, "Touvron et al. 2021 (CaiT), arXiv 2103.17239", False, ()),
        ("depthmup", "normalisation", "depth-μP: h + (L/24)^-½·f(Norm h)", "0", zero,
         "Yang et al. 2023, arXiv 2310.02244", False, ()),
        ("completep", "normalisation", "CompleteP: h + (L/24)^-1·f(Norm h)", "0", zero,
         "Dey et al. 2025, arXiv 2505.01618", False, ()),
    ]
    for name, family, desc, formula, extra, paper, in_db, aliases in rows:
        register(ArchSpec(name, family, desc, formula, extra, paper, NormFamilyScheme, in_db, aliases))


def _register_residual_family() -> None:
    """Register the residual-connection schemes: each module lists its specs in `ARCH_SPECS`."""
    import importlib
    import importlib.util

    for module in ("hyper", "attnres", "denseformer", "moda"):
        if importlib.util.find_spec(f"depthtools.arch.{module}") is not None:
            for spec in importlib.import_module(f"depthtools.arch.{module}").ARCH_SPECS:
                register(spec)


_register_norm_family()
_register_residual_family()
