"""Typed, validated run configuration: one source of truth that round-trips to JSON.

`ModelConfig` fixes the network (backbone shape + architecture name + architecture options).
`TrainConfig` fixes the training recipe (used by `depthtools.train`). Both are frozen dataclasses so a config
cannot drift after a model was built from it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

from depthtools.data.tasks import TaskMix
from depthtools.errors import DepthToolsError


def _finite(value: Any) -> bool:
    """A real number that is not NaN/inf (bools are not numbers here)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# -- JSON fields against a dataclass's annotations ----------------------------------------------
_JSON_KINDS = {"str": (str,), "int": (int,), "float": (int, float), "bool": (bool,), "dict": (dict,), "list": (list,),
               "None": (type(None),)}
_KIND_WORDS = {"str": "a string", "int": "an integer", "float": "a number", "bool": "true or false",
               "dict": "a JSON object", "list": "a JSON list", "None": "null"}


def _annotation_kinds(annotation: Any) -> list[str] | None:
    """'int | None' -> ['int', 'None']; 'dict[str, Any]' -> ['dict']; 'str | os.PathLike' -> ['str'];
    None for a kind JSON cannot check (e.g. 'TaskMix | None')."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    kinds = [part.strip().strip("'\"").split("[")[0] for part in text.split("|")]
    kinds = [k for k in kinds if not k.endswith("PathLike")] if "str" in kinds else kinds  # a path is a string in JSON
    return kinds if all(k in _JSON_KINDS for k in kinds) else None


def check_json_value(value: Any, annotation: Any, label: str, also: tuple = ()) -> None:
    """A one-line DepthToolsError unless `value` (parsed JSON) has the JSON type of `annotation` (a
    dataclass field's or a function parameter's, e.g. 'int | None'; `also`: more accepted types). A
    bool is not an integer or a number, an integer is a number, a list must hold strings where its
    annotation says list[str]. `label` names the value: "TrainConfig.lr", "grid spec: 'data': 'seed'"."""
    kinds = _annotation_kinds(annotation)
    if kinds is None:
        return
    allowed = tuple(t for k in kinds for t in _JSON_KINDS[k]) + tuple(also)
    words = " or ".join(_KIND_WORDS[k] for k in kinds)
    if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
        raise DepthToolsError(f"{label} must be {words}, not {type(value).__name__} {_short(value)}")
    if isinstance(value, list) and "list[str]" in str(annotation) and not all(isinstance(v, str) for v in value):
        raise DepthToolsError(f"{label} must list strings, got {_short(value)}")


def check_json_fields(data: Any, cls: type, what: str, also: dict[str, tuple] | None = None) -> dict[str, Any]:
    """`data` (parsed JSON) as the keyword arguments of dataclass `cls`, checked against its fields in
    one line: it must be an object, every key must be a field (unknown keys are named as keys), and
    every value must have its field's annotated JSON type (an integer is not a bool, a bool is not an
    integer, a string is not a number). Fields whose annotation JSON cannot express (e.g. TaskMix) are
    left to the class's own validation; `also` adds accepted types per field (old spellings).
    `what` names the object in the message, e.g. "ModelConfig" or "grid spec g.json: cells[2]"."""
    if not isinstance(data, dict):
        raise DepthToolsError(f"{what} must be a JSON object, not {type(data).__name__} {_short(data)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(str(k) for k in data if k not in fields)
    if unknown:
        where = f"unknown {what} field(s)" if what.isidentifier() else f"{what}: unknown field(s)"
        raise DepthToolsError(f"{where} {unknown}; valid: {sorted(fields)}")
    for name, value in data.items():
        check_json_value(value, fields[name].type, f"{what}.{name}", (also or {}).get(name, ()))
    return data


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def round_up(x: float, multiple: int) -> int:
    """Smallest multiple of `multiple` that is >= x."""
    return int(math.ceil(x / multiple - 1e-9)) * multiple


def default_d_ff(d_model: int, multiple: int = 16, ratio: float = 8 / 3) -> int:
    """SwiGLU hidden size: ratio·d rounded up to a multiple (DepthBench: 8/3·d, multiple 16)."""
    return round_up(ratio * d_model, multiple)


# The architecture checks, installed by depthtools.arch.registry when it loads: (canonical_name, check). This
# module imports nothing from depthtools.arch (arch/ types against ModelConfig, so it sits above config); a config
# built before the registry is loaded has its shape checked here and the rest by
# `depthtools.arch.registry.validate_model_config`, which model construction and the entry points call.
class ArchRules(NamedTuple):
    canonical_name: Callable[[str], str]  # an architecture name or alias -> its registry name (or a refusal)
    check: Callable[["ModelConfig"], None]  # the checks that need the architecture (one-line refusals)


_ARCH_RULES: list[ArchRules] = []  # empty until the registry loads, then its one ArchRules


def install_arch_rules(canonical_name: Callable[[str], str], check: Callable[["ModelConfig"], None]) -> None:
    """Make every ModelConfig built from now on store `canonical_name(arch)` and run `check(cfg)` after its own
    shape checks (one-line DepthToolsErrors). Called once, by the architecture registry."""
    _ARCH_RULES[:] = [ArchRules(canonical_name, check)]


@dataclass(frozen=True)
class ModelConfig:
    """Shape and architecture of one decoder-only LM.

    `arch` is a registry name (see `depthtools.arch.list_archs()`; an alias is stored as the name it
    stands for); `options` holds architecture-specific settings (e.g. ``{"n_streams": 4}`` for HC),
    checked against the architecture's option schema (`ResidualScheme.option_schema`): an unknown
    key or a bad value is a one-line error naming the architecture, the key and the valid ones.
    Those checks belong to `depthtools.arch` (`registry.check_model_config`): they run as a config is
    built once the registry is loaded, and `registry.validate_model_config(cfg)` runs them on a config
    built before (a torch-free process checks the shape only).
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
        if _ARCH_RULES and isinstance(self.arch, str):  # an alias is stored as the name it stands for
            object.__setattr__(self, "arch", _ARCH_RULES[0].canonical_name(self.arch))
        self.validate()

    @property
    def head_dim(self) -> int:
        """Per-head width: the Pre-LN option `head_dim` where set (e.g. Gemma, Qwen3), else d_model / n_heads.
        (The one option this module reads: the width is shape, which torch-free planners need too.)"""
        explicit = self.options.get("head_dim")
        if isinstance(explicit, int) and not isinstance(explicit, bool) and explicit > 0:
            return explicit
        return self.d_model // self.n_heads

    def validate(self) -> None:
        """Refuse impossible shapes with a one-line reason; once `depthtools.arch` is loaded, also the checks
        that need the registry (head shape against the options, the options themselves)."""
        for name in ("vocab_size", "d_model", "n_layer", "n_heads", "max_seq_len", "d_ff"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise DepthToolsError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
        if self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads:
            raise DepthToolsError(
                f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}"
            )
        for name in ("rope_theta", "norm_eps", "init_std"):  # NaN/inf/0 would give NaN metrics, not an error
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise DepthToolsError(f"ModelConfig.{name} must be a positive finite number, got {value!r}")
        if not isinstance(self.arch, str):
            raise DepthToolsError(f"ModelConfig.arch must be an architecture name, got {self.arch!r}")
        if _ARCH_RULES:
            _ARCH_RULES[0].check(self)  # the head shape against the options, unknown option keys and bad values

    def replace(self, **changes: Any) -> "ModelConfig":
        """A copy with some fields changed (re-validated)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        """From parsed JSON: keys and value types are checked first (`check_json_fields`), so a string
        "no" is not a true tie_embeddings and `true` is not one layer."""
        return cls(**check_json_fields(data, cls, "ModelConfig"))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "ModelConfig":
        return cls.from_dict(json.loads(text))


SCHEDULES = ("cosine", "wsd")
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16")
PARAM_DTYPES = ("float32", "bfloat16", "auto")  # TrainConfig.param_dtype (issue 37): depthtools.train.precision
PARALLEL = ("ddp", "fsdp")
COMPILE = ("auto", "on", "off")  # TrainConfig.compile (issue 20)
DECAY_GROUPS = ("depthtools", "depthbench")  # TrainConfig.decay_groups (issue 37)
PROFILES = ("depthtools", "depthbench")  # TrainConfig.profile: recipe profiles (depthtools.profiles)


@dataclass(frozen=True)
class TrainConfig:
    """The training recipe of one cell: budget, batch, AdamW, schedule, evaluation, checkpoints.

    Budget: `tokens`, or `tokens_per_param` × the model's total parameters (default 20, Chinchilla /
    DepthBench). Optimiser: AdamW (β1, β2, eps), decoupled weight decay on matrices only; norms,
    gains and routing parameters (1-D tensors and the scheme's `no_decay_names()`) are not decayed
    (`decay_groups="depthtools"`, the default). `decay_groups="depthbench"` is DepthBench's grouping:
    every parameter decays except HC/mHC static routing (the scheme's `static_routing_names()`).
    Schedule: linear warmup over `warmup_fraction` of the steps, then cosine to `final_lr_fraction`·lr
    ("cosine"), or warmup-stable-decay with a linear decay over the last `decay_fraction` ("wsd").
    `lr_overrides` maps an architecture name to its own peak LR; the LR actually used is recorded
    in config.json. Steps: `eval_every`, `log_every`, `depth_stats_every`, `checkpoint_every`
    (0 = never; the final step always evaluates and saves). Divergence: besides a NaN/inf loss or
    gradient, a logged train loss (the mean over its log window) more than `divergence_margin` nats
    above the lowest logged train loss so far stops the run before that step's checkpoint, and drops
    the checkpoint saved just before it, whose weights produced that loss (0 = only NaN/inf). The default, 5 nats (~150x the best perplexity so far), is far beyond the
    noise and recovering loss spikes of a healthy run (a tiny model at 30x its usual LR spikes by
    3.5 nats and recovers); it is checked from the second logged step on, warmup included, so that
    every checkpoint a run keeps was followed by a logged loss that passed the check. `dtype`/`device` "auto" mean bf16
    autocast on CUDA and float32 on CPU; `threads` sets torch's intra-op threads (None: leave).
    `max_epochs` bounds the token budget by the data: a budget above max_epochs × the train split's
    tokens is refused when planning and training (None: a warning above one epoch; recipes that claim
    a paper's setting set 1). `compile`: "on" trains through depthtools.arch.compiled's regional
    `torch.compile` (CPU and CUDA; the eager path is the reference), "off" eagerly, "auto" (default)
    compiles only when the planned run is long enough to repay the compilation (`depthtools.arch.compiled.decide`).
    `parallel` is how a run under torchrun splits the model: "ddp" (replicas) or "fsdp" (FSDP2
    sharding, for models whose weights + AdamW state do not fit one device); one process ignores it.
    `profile` records the recipe profile the config was built with (`depthtools.profiles`: the fields
    it sets are already in this config; the trainer prints what the profile does not reproduce).
    `param_dtype` is the dtype the weights and AdamW state are stored in (`depthtools.train.precision`):
    "float32" (default), "bfloat16" (every parameter and its AdamW state bf16, no float32 master copy, as
    DepthBench's OLMo-core DDP cast; CPU too; a device without bf16 trains float32 and says so in one
    line), or "auto" (bfloat16 on a CUDA device with bf16, else float32: the `depthbench` profile's choice).
    `dtype` stays the autocast dtype of the computation.
    """

    tokens: int | None = None
    tokens_per_param: float | None = None  # used when tokens is None (default 20)
    batch_size: int = 16
    seq_len: int = 128
    micro_batch_size: int | None = None  # None: = batch_size (no gradient accumulation)
    lr: float = 3e-3
    lr_overrides: dict[str, float] = field(default_factory=dict)
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    schedule: str = "cosine"
    warmup_fraction: float = 0.1
    final_lr_fraction: float = 0.1
    decay_fraction: float = 0.2  # WSD only: share of steps in the final linear decay
    seed: int = 0
    eval_every: int = 100
    eval_tokens: int = 32768  # per validation split (val and every val_<domain>)
    log_every: int = 10
    depth_stats_every: int = 100
    checkpoint_every: int = 200
    keep_train_state: bool = False  # keep train_state/ after finishing (to continue training)
    divergence_margin: float = 5.0  # nats above the lowest logged train loss that stop the run (0 = off)
    device: str = "auto"
    dtype: str = "auto"
    compile: str = "auto"  # "auto" | "on" | "off" (old configs' true/false read as "on"/"off"); see depthtools.arch.compiled.decide
    threads: int | None = None
    peak_flops: float | None = None  # for MFU; None: looked up from the CUDA device name
    parallel: str = "ddp"  # under torchrun: "ddp" or "fsdp" (same maths; not part of the run fingerprint)
    task_mix: "TaskMix | None" = None  # synthetic task rows mixed into training (depthtools.data.tasks.TaskMix)
    max_epochs: float | None = None  # refuse a budget above this many passes over the train split (None: warn above 1)
    decay_groups: str = "depthtools"  # which parameters AdamW decays: "depthtools" | "depthbench" (depthtools.train.optim)
    profile: str | None = None  # the recipe profile this config was built with (depthtools.profiles); a record
    param_dtype: str = "float32"  # weights + AdamW state: "float32" | "bfloat16" | "auto" (depthtools.train.precision)

    def __post_init__(self) -> None:
        object.__setattr__(self, "lr_overrides", {str(k): float(v) for k, v in dict(self.lr_overrides).items()})
        if isinstance(self.compile, bool):  # configs written before issue 20: true/false
            object.__setattr__(self, "compile", "on" if self.compile else "off")
        if self.task_mix is not None:  # a JSON dict becomes a validated, frozen TaskMix
            object.__setattr__(self, "task_mix", TaskMix.from_value(self.task_mix))
        self.validate()

    def validate(self) -> None:
        """Refuse impossible recipes with a one-line reason: the token budget, batching and the logging
        counters, the optimizer, the schedule, then the run's named choices (device, dtype, ...)."""
        self._check_budget()
        self._check_batching()
        self._check_optimizer()
        self._check_schedule()
        self._check_run()

    def _check_budget(self) -> None:
        """tokens or tokens_per_param (not both), each positive."""
        if self.tokens is not None and self.tokens_per_param is not None:
            raise DepthToolsError("give TrainConfig.tokens or tokens_per_param, not both")
        if self.tokens is not None and (not isinstance(self.tokens, int) or self.tokens < 1):
            raise DepthToolsError(f"TrainConfig.tokens must be a positive integer, got {self.tokens!r}")
        if self.tokens_per_param is not None and not (_finite(self.tokens_per_param) and self.tokens_per_param > 0):
            raise DepthToolsError(f"TrainConfig.tokens_per_param must be a positive finite number, got {self.tokens_per_param!r}")

    def _check_batching(self) -> None:
        """batch_size, seq_len, micro_batch_size and the every-N-steps counters."""
        for name in ("batch_size", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise DepthToolsError(f"TrainConfig.{name} must be a positive integer, got {value!r}")
        micro = self.micro_batch_size
        if micro is not None and (micro < 1 or self.batch_size % micro):
            raise DepthToolsError(f"micro_batch_size={micro} must be positive and divide batch_size={self.batch_size}")
        for name in ("eval_every", "eval_tokens", "log_every", "depth_stats_every", "checkpoint_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise DepthToolsError(f"TrainConfig.{name} must be a non-negative integer, got {value!r}")

    def _check_optimizer(self) -> None:
        """Learning rates, AdamW's betas/eps, weight decay, clipping and the divergence margin."""
        if not all(_finite(v) and v > 0 for v in (self.lr, *self.lr_overrides.values())):
            raise DepthToolsError(f"learning rates must be positive finite numbers, got lr={self.lr}, "
                                  f"lr_overrides={self.lr_overrides}")
        if not all(_finite(v) for v in (self.beta1, self.beta2, self.eps, self.weight_decay, self.grad_clip)):
            raise DepthToolsError("beta1, beta2, eps, weight_decay and grad_clip must be finite numbers")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1) or self.eps <= 0:
            raise DepthToolsError(f"need 0 <= beta1, beta2 < 1 and eps > 0, got {self.beta1}, {self.beta2}, {self.eps}")
        margin = self.divergence_margin
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin) or margin < 0:
            raise DepthToolsError(f"TrainConfig.divergence_margin must be a finite number >= 0 (0 = off), got {margin!r}")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise DepthToolsError("weight_decay and grad_clip must be >= 0 (grad_clip 0 = no clipping)")

    def _check_schedule(self) -> None:
        """The schedule's name and its fractions in [0, 1]."""
        if self.schedule not in SCHEDULES:
            raise DepthToolsError(f"unknown schedule {self.schedule!r}; valid: {', '.join(SCHEDULES)}")
        for name in ("warmup_fraction", "final_lr_fraction", "decay_fraction"):
            if not 0 <= getattr(self, name) <= 1:
                raise DepthToolsError(f"TrainConfig.{name} must lie in [0, 1], got {getattr(self, name)!r}")

    def _check_run(self) -> None:
        """Device, dtypes, threads, epochs and the other named choices of how the run executes."""
        if self.device not in DEVICES:
            raise DepthToolsError(f"unknown device {self.device!r}; valid: {', '.join(DEVICES)}")
        if self.dtype not in DTYPES:
            raise DepthToolsError(f"unknown dtype {self.dtype!r}; valid: {', '.join(DTYPES)}")
        if self.threads is not None and self.threads < 1:
            raise DepthToolsError(f"TrainConfig.threads must be >= 1, got {self.threads!r}")
        epochs = self.max_epochs
        if epochs is not None and (isinstance(epochs, bool) or not isinstance(epochs, (int, float))
                                   or not math.isfinite(epochs) or epochs <= 0):
            raise DepthToolsError(f"TrainConfig.max_epochs must be a positive number (or None), got {epochs!r}")
        if self.parallel not in PARALLEL:
            raise DepthToolsError(f"unknown parallel {self.parallel!r}; valid: {', '.join(PARALLEL)}")
        if self.compile not in COMPILE:
            raise DepthToolsError(f"unknown compile {self.compile!r}; valid: {', '.join(COMPILE)}")
        if self.decay_groups not in DECAY_GROUPS:
            raise DepthToolsError(f"unknown decay_groups {self.decay_groups!r}; valid: {', '.join(DECAY_GROUPS)}")
        if self.param_dtype not in PARAM_DTYPES:
            raise DepthToolsError(f"unknown param_dtype {self.param_dtype!r}; valid: {', '.join(PARAM_DTYPES)}")
        if self.profile is not None and self.profile not in PROFILES:
            raise DepthToolsError(f"unknown profile {self.profile!r}; valid: {', '.join(PROFILES)}")


    def total_tokens(self, n_params: int) -> int:
        """The token budget for a model of `n_params` total parameters."""
        if self.tokens is not None:
            return self.tokens
        return int(round((self.tokens_per_param or 20.0) * n_params))

    def total_steps(self, n_params: int) -> int:
        """Optimizer steps: the token budget over batch_size × seq_len, at least 1."""
        return max(1, math.ceil(self.total_tokens(n_params) / (self.batch_size * self.seq_len)))

    def lr_for(self, arch: str) -> float:
        """Peak LR for `arch`: its override if one is given, else `lr`."""
        return self.lr_overrides.get(arch, self.lr)

    def replace(self, **changes: Any) -> "TrainConfig":
        """A copy with some fields changed (re-validated)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        if self.max_epochs is None:  # unset: config.json stays as before the field existed
            del data["max_epochs"]
        if self.decay_groups == "depthtools":  # the default: config.json and the run fingerprint stay as before
            del data["decay_groups"]
        if self.profile is None:
            del data["profile"]
        if self.param_dtype == "float32":  # the default: config.json and the run fingerprint stay as before
            del data["param_dtype"]
        if self.task_mix is None:  # runs without a task mix keep their config.json and run fingerprint
            del data["task_mix"]
        else:
            data["task_mix"] = self.task_mix.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainConfig":
        """From parsed JSON, keys and value types checked first (`check_json_fields`); `compile` may
        still be the true/false of configs written before issue 20."""
        data = check_json_fields(data, cls, "TrainConfig", also={"compile": (bool,)})
        for name, value in (data.get("lr_overrides") or {}).items():
            if not _finite(value):
                raise DepthToolsError(f"TrainConfig.lr_overrides[{name!r}] must be a number, not {value!r}")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "TrainConfig":
        return cls.from_dict(json.loads(text))
