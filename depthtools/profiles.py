"""Recipe profiles: one name that switches a model config and a training recipe to another codebase's choices.

`depthbench` follows DepthBench's training code (keyu-wang-2002/DepthBench, its OLMo-core fork and
`examples/pretrain_400m.sh`) where depthtools has the option today:

  * norm eps 1e-6 (ours 1e-5), for every norm;
  * mHC: the Liger-style init the runs use (`mhc_init="uniform"`: φ ~ N(0, 0.02), biases 0, so H_res starts
    near uniform) and `sinkhorn_log`'s order, rows then columns each of 20 iterations (`sinkhorn_order=
    "cols_last"`: the columns are normalised last);
  * MoDA: depth scores with the RoPE-rotated query (`moda_depth_rope="query"`);
  * Full and Block AttnRes: the res norms (key norms, every norm that reads a mix, the final norm) at
    OLMo-core's RMSNorm eps 1e-5 (`mix_eps=1e-5`), only block 0's attention norm at the profile's 1e-6;
  * DeepNorm: LayerNorm without bias as the blocks' post-norms (`norm="layernorm"`), at the profile's
    eps 1e-6 (`examples/pretrain_deepnorm.py` renames the blocks' `llama_like` norm config, bias=False, to
    `LayerNormType.default`; the LM head's own norm config stays RMSNorm, as our final norm does);
  * the HC/mHC head as DepthBench's `Transformer.forward` computes it: HC each stream normed by the
    final norm, then summed (`readout="normed_sum"`); mHC with the Liger init the mean of the streams,
    then the final norm (`readout="mean"`; with another mhc_init, DepthBench's PyTorch mHC: normed_sum);
  * AdamW as `examples/pretrain_llama_base.py` builds it: weight decay 0.1 on every parameter but HC/mHC
    static routing (`decay_groups="depthbench"`, see depthtools.train.optim), betas (0.9, 0.95), eps 1e-8,
    gradient clipping at norm 1.0; OLMo-core's `CosWithWarmup(warmup=760, alpha_f=0.1,
    warmup_min_lr=0)` over 7,600 steps = linear warmup over 10% of the steps, then cosine to 0.1 x peak
    (`schedule="cosine"`, `warmup_fraction=0.1`, `final_lr_fraction=0.1`). These are scale-free, so the
    profile sets them whatever preset it is applied to. (OLMo-core evaluates the cosine at step s+1 of
    T-W, ours at s of T-W-1: the multipliers differ by < 1.5/(T-W) of the peak, e.g. 0.0013 at the
    afternoon preset's 1,221 steps.)
  * the run length as a number of optimizer steps when asked (`steps_to_tokens`);
  * bf16 weights and bf16 AdamW state where the device does bf16 (`param_dtype="auto"`: CUDA with
    `torch.cuda.is_bf16_supported()`). DepthBench's DDP train module (`param_dtype=DType.bfloat16`)
    makes OLMo-core's `Transformer.apply_ddp` cast the whole model, `self.to(dtype=bf16)`: no parameter
    is exempt (norm gains, AttnRes projections and norms, HC/mHC routing are bf16 too; float32 is only
    computation inside the norms, the AttnRes kernel and the loss), and torch's AdamW keeps its state like
    the parameters, with no float32 master weights. `depthtools.train.precision` does the same cast.

The peak learning rate is NOT taken from DepthBench: its 2e-3 (1e-2 for LNS) is tuned for 400M-parameter
models at 512 x 2,048 tokens per step, and the best LR shifts with width and batch; a profile applied to
a preset keeps the preset's LR (e.g. 3e-3 for the ~0.4M-parameter afternoon grid, tuned at that scale).

Not reproduced yet (each needs an architecture or trainer option that does not exist; `NOT_REPRODUCED`
lists them, `notes` gives the lines for one architecture): nothing at present. A run under the profile
prints one line (`weights_note`) saying which weights it trains: bf16 weights and AdamW state on a CUDA
device with bf16; on CPU it keeps float32 weights and AdamW state and computes in float32 (bf16 weights
are far slower there and depthtools' C kernels take only float32/float64; `param_dtype="bfloat16"`
given explicitly trains bf16 on CPU too); on a CUDA device without bf16, float32.
Our defaults are unchanged: a profile only applies when named.

Where it is selected (one name, recorded in config.json as `train.profile`):
  depthtools train ... --profile depthbench            (`recipe` + `apply_model`)
  depthtools grid plan ... --profile depthbench        (`apply_to_spec`: the spec's train section gets
                                                        the profile's fields and "profile")
  a grid spec whose "train" holds "profile": "depthbench" (`load_spec` -> `apply_to_spec`)
Precedence: a preset's recipe < the profile < what the user gave (CLI options, a spec's explicit fields).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from depthtools.config import PROFILES, ModelConfig, TrainConfig
from depthtools.errors import DepthToolsError

# The architecture options a profile sets are each architecture's own (`ArchSpec.profiles` in its scheme file:
# HC/mHC in depthtools/arch/hyper.py, MoDA in moda.py, DeepNorm in norm_family.py); this module asks the registry.
DEPTHBENCH_NORM_EPS = 1e-6
# What the profile cannot reproduce yet: (architectures it concerns, None = all; the line a run prints).
NOT_REPRODUCED: dict[str, tuple[tuple[str, ...] | None, str]] = {}
# The scale-free recipe of examples/pretrain_llama_base.py + pretrain_400m.sh (TrainConfig fields).
DEPTHBENCH_TRAIN: dict[str, Any] = {
    "weight_decay": 0.1, "decay_groups": "depthbench", "beta1": 0.9, "beta2": 0.95, "eps": 1e-8,
    "grad_clip": 1.0, "schedule": "cosine", "warmup_fraction": 0.1, "final_lr_fraction": 0.1,
    "param_dtype": "auto",  # bf16 weights + AdamW state where the device does bf16 (depthtools.train.precision)
}


def check_profile(profile: str) -> str:
    if profile not in PROFILES:
        raise DepthToolsError(f"unknown profile {profile!r}; valid: {', '.join(PROFILES)}")
    return profile


def steps_to_tokens(steps: int, batch_size: int, seq_len: int) -> int:
    """DepthBench fixes a number of optimizer steps; depthtools' budget is tokens = steps · batch · seq_len."""
    if min(steps, batch_size, seq_len) < 1:
        raise DepthToolsError(f"steps, batch_size and seq_len must be >= 1, got {steps}, {batch_size}, {seq_len}")
    return steps * batch_size * seq_len


def train_fields(profile: str) -> dict[str, Any]:
    """The TrainConfig fields `profile` sets (with "profile" itself, recorded in config.json); {} for depthtools."""
    if check_profile(profile) == "depthtools":
        return {}
    return {**DEPTHBENCH_TRAIN, "profile": profile}


def apply_model(profile: str, model: ModelConfig) -> ModelConfig:
    """`model` under `profile`: norm eps and the architecture's options; options given explicitly in
    `model.options` win. Idempotent, so applying it to a config it already produced changes nothing."""
    if check_profile(profile) == "depthtools":
        return model
    from depthtools.arch.registry import profile_options  # lazy: keeps this module torch-free (arch/ imports torch)

    options = profile_options(profile, model.arch, model.options)  # the architecture's own (ArchSpec.profiles)
    return model.replace(norm_eps=DEPTHBENCH_NORM_EPS, options=options)


def notes(profile: str | None, arch: str) -> list[str]:
    """One line per part of `profile` that a cell of `arch` does not reproduce (see NOT_REPRODUCED)."""
    if profile in (None, "depthtools"):
        return []
    return [f"{profile} profile: not reproduced: {text}" for archs, text in NOT_REPRODUCED.values()
            if archs is None or arch in archs]


def weights_note(profile: str | None, device_type: str, compute_dtype: str, bf16_supported: bool,
                 param_dtype: str = "float32") -> str | None:
    """The one line a run under `profile` prints about DepthBench's bf16 weights and optimizer state
    (OLMo-core casts the whole model to bf16 under DDP): the weights dtype this run trains
    (`param_dtype`, resolved by `depthtools.train.precision`), and why when it is not bf16."""
    if profile in (None, "depthtools"):
        return None
    if param_dtype == "bfloat16":
        return (f"{profile} profile: bf16 weights and AdamW state as DepthBench trains them (every parameter, "
                f"norms and AttnRes projections included; no float32 master copy) on {device_type}, computing "
                f"in {compute_dtype}")
    if device_type == "cpu":
        where = ("on CPU (bf16 weights are far slower there and the C kernels take only float32/float64; "
                 "param_dtype='bfloat16' forces them),")
    elif not bf16_supported:
        where = f"on this {device_type} device, which has no bf16,"
    else:
        where = f"on {device_type} with param_dtype={param_dtype!r},"
    return (f"{profile} profile: DepthBench trains bf16 weights and optimizer state; {where} this run keeps "
            f"float32 weights and AdamW state and computes in {compute_dtype}")


def apply(profile: str, model: ModelConfig, train: TrainConfig | None = None,
          steps: int | None = None) -> tuple[ModelConfig, TrainConfig | None, list[str]]:
    """(model config, train config, notes) under `profile`; "depthtools" returns them unchanged.

    The profile's training fields replace `train`'s (a TrainConfig cannot tell a default from a
    choice); to let explicit choices win, merge dicts with `recipe`. `steps` sets the budget as
    DepthBench does, a number of optimizer steps."""
    model = apply_model(profile, model)
    if profile == "depthtools":
        return model, train, []
    if train is not None:
        changes = train_fields(profile)
        if steps is not None:
            changes.update(tokens=steps_to_tokens(steps, train.batch_size, train.seq_len), tokens_per_param=None)
        train = train.replace(**changes)
    return model, train, notes(profile, model.arch)


def recipe(profile: str | None, base: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """TrainConfig fields: a preset's recipe `base`, then the profile's fields, then the caller's own
    `given` choices (so the profile overrides a preset, and what a user typed overrides the profile)."""
    return {**base, **(train_fields(profile) if profile else {}), **given}


def apply_to_spec(spec: dict[str, Any], profile: str | None = None) -> dict[str, Any]:
    """A grid spec under its profile: the one place grids apply one (`depthtools grid plan --profile`,
    and `load_spec` for a spec whose train section names "profile").

    With `profile` (grid plan): the profile's training fields replace the spec's (a planned spec's
    train section is the preset's recipe, which the profile overrides). Without (a spec read back):
    the profile named in the train section fills only the fields the spec leaves out, so a spec
    written by hand keeps its explicit choices and applying twice changes nothing. Every cell's
    model config gets `apply_model`."""
    if not isinstance(spec.get("train") or {}, dict):  # not a recipe: TrainConfig's validation says so later
        return spec
    train = dict(spec.get("train") or {})
    if profile is not None:
        train = {**train, **train_fields(profile)}
    name = train.get("profile")
    if name is None:
        return spec
    train = {**train_fields(name), **train}
    cells = []
    for cell in spec["cells"]:
        as_dict = cell if isinstance(cell, dict) else None
        model = ModelConfig.from_dict(dict(as_dict["model"] if as_dict is not None else cell.model))
        model = apply_model(name, model).to_dict()
        cells.append({**as_dict, "model": model} if as_dict is not None else dataclasses.replace(cell, model=model))
    return {**spec, "train": train, "cells": cells}
