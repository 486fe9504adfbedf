"""The residual-scheme protocol: what an architecture must define for the depth-state contract.

A `ResidualScheme` owns everything that differs between architectures: which extra modules each
block carries, what the depth state is, how a block updates it, what the head reads, and how a
block is bypassed. `DepthModel` owns the shared backbone (embedding, blocks' attention/MLP,
final norm, unembedding) and drives the scheme. Analyses only see `DepthModel`'s contract.

Everything the rest of the package needs to know about an architecture is asked of its scheme, so
adding one is a scheme file (a subclass) and one `depthtools.arch.register(ArchSpec(...))` call:

    option_schema(arch)   {name: Option}: the options ModelConfig accepts (kind, default, valid values)
    extra_flops()         forward FLOPs per token added to Pre-LN (depthtools.train.flops)
    depth_routing(...)    native depth routing as a DepthRouting, or None (depthtools.analysis.routing)
    written_tensor(state) the tensor the last block wrote (the training depth probe's gradient norms)
    tl_limits / tl_norm_site / tl_branch_scale   TransformerLens cache functions (tl_cache.py)
    recorded_config, no_decay_names              checkpoints, weight decay
    depthbench_family, depthbench_state, ...     DepthBench's depth-probe protocol (analysis/depthbench.py)
    no_readout()          why `readout` has no vector before the final norm (the tuned lens refuses), or None

and on its `ArchSpec`: `profiles` (a recipe profile's options), `legacy_defaults` (changed defaults that older
checkpoints imply), `backbone_options` (takes the Pre-LN backbone options), `reference` (Pre-LN). Nothing outside
arch/ tests a scheme class or an architecture's name (tests/test_arch_boundary.py).

Swap convention (docs/design.md §3): a block's parameters travel with it; what is tied to a *position*
(structure, position-bound parameters) stays. `step(position, block, state, home)` receives the
block that runs (`block`) and the block that was built for this position (`home`); a tensor the
running block lacks (a structurally mismatched key, e.g. KEEL block 0's missing norm) is taken
from `home`, as DepthBench's swap leaves mismatched tensors in place.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, make_dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, Mapping, NamedTuple

import torch
from torch import nn

from depthtools.errors import DepthToolsError

if TYPE_CHECKING:  # annotations only (depthtools.config imports nothing from arch/: no circle either way)
    from depthtools.config import ModelConfig

State = Any  # architecture-specific and opaque to analyses (tensor, stream stack, source bank...)

# What TransformerLens' ActivationCache functions assume of a model (see `ResidualScheme.tl_limits`):
TL_CAPABILITIES = {
    "stream": "blocks.{l}.hook_resid_pre|mid|post carry the depth state and the final norm reads the last "
              "hook_resid_post (accumulated_resid, logit_lens)",
    "sum": "the stream is hook_embed plus every earlier hook_attn_out and hook_mlp_out "
           "(decompose_resid, stack_head_results, stack_neuron_results, get_full_resid_decomposition)",
    "heads": "hook_attn_out is the sum over heads of hook_z · W_O (compute_head_results)",
    "neurons": "hook_mlp_out is the sum over neurons of mlp.hook_post · W_out (get_neuron_results)",
    "linear_head": "the logits are normed stream @ W_U + b_U, with no soft-cap after (logit_lens, logit_attrs)",
}


@dataclass(frozen=True)
class Option:
    """One architecture option of `ModelConfig.options`: its kind, default and valid values.

    kind: "bool" | "int" | "number" (int or float, finite; bools are not numbers) | "str" | "numbers" (a
    list of numbers, each within the bounds: RoPE's per-frequency factors).
    default: the value, or a function of the ModelConfig (e.g. of n_layer).
    choices: the valid values (empty: any value of the kind); low/high: inclusive bounds for
    numbers, `low_open` makes the lower bound exclusive (e.g. an eps > 0).
    """

    kind: str
    default: Any
    choices: tuple = ()
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    doc: str = ""

    def default_for(self, cfg: ModelConfig) -> Any:
        return self.default(cfg) if callable(self.default) else self.default

    def describe(self) -> str:
        """What a valid value is, for error messages ("a positive integer", "one of ['a', 'b']")."""
        if self.choices:
            return f"one of {list(self.choices)}"
        if self.kind == "bool":
            return "true or false"
        noun = {"int": "an integer", "number": "a finite number", "str": "a string",
                "numbers": "a list of finite numbers"}[self.kind]
        if self.kind == "int" and self.low == 1 and self.high is None:
            return "a positive integer"
        if self.low is not None and self.high is not None:
            return f"{noun} in [{self.low:g}, {self.high:g}]"
        if self.low is not None:
            return f"{noun} {'>' if self.low_open else '>='} {self.low:g}"
        return noun

    def valid(self, value: Any) -> bool:
        if self.choices:
            return any(value == c and type(value) is type(c) for c in self.choices)
        if self.kind == "bool":
            return isinstance(value, bool)
        if self.kind == "str":
            return isinstance(value, str)
        if self.kind == "numbers":
            return isinstance(value, (list, tuple)) and all(self._valid_number(v) for v in value)
        return self._valid_number(value)

    def _valid_number(self, value: Any) -> bool:
        """A finite int (kind "int") or number within the bounds."""
        if isinstance(value, bool) or not isinstance(value, int if self.kind == "int" else (int, float)):
            return False
        if not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or value <= self.high


def resolve_options(schema: dict[str, Option], cfg: ModelConfig) -> dict[str, Any]:
    """cfg.options over the schema's defaults, validated: an unknown key or a bad value is a one-line
    DepthToolsError naming the architecture, the key and what is valid."""
    unknown = sorted(set(cfg.options) - set(schema))
    if unknown:
        valid = ", ".join(sorted(schema)) or "none (it takes no options)"
        raise DepthToolsError(f"unknown {cfg.arch} option {unknown[0]!r}; valid: {valid}")
    for name, value in cfg.options.items():
        if not schema[name].valid(value):
            raise DepthToolsError(f"{cfg.arch} option {name} must be {schema[name].describe()}, got {value!r}")
    return {name: cfg.options[name] if name in cfg.options else opt.default_for(cfg) for name, opt in schema.items()}


_KIND_TYPES = {"bool": bool, "int": int, "number": float, "str": str, "numbers": tuple}  # the annotation of each Option kind
_OPTION_TYPES: dict[tuple, type] = {}


def options_type(arch: str, schema: dict[str, Option]) -> type:
    """The frozen dataclass of `arch`'s options (one typed field per Option, made once per schema shape):
    schemes read `self.opts.n_streams`, not a dict, and cannot change an option after the build."""
    key = (arch, tuple((name, opt.kind) for name, opt in schema.items()))
    if key not in _OPTION_TYPES:
        camel = "".join(part.capitalize() for part in arch.replace("-", "_").split("_"))
        fields = [(name, _KIND_TYPES[opt.kind]) for name, opt in schema.items()]
        cls = make_dataclass(f"{camel}Options", fields, frozen=True, namespace={"as_dict": lambda self: asdict(self)})
        cls.__doc__ = f"The options of architecture {arch!r} (validated, defaults filled in; frozen)."
        _OPTION_TYPES[key] = cls
    return _OPTION_TYPES[key]


def build_options(schema: dict[str, Option], cfg: ModelConfig):
    """cfg.options validated against the schema (see `resolve_options`) as the architecture's frozen,
    typed options object: the one place an option's default is applied."""
    return options_type(cfg.arch, schema)(**resolve_options(schema, cfg))


def schema_record(name: str, schema: dict[str, Option], base: type, doc: str,
                  rename: Callable[[str], str] = str) -> type:
    """A frozen dataclass whose fields ARE `schema`'s options, in its order, each typed by its kind and
    defaulting to its default (constant defaults only), with `base`'s methods: a record of typed options
    generated from the schema, so the two cannot drift. `rename` maps an option to its field name (e.g.
    rope_factor -> factor). Used for the Pre-LN `Backbone` and `RopeScaling`."""
    fields = []
    for option_name, opt in schema.items():
        if callable(opt.default):
            raise TypeError(f"{name}: option {option_name} has a computed default; a record needs a constant")
        fields.append((rename(option_name), _KIND_TYPES[opt.kind], field(default=opt.default)))
    cls = make_dataclass(name, fields, bases=(base,), frozen=True, namespace={"__module__": base.__module__})
    cls.__doc__ = doc
    cls.__qualname__ = name
    return cls


@dataclass
class DepthRouting:
    """Native depth routing in the common frame of `depthtools.analysis.routing` (docs/reference/metrics.md §4).

    consumers: [(c, kind)] consumer depths in sublayers (kind "attn" | "mlp" | "dwa" | "final");
    weights:   [2L+1, 2L+1] float64, weights[c, i] = token-mean weight of source depth i in consumer
               c's input (NaN where c does not read i);
    notes:     one-line caveats for the table; extra: architecture-specific tidy rows (dicts with
               metric, value and optionally unit, layer, consumer_kind), e.g. mHC's Sinkhorn residual.
    """

    consumers: list[tuple[int, str]]
    weights: torch.Tensor
    notes: list[str] = field(default_factory=list)
    extra: list[dict[str, Any]] = field(default_factory=list)


class NormSite(NamedTuple):
    """Where a block's pre-norm sits, for TransformerLens' `apply_ln_to_stack(layer=l)`: the cache key of
    the [B,T,d] tensor the norm reads, the RMSNorm (its eps and gain), and a constant factor applied
    after it (LNS' 1/sqrt(l+1); 1 elsewhere)."""

    hook: str
    norm: nn.Module
    factor: float = 1.0


class ResidualScheme(nn.Module):
    """Base class: the identity-free pieces every architecture implements.

    Subclasses set `single_stream` (True when the state is a plain [B,T,d] residual stream that
    TransformerLens tools may read as `hook_resid_*`) and `skip_rules` (names of the skip
    semantics they support; the first is the default).
    """

    single_stream: bool = True
    skip_rules: tuple[str, ...] = ("identity",)
    # the rules a skip sweep runs when none is named (`ablate --mode skip`, `analyze`); the others only on request
    # (AttnRes' "depthbench" rule is what `--protocol depthbench` uses, not a third default sweep)
    on_request_skip_rules: tuple[str, ...] = ()
    compile_region: str = "none"  # what depthtools.arch.compiled compiles: "step" | "sublayer" | "none"

    # cpu_kernels libraries its fused path uses: built on the first CPU call that needs them, never when a model is
    # built (the grid planner builds on `meta`); `depthtools archs` shows which path they take
    kernel_libraries: tuple[str, ...] = ()

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.opts = self.options_for(cfg)  # frozen, typed: every option, defaults filled in, read as attributes
        self.compiled_cores = None  # (attn, mlp) compiled sublayer cores, set only inside a compiled step

    # -- compiled training (depthtools.arch.compiled) -------------------------------------------
    def compile_key(self, position: int):
        """compile_region "step": positions with equal keys share one compiled step function (so
        `step` must compute the same function of (block, state) at all of them). Default: one key."""
        return None

    def run_attn(self, norm: nn.Module, attn: nn.Module, x: torch.Tensor, rope) -> torch.Tensor:
        """attn(norm(x)): the pre-normed attention sublayer (compiled under compile_region "sublayer")."""
        if self.compiled_cores is not None:
            return self.compiled_cores[0](norm, attn, x, *rope)
        return attn(norm(x), *rope)

    def run_mlp(self, norm: nn.Module, mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """mlp(norm(x)): the pre-normed MLP sublayer (compiled under compile_region "sublayer")."""
        if self.compiled_cores is not None:
            return self.compiled_cores[1](norm, mlp, x)
        return mlp(norm(x))

    # -- what the rest of the package asks of an architecture ---------------------------------
    @classmethod
    def option_schema(cls, arch: str) -> dict[str, Option]:
        """{name: Option} of the options architecture `arch` accepts (ModelConfig validates against
        it; any other key is refused). Default: none."""
        return {}

    @classmethod
    def options_for(cls, cfg: ModelConfig):
        """cfg's options for this scheme as its frozen, typed options object (`build_options`); functions of a
        config (closed-form parameter counts, ...) read defaults through it rather than writing them again."""
        return build_options(cls.option_schema(cfg.arch), cfg)

    def extra_flops(self) -> float:
        """Forward FLOPs per token this architecture adds to a Pre-LN model of the same shape, counted
        as `depthtools.train.flops` counts (matrix products and contractions, 2 per multiply-add;
        elementwise work not counted): its own parameters' products, per use, and its depth mixing.
        tests/test_flops.py checks it against a counted forward. Default: 0."""
        return 0.0

    def depth_routing(self, model: nn.Module, tokens: torch.Tensor, exclude_first: int) -> "DepthRouting | None":
        """Native depth routing of `model` (this scheme's) on tokens [N,T] (token means over positions
        >= exclude_first), for `depthtools.analysis.routing`; None when it has no learned routing."""
        return None

    def written_tensor(self, state: State) -> torch.Tensor | None:
        """The tensor the last block wrote into `state` (the depth probe's gradient norms hook it);
        must be a distinct tensor at every depth. Default: the state itself when it is a tensor."""
        return state if torch.is_tensor(state) else None

    def recorded_config(self) -> ModelConfig:
        """The config a model of this scheme records (`DepthModel.config`, saved in checkpoints): `cfg`,
        plus any option whose default has changed written out, so that an absent key identifies a
        config saved before the change (see `ArchSpec.legacy_defaults`)."""
        return self.cfg

    # -- construction -------------------------------------------------------------------------
    def build_block(self, block: nn.Module) -> None:
        """Add this architecture's per-block modules (norms, gains, connectors) to `block`."""
        raise NotImplementedError

    def init_weights(self, model: nn.Module) -> None:
        """Architecture-specific initialisation, applied after the backbone's default init."""

    # -- the depth-state contract -------------------------------------------------------------
    def embed_state(self, x0: torch.Tensor) -> State:
        """z_0 from the embedding output x0 [B,T,d]."""
        return x0

    def step(self, position: int, block: nn.Module, state: State, home: nn.Module, rope) -> State:
        """Apply `block` at `position` to `state`; must not modify `state` in place."""
        raise NotImplementedError

    def skip(self, position: int, state: State, rule: str | None = None) -> State:
        """The state after bypassing the block at `position` (default: identity on the state)."""
        self._check_rule(rule)
        return state

    def readout(self, state: State) -> torch.Tensor:
        """[B,T,d]: what the final norm + unembedding read if the network stopped here."""
        return state

    def no_readout(self) -> tuple[str, str] | None:
        """(this configuration, what its head does instead) when `readout` has no vector before the final norm
        (a head that norms before it collapses: the tuned lens has nothing to translate); None: it has one."""
        return None

    def final_hidden(self, state: State, final_norm: nn.Module) -> torch.Tensor:
        """[B,T,d]: what the unembedding reads, final_norm(readout(state)). A scheme whose readout norms
        before it collapses (HC/mHC readout="normed_sum") overrides this and has no `readout`."""
        return final_norm(self.readout(state))

    def geometry(self, state: State) -> torch.Tensor:
        """[B,T,k]: the vector used for similarity/angle metrics."""
        return state

    def _check_rule(self, rule: str | None) -> str:
        rule = rule or self.skip_rules[0]
        if rule not in self.skip_rules:
            raise DepthToolsError(
                f"skip rule {rule!r} is not defined for {self.cfg.arch}; valid: {list(self.skip_rules)}"
            )
        return rule

    # -- DepthBench's depth-probe protocol (depthtools.analysis.depthbench, docs/depthbench.md) ---
    # What `--protocol depthbench` needs per architecture, so that adding one to the protocol is an edit of
    # its own scheme file: DepthBench's family name (None: its depth probes do not cover this architecture,
    # and the protocol refuses it), its skip rule (one of `skip_rules`), the metrics it leaves undefined
    # ({metric: why}), and the four state hooks below. The defaults are DepthBench's residual family.
    depthbench_family: str | None = None
    depthbench_skip_rule: str = "identity"
    depthbench_undefined: Mapping[str, str] = MappingProxyType({})

    def depthbench_block_output(self, state: State) -> torch.Tensor:
        """[B',T,d]: the block output DepthBench's older scripts hook (output[0]: usefulness, Jacobian, token
        collapse), with any extra streams folded into the batch. Default: the state itself."""
        return state

    def depthbench_state(self, state: State) -> torch.Tensor:
        """[B,T,k]: `depth_probes.forward_depth_states`' z_l (angular distance, causal score).
        Default: the block output (`depthbench_block_output`)."""
        return self.depthbench_block_output(state)

    def depthbench_with_input(self, state: State, x: torch.Tensor) -> State:
        """`state` with the block's first input, what DepthBench differentiates (the Jacobian), replaced by x
        (shaped as `depthbench_block_output` returns it). Default: x is the state."""
        return x

    def depthbench_lens_logits(self, model: nn.Module, state: State) -> torch.Tensor:
        """[B,T,V] `compute_logit_lens.py` decodes at a depth, head(Norm(r_l)). Default: the model's head."""
        return model.head(state)

    # -- TransformerLens' ActivationCache functions (DepthCache, tl_cache.py) ------------------
    def tl_limits(self) -> dict[str, str]:
        """{capability: why it fails here} for the `TL_CAPABILITIES` this architecture does not meet;
        the cache refuses the functions that rely on one, with this reason. Default: none is met."""
        reason = f"{self.cfg.arch} does not declare how TransformerLens' cache functions read it"
        return dict.fromkeys(TL_CAPABILITIES, reason)

    def tl_norm_site(self, block: nn.Module, sublayer: str) -> "NormSite | str":
        """The pre-norm of `block`'s sublayer ("attn" | "mlp") as a `NormSite`, or why there is none."""
        return f"{self.cfg.arch} does not declare where block {block.index}'s {sublayer} pre-norm reads"

    def tl_branch_scale(self, block: nn.Module, sublayer: str) -> "torch.Tensor | float":
        """The constant (or [d] vector) factor between the sublayer's projection output (attn.w_o /
        mlp.w2) and its hook_{attn,mlp}_out, for per-head and per-neuron results (1 = none)."""
        return 1.0

    # -- parameter bookkeeping ----------------------------------------------------------------
    def no_decay_names(self) -> tuple[str, ...]:
        """Substrings of parameter names excluded from weight decay beyond norms/gains (routing)."""
        return ()

    def static_routing_names(self) -> tuple[str, ...]:
        """Parameter names (the last part of the dotted name) that DepthBench exempts from weight decay
        (its `static_parameter_patterns`, HC/mHC only); every other parameter is decayed under
        TrainConfig.decay_groups="depthbench". Default: none."""
        return ()

# -- registration (depthtools.arch.registry) ------------------------------------------------------

def profile_defaults(defaults: dict[str, Any]) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """An `ArchSpec.profiles` entry that sets fixed option values, the options the user gave winning."""
    fixed = dict(defaults)

    def options(given: dict[str, Any]) -> dict[str, Any]:
        return {**fixed, **given}

    options.__doc__ = f"{fixed} under the profile; the user's options win"
    return options


@dataclass(frozen=True)
class ArchSpec:
    """One registered architecture: its name, family, description, closed-form extra parameters, paper and scheme
    class (each scheme file lists its own in `ARCH_SPECS`; `depthtools.arch.registry` registers them)."""

    name: str
    family: str  # "baseline" | "normalisation" | "multi-stream" | "cross-layer"
    description: str
    extra_formula: str  # human-readable, in d (d_model), L (n_layer), n (streams)
    extra_params: Callable[[ModelConfig], int]
    paper: str
    scheme: type[ResidualScheme]
    in_depthbench: bool = False
    aliases: tuple[str, ...] = ()
    # the reference architecture (Pre-LN; one is registered): what every other's extra parameters are counted
    # against (`extra_params`, `registry.baseline_config`) and what reports contrast with
    reference: bool = False
    # accepts the Pre-LN backbone options (depthtools.arch.backbone.OPTIONS) and their cross-option checks
    backbone_options: bool = False
    # options whose default changed: {option: the value a saved config without the key implies}; checkpoints
    # written before the option existed load with it (`upgrade_options`), new models record the key
    legacy_defaults: dict[str, Any] = field(default_factory=dict)
    # {recipe profile: options under it} as a function of the options the user gave (they win): what
    # `depthtools.profiles.apply_model` sets for this architecture; `profile_defaults` makes the plain kind
    profiles: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = field(default_factory=dict)

    def build_scheme(self, cfg: ModelConfig):
        return self.scheme(cfg)

    def upgrade_options(self, model: dict) -> dict:
        """A saved config's "model" section (of this architecture) with the options it predates filled in with
        their old defaults (`legacy_defaults`), so an old checkpoint reproduces its logits; else unchanged."""
        options = model.get("options") or {}
        if not isinstance(options, dict):
            return model
        missing = {k: v for k, v in self.legacy_defaults.items() if k not in options}
        return {**model, "options": {**options, **missing}} if missing else model

    def profile_options(self, profile: str, given: dict[str, Any]) -> dict[str, Any]:
        """The options of a model of this architecture under recipe `profile`, `given` (the user's) winning;
        `given` itself where the profile sets none for this architecture."""
        make = self.profiles.get(profile)
        return dict(given) if make is None else make(dict(given))

    def option_schema(self) -> dict:
        """{name: depthtools.arch.scheme.Option} of the options this architecture accepts."""
        return self.scheme.option_schema(self.name)

    def options(self, cfg: ModelConfig):
        """cfg's options, validated once, as this architecture's frozen, typed options object."""
        return build_options(self.option_schema(), cfg)
