"""Recipe profiles: one name that switches a model config and a training recipe to another codebase's choices.

`depthbench` follows DepthBench's training code (keyu-wang-2002/DepthBench, its OLMo-core fork and
`examples/pretrain_400m.sh`) where depthtools has the option today:

  * norm eps 1e-6 (ours 1e-5), for every norm;
  * mHC: the Liger-style init the runs use (`mhc_init="uniform"`: φ ~ N(0, 0.02), biases 0, so H_res starts
    near uniform) and `sinkhorn_log`'s order, rows then columns each of 20 iterations (`sinkhorn_order=
    "cols_last"`: the columns are normalised last);
  * MoDA: depth scores with the RoPE-rotated query (`moda_depth_rope="query"`);
  * AdamW as `examples/pretrain_llama_base.py` builds it: weight decay 0.1 on every parameter but HC/mHC
    static routing (`decay_groups="depthbench"`, see depthtools.train.optim), betas (0.9, 0.95), eps 1e-8,
    gradient clipping at norm 1.0; OLMo-core's `CosWithWarmup(warmup=760, alpha_f=0.1,
    warmup_min_lr=0)` over 7,600 steps = linear warmup over 10% of the steps, then cosine to 0.1 x peak
    (`schedule="cosine"`, `warmup_fraction=0.1`, `final_lr_fraction=0.1`). These are scale-free, so the
    profile sets them whatever preset it is applied to. (OLMo-core evaluates the cosine at step s+1 of
    T-W, ours at s of T-W-1: the multipliers differ by < 1.5/(T-W) of the peak, e.g. 0.0013 at the
    afternoon preset's 1,221 steps.)
  * the run length as a number of optimizer steps when asked (`steps_to_tokens`).

The peak learning rate is NOT taken from DepthBench: its 2e-3 (1e-2 for LNS) is tuned for 400M-parameter
models at 512 x 2,048 tokens per step, and the best LR shifts with width and batch; a profile applied to
a preset keeps the preset's LR (e.g. 3e-3 for the ~0.4M-parameter afternoon grid, tuned at that scale).

Not reproduced yet (each needs an architecture or trainer option that does not exist; `NOT_REPRODUCED` lists
them and `apply` records them in the returned notes, so a run never claims more than it did):
HC's readout (each stream normed by the final norm, then summed), DeepNorm with LayerNorm, and bf16
weights/optimizer state (ours: fp32 weights under bf16 autocast on CUDA; on CPU float32 throughout).
Our defaults are unchanged: a profile only applies when named.
"""

from __future__ import annotations

from typing import Any

from depthtools.config import ModelConfig, TrainConfig
from depthtools.errors import DepthToolsError

DEPTHBENCH_OPTIONS: dict[str, dict[str, Any]] = {
    "mhc": {"mhc_init": "uniform", "sinkhorn_iters": 20, "sinkhorn_order": "cols_last"},
    "moda": {"moda_depth_rope": "query"},
}
NOT_REPRODUCED = (
    "HC/mHC readout: DepthBench norms each stream with the final norm, then sums; depthtools sums, then norms",
    "DeepNorm: DepthBench uses LayerNorm; depthtools uses RMSNorm",
    "weights: DepthBench trains bf16 weights and optimizer state where the device has bf16; depthtools keeps float32 "
    "weights (bf16 autocast on CUDA; on CPU everything stays float32)",
)
# The scale-free recipe of examples/pretrain_llama_base.py + pretrain_400m.sh (TrainConfig fields).
DEPTHBENCH_TRAIN: dict[str, Any] = {
    "weight_decay": 0.1, "decay_groups": "depthbench", "beta1": 0.9, "beta2": 0.95, "eps": 1e-8,
    "grad_clip": 1.0, "schedule": "cosine", "warmup_fraction": 0.1, "final_lr_fraction": 0.1,
}
PROFILES = ("depthtools", "depthbench")


def steps_to_tokens(steps: int, batch_size: int, seq_len: int) -> int:
    """DepthBench fixes a number of optimizer steps; depthtools' budget is tokens = steps · batch · seq_len."""
    if min(steps, batch_size, seq_len) < 1:
        raise DepthToolsError(f"steps, batch_size and seq_len must be >= 1, got {steps}, {batch_size}, {seq_len}")
    return steps * batch_size * seq_len


def apply(profile: str, model: ModelConfig, train: TrainConfig | None = None,
          steps: int | None = None) -> tuple[ModelConfig, TrainConfig | None, list[str]]:
    """(model config, train config, notes) under `profile`; "depthtools" returns them unchanged.

    The architecture's own options given explicitly in `model.options` win over the profile's."""
    if profile not in PROFILES:
        raise DepthToolsError(f"unknown profile {profile!r}; valid: {', '.join(PROFILES)}")
    if profile == "depthtools":
        return model, train, []
    options = {**DEPTHBENCH_OPTIONS.get(model.arch, {}), **model.options}
    model = model.replace(norm_eps=1e-6, options=options)
    if train is not None:
        changes: dict[str, Any] = dict(DEPTHBENCH_TRAIN)
        if steps is not None:
            changes.update(tokens=steps_to_tokens(steps, train.batch_size, train.seq_len), tokens_per_param=None)
        train = train.replace(**changes)
    return model, train, [f"not reproduced: {line}" for line in NOT_REPRODUCED]
