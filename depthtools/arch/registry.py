"""Architecture registry: name -> scheme factory, one-line description, family, extra parameters.

`extra_params(cfg)` is the closed-form count of parameters this architecture adds to (or removes
from) a Pre-LN model of the same shape; tests check it against the built model. Adding an
architecture: a scheme file (a `ResidualScheme` subclass and its `ARCH_SPECS`) and its name in
`ARCH_MODULES`.
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

    def option_schema(self) -> dict:
        """{name: depthtools.arch.scheme.Option} of the options this architecture accepts."""
        return self.scheme.option_schema(self.name)


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


def check_options(cfg: ModelConfig) -> dict:
    """cfg.options validated against its architecture's schema, defaults filled in (one-line errors)."""
    from depthtools.arch.backbone import BACKBONE_ARCHS, check_backbone
    from depthtools.arch.scheme import resolve_options

    resolved = resolve_options(get_arch(cfg.arch).option_schema(), cfg)
    if cfg.arch in BACKBONE_ARCHS:
        check_backbone(cfg)  # checks across options (layer_types' length, rotary width, ...)
    return resolved


# The registration lines: each module defines its architectures' `ARCH_SPECS`; everything else an
# architecture needs (options, extra FLOPs, routing, the probe's written tensor) is on its scheme.
ARCH_MODULES = ("norm_family", "hyper", "attnres", "denseformer", "moda")


def _register_modules() -> None:
    import importlib

    for module in ARCH_MODULES:
        for spec in importlib.import_module(f"depthtools.arch.{module}").ARCH_SPECS:
            register(spec)


_register_modules()
