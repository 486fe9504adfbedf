"""The architecture zoo: one `DepthModel`, pluggable residual schemes, and their registry."""

from depthtools.arch.model import Block, DepthModel, Plan
from depthtools.arch.registry import ArchSpec, canonical_name, get_arch, list_archs, register, unregister
from depthtools.arch.scheme import ResidualScheme, State

__all__ = [
    "ArchSpec", "Block", "DepthModel", "Plan", "ResidualScheme", "State",
    "canonical_name", "get_arch", "list_archs", "register", "unregister", "build_model",
]


def build_model(cfg, seed: int | None = 0) -> DepthModel:
    """A freshly initialised model for `cfg` (deterministic for a given seed)."""
    return DepthModel(cfg, seed=seed)
