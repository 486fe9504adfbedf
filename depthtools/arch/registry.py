"""Architecture registry: name -> scheme factory, one-line description, family, extra parameters.

`extra_params(cfg)` is the closed-form count of parameters this architecture adds to (or removes
from) a Pre-LN model of the same shape; tests check it against the built model.

Adding an architecture is one scheme file (a `ResidualScheme` subclass) and one call,
`depthtools.arch.register(ArchSpec(...))`: the CLI (`depthtools archs`), the grid planner, the trainer,
the probes, the tests that enumerate architectures (they read `list_archs()`) and the generated docs
table (`depthtools.arch.doc_table`) all read this registry. `unregister(name)` removes one again (a test's
temporary architecture). The built-in architectures' scheme files list theirs in `ARCH_SPECS` and are
registered below (the scheme files import `scheme`, never this module, so the registry sits above them).
"""

from __future__ import annotations

from typing import Any

from depthtools.arch import attnres, denseformer, hyper, moda, norm_family
from depthtools.arch.backbone import check_backbone, check_heads
from depthtools.arch.scheme import ArchSpec, resolve_options
from depthtools.config import ModelConfig, install_arch_rules
from depthtools.errors import DepthToolsError

_REGISTRY: dict[str, ArchSpec] = {}
_ALIASES: dict[str, str] = {}


def register(spec: ArchSpec) -> ArchSpec:
    """Add an architecture (and its aliases) to the registry; a name or alias already taken is a one-line
    DepthToolsError (unregister the old one first). Returns `spec`."""
    if not isinstance(spec, ArchSpec):
        raise DepthToolsError(f"register takes a depthtools.arch.ArchSpec, got {type(spec).__name__}")
    taken = set(_REGISTRY) | set(_ALIASES)
    for name in (spec.name, *spec.aliases):
        if name in taken:
            raise DepthToolsError(f"architecture name {name!r} is already registered; unregister({name!r}) first")
    _REGISTRY[spec.name] = spec
    for alias in spec.aliases:
        _ALIASES[alias] = spec.name
    return spec


def unregister(name: str) -> ArchSpec:
    """Remove a registered architecture (by name or alias) and its aliases; returns its spec."""
    spec = _REGISTRY.pop(canonical_name(name))
    for alias in spec.aliases:
        _ALIASES.pop(alias, None)
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
    spec = get_arch(cfg.arch)
    resolved = resolve_options(spec.option_schema(), cfg)
    if spec.backbone_options:
        check_backbone(cfg)  # checks across options (layer_types' length, rotary width, ...)
    return resolved


def check_model_config(cfg: ModelConfig) -> None:
    """The checks of a ModelConfig that need architecture knowledge (one line each): the head shape, then the
    options against the architecture's schema. `ModelConfig.validate` runs it once this module is loaded."""
    check_heads(cfg)
    check_options(cfg)


def validate_model_config(cfg: ModelConfig) -> ModelConfig:
    """`cfg` with its architecture's registry name, validated against the registry (one-line DepthToolsError):
    for a config built before the registry was loaded (then ModelConfig checks its shape only). Callers that
    build a model or accept a config from the user call it; a config built later is already checked."""
    if isinstance(cfg.arch, str) and canonical_name(cfg.arch) != cfg.arch:  # an alias (an unknown name: refused)
        return cfg.replace(arch=canonical_name(cfg.arch))  # a new config: every check runs as it is built
    cfg.validate()
    return cfg


def baseline_config(cfg: ModelConfig) -> ModelConfig:
    """The model `cfg`'s extra parameters are counted against: the reference architecture (`ArchSpec.reference`,
    Pre-LN) in cfg's shape without options; `cfg` itself when it is of the reference architecture."""
    if get_arch(cfg.arch).reference:
        return cfg
    reference = next(spec for spec in _REGISTRY.values() if spec.reference)
    return cfg.replace(arch=reference.name, options={})


def upgrade_options(model: Any) -> Any:
    """A saved config's "model" section with the options it predates filled in with their old defaults (its
    architecture's `ArchSpec.legacy_defaults`; depthtools.checkpoint applies it before building the config).
    Anything that is not a model section of a registered architecture is returned as it is."""
    if not isinstance(model, dict):
        return model
    arch = model.get("arch")
    spec = _REGISTRY.get(_ALIASES.get(arch, arch))
    return spec.upgrade_options(model) if spec is not None else model


def profile_options(profile: str, arch: str, given: dict[str, Any]) -> dict[str, Any]:
    """The options of a model of `arch` under recipe `profile` (`ArchSpec.profiles`), `given` winning."""
    return get_arch(arch).profile_options(profile, given)


# The registration lines: each module defines its architectures' `ARCH_SPECS`; everything else an
# architecture needs (options, extra FLOPs, routing, the probe's written tensor) is on its scheme.
ARCH_MODULES = (norm_family, hyper, attnres, denseformer, moda)
for _module in ARCH_MODULES:
    for _spec in _module.ARCH_SPECS:
        register(_spec)
del _module, _spec

# From now on every ModelConfig built is checked against the registry as it is made (depthtools.config imports
# nothing from arch/: the registry installs its checks there).
install_arch_rules(canonical_name, check_model_config)
