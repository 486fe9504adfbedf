"""Scaled rotary position embeddings: the inverse frequencies and cos/sin tables of each RoPE type.

The Pre-LN options `rope_type`, `rope_factor`, `rope_original_context`, ... (`depthtools.arch.backbone`)
select how the rotation frequencies of plain RoPE (θ^(-2i/r), r rotated features) are rescaled for long
contexts. Each type is written from its published definition, as transformers 5.x implements it
(`modeling_rope_utils.py`, read as the spec; no code taken):

    default   f_i = θ^(-2i/r)
    linear    f_i / factor                                   (position interpolation)
    dynamic   θ' = θ·(factor·s/L − (factor − 1))^(r/(r−2)) with s = max(T, L): NTK-aware, grows with
              the sequence length T beyond the context L (`rope_original_context`: the config's
              max_position_embeddings); T ≤ L is plain RoPE
    yarn      per frequency, a ramp between interpolation (f_i/factor) and extrapolation (f_i) over the
              dimensions whose wavelengths fall between beta_fast and beta_slow rotations in L; cos and
              sin scaled by the attention factor (default 0.1·ln(factor) + 1)
    longrope  f_i / e_i, e = long_factor when T > L, else short_factor (Phi-3/3.5); cos and sin scaled
              by the attention factor (default √(1 + ln(factor)/ln L))
    llama3    f_i kept for wavelengths < L/high_freq_factor, f_i/factor above L/low_freq_factor, a
              smooth blend between (Llama 3.1+)

`dynamic` and `longrope` depend on the whole sequence's length T (transformers recomputes its
frequencies from max(position_ids) + 1 in each forward), so their tables are made per length
(`RopeScaling.length_dependent`). transformers' dynamic type also keeps the frequencies of the longest
sequence seen until a sequence shorter than L comes; depthtools computes each forward from its own
length, which is what a fresh transformers model gives for that sequence.
"""

from __future__ import annotations

import math

import torch

from depthtools.arch.scheme import Option, schema_record

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
LENGTH_DEPENDENT = ("dynamic", "longrope")
NEEDS_CONTEXT = ("dynamic", "yarn", "longrope", "llama3")  # types that read rope_original_context


# The scaled-RoPE options of the Pre-LN block (`depthtools.arch.backbone.OPTIONS` splices them in): their one
# definition. `RopeScaling` below is generated from these records (rope_type -> kind, rope_X -> X).
ROPE_OPTIONS: dict[str, Option] = {
    "rope_type": Option("str", "default", choices=ROPE_TYPES, doc="RoPE scaling type (default: plain RoPE)"),
    "rope_factor": Option("number", 1.0, low=0, low_open=True, doc="RoPE scaling factor"),
    "rope_original_context": Option("int", 0, low=0, doc="pretraining context of scaled RoPE (dynamic: max positions)"),
    "rope_low_freq_factor": Option("number", 1.0, low=0, low_open=True, doc="llama3 RoPE: low-frequency factor"),
    "rope_high_freq_factor": Option("number", 4.0, low=0, low_open=True, doc="llama3 RoPE: high-frequency factor"),
    "rope_beta_fast": Option("number", 32.0, low=0, low_open=True, doc="yarn RoPE: extrapolation boundary"),
    "rope_beta_slow": Option("number", 1.0, low=0, low_open=True, doc="yarn RoPE: interpolation boundary"),
    "rope_truncate": Option("bool", True, doc="yarn RoPE: round the correction range to whole dimensions"),
    "rope_attention_factor": Option("number", 0.0, low=0, doc="yarn/longrope cos/sin factor (0: the type's default)"),
    "rope_short_factor": Option("numbers", (), low=0, low_open=True, doc="longrope: per-pair factors, T <= context"),
    "rope_long_factor": Option("numbers", (), low=0, low_open=True, doc="longrope: per-pair factors, T > context"),
}


def rope_field(option: str) -> str:
    """RopeScaling's field for a rope_* option: rope_type -> kind, rope_factor -> factor, ..."""
    return "kind" if option == "rope_type" else option.removeprefix("rope_")


class _RopeTables:
    """RopeScaling's methods (its fields are generated from ROPE_OPTIONS below)."""

    @property
    def scaled(self) -> bool:
        return self.kind != "default"

    @property
    def length_dependent(self) -> bool:
        """Whether the tables depend on the sequence's length (dynamic, longrope)."""
        return self.kind in LENGTH_DEPENDENT

    def attention_scale(self) -> float:
        """The factor on cos and sin (yarn, longrope; 1 for the others)."""
        if self.kind not in ("yarn", "longrope"):
            return 1.0
        if self.attention_factor:
            return float(self.attention_factor)
        if self.factor <= 1:
            return 1.0
        if self.kind == "yarn":
            return 0.1 * math.log(self.factor) + 1.0
        return math.sqrt(1 + math.log(self.factor) / math.log(self.original_context))

    def inv_freq(self, dim: int, theta: float, seq_len: int | None = None) -> torch.Tensor:
        """[dim/2] float64 inverse frequencies for `dim` rotated features; `seq_len`: the sequence's length
        (dynamic, longrope; None: at most the original context)."""
        exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim
        kind = self.kind
        if kind == "dynamic":
            L = self.original_context
            s = max(seq_len or L, L)
            theta = theta * ((self.factor * s / L) - (self.factor - 1)) ** (dim / (dim - 2))
        plain = 1.0 / theta ** exponents
        if kind in ("default", "dynamic"):
            return plain
        if kind == "linear":
            return plain / self.factor
        if kind == "longrope":
            long = seq_len is not None and seq_len > self.original_context
            ext = torch.tensor(self.long_factor if long else self.short_factor, dtype=torch.float64)
            return 1.0 / (ext * theta ** exponents)
        if kind == "llama3":
            return self._llama3(plain)
        if kind == "yarn":
            return self._yarn(plain, dim, theta)
        raise ValueError(f"unknown RoPE type {kind!r}")

    def _llama3(self, f: torch.Tensor) -> torch.Tensor:
        """Llama 3.1's frequency-dependent scaling: long wavelengths divided by factor, short ones kept,
        a linear blend in 1/wavelength between."""
        L, lo, hi = self.original_context, self.low_freq_factor, self.high_freq_factor
        wavelen = 2 * math.pi / f
        scaled = torch.where(wavelen > L / lo, f / self.factor, f)
        smooth = (L / wavelen - lo) / (hi - lo)
        blended = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = (wavelen >= L / hi) & (wavelen <= L / lo)
        return torch.where(medium, blended, scaled)

    def _yarn(self, f: torch.Tensor, dim: int, theta: float) -> torch.Tensor:
        """YaRN: extrapolate the dimensions that rotate more than beta_fast times over the original context,
        interpolate (f/factor) those that rotate fewer than beta_slow times, ramp linearly between."""
        L = self.original_context

        def correction_dim(rotations: float) -> float:  # the dimension with `rotations` turns over L positions
            return dim * math.log(L / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # transformers' guard against a zero-width ramp
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        extrapolated = 1 - ramp
        return (f / self.factor) * (1 - extrapolated) + f * extrapolated

    def tables(self, dim: int, theta: float, n_positions: int,
               seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [n_positions, dim/2] (float32, times the attention factor) for positions 0..n-1."""
        angles = torch.outer(torch.arange(n_positions, dtype=torch.float64), self.inv_freq(dim, theta, seq_len))
        scale = self.attention_scale()
        return (angles.cos() * scale).float(), (angles.sin() * scale).float()

    @classmethod
    def from_options(cls, options) -> "RopeScaling":
        """The RopeScaling of an object with the rope_* options as attributes (a `Backbone`): numbers as
        floats, lists of numbers as tuples of floats (an option may hold an int or a JSON list)."""
        values = {}
        for name, opt in ROPE_OPTIONS.items():
            value = getattr(options, name)
            if opt.kind == "number":
                value = float(value)
            elif opt.kind == "numbers":
                value = tuple(map(float, value))
            values[rope_field(name)] = value
        return cls(**values)


RopeScaling = schema_record("RopeScaling", ROPE_OPTIONS, _RopeTables, rename=rope_field,
                            doc="One RoPE type and its parameters: the backbone's rope_* options, one field each "
                                "(kind = rope_type; attention_factor 0: the type's default).")

PLAIN = RopeScaling()
