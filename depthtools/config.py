"""Typed, validated run configuration: one source of truth that round-trips to JSON.

`ModelConfig` fixes the network (backbone shape + architecture name + architecture options).
`TrainConfig` (in `depthtools.train`) fixes the recipe. Both are frozen dataclasses so a config
cannot drift after a model was built from it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from depthtools.errors import DepthToolsError


def round_up(x: float, multiple: int) -> int:
    """Smallest multiple of `multiple` that is >= x."""
    return int(math.ceil(x / multiple - 1e-9)) * multiple


def default_d_ff(d_model: int, multiple: int = 16, ratio: float = 8 / 3) -> int:
    """SwiGLU hidden size: ratio·d rounded up to a multiple (DepthBench: 8/3·d, multiple 16)."""
    return round_up(ratio * d_model, multiple)


@dataclass(frozen=True)
class ModelConfig:
    """Shape and architecture of one decoder-only LM.

    `arch` is a registry name (see `depthtools.arch.list_archs()`); `options` holds
    architecture-specific settings (e.g. ``{"n_streams": 4}`` for HC), validated by the
    architecture itself when the model is built.
    """

    arch: str = "preln"
    vocab_size: int = 256
    d_model: int = 64
    n_layer: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None  # None: = n_heads (MHA); fewer: GQA
    d_ff: int | None = None  # None: 8/3·d rounded up to a multiple of 16
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.d_ff is None:
            object.__setattr__(self, "d_ff", default_d_ff(self.d_model))
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        object.__setattr__(self, "options", dict(self.options))
        self.validate()

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def validate(self) -> None:
        """Refuse impossible shapes with a one-line reason."""
        for name in ("vocab_size", "d_model", "n_layer", "n_heads", "max_seq_len", "d_ff"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise DepthToolsError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_heads:
            raise DepthToolsError(
                f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}"
            )
        if self.head_dim % 2:
            raise DepthToolsError(
                f"head_dim=d_model/n_heads={self.head_dim} must be even for RoPE"
            )
        if self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads:
            raise DepthToolsError(
                f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}"
            )
        if self.norm_eps <= 0 or self.init_std <= 0:
            raise DepthToolsError("norm_eps and init_std must be positive")

    def replace(self, **changes: Any) -> "ModelConfig":
        """A copy with some fields changed (re-validated)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise DepthToolsError(f"unknown ModelConfig field(s) {unknown}; valid: {sorted(known)}")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "ModelConfig":
        return cls.from_dict(json.loads(text))
