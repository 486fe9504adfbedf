"""The dtype weights and AdamW state are stored in (TrainConfig.param_dtype).

DepthBench trains bf16 weights and bf16 optimizer state: its launcher builds the DDP train module with
`param_dtype=DType.bfloat16` (`examples/pretrain_llama_base.py`), and OLMo-core's `Transformer.apply_ddp`
(`pretrain/OLMo-core/src/olmo_core/nn/transformer/model.py`) then casts the whole model with
`self.to(dtype=param_dtype)` before the weights are initialised. That cast keeps no module in float32:
norm gains, the AttnRes projections and norms (`attn_res_proj`/`attn_res_norm`, `mlp_res_proj`/
`mlp_res_norm`, the final `res_proj`/`res_norm`) and HC/mHC routing are all bf16. float32 appears only in
the computation: OLMo-core's LayerNorm/RMSNorm (`full_precision=True`) normalise an upcast copy of their
input and gain, the AttnRes Triton kernel (`olmo_core/kernels/attnres.py`) accumulates in float32 and
writes its output in the residuals' dtype, the loss is float32. torch's AdamW then creates exp_avg /
exp_avg_sq like the parameters (bf16), and no float32 master copy exists.

`cast_params` reproduces that cast here: every floating-point parameter (so every norm gain and every
AttnRes mixer query / key-norm gain too) becomes bf16; buffers (the RoPE tables) stay float32 (OLMo-core's
RoPE tables live in its BufferCache, outside the module cast, and its RoPE rotates in full precision). depthtools' norms compute through F.rms_norm /
F.layer_norm, which accumulate bf16 inputs in float32; the model's logits are bf16 and `forward_loss`
takes the cross-entropy of their float32 upcast, so losses and evaluations stay float32.

"auto" is the profile's choice: bf16 where the device does bf16 (CUDA with `torch.cuda.is_bf16_supported()`),
else float32; on CPU, bf16 weights are far slower than float32 and depthtools' C kernels (cpu_kernels)
take only float32/float64 (bf16 runs take the torch-op paths), so "auto" keeps float32 there, while an
explicit "bfloat16" trains bf16 on CPU too (torch's CPU matmuls do bf16), which is how it is tested.
"""

from __future__ import annotations

import torch
from torch import nn

from depthtools.config import TrainConfig

NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def bf16_weights_supported(device: torch.device) -> bool:
    """Whether `device` can train bf16 weights: CPU (torch's bf16 matmuls) or CUDA with bf16."""
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    return False


def resolve_param_dtype(train_cfg: TrainConfig, device: torch.device) -> tuple[torch.dtype, str | None]:
    """(the dtype the weights and AdamW state are stored in, the one line a run prints when it falls back
    from an explicit "bfloat16" to float32 because `device` has no bf16, else None)."""
    setting = train_cfg.param_dtype
    if setting == "float32":
        return torch.float32, None
    supported = bf16_weights_supported(device)
    if setting == "auto":
        return (torch.bfloat16 if device.type == "cuda" and supported else torch.float32), None
    if supported:
        return torch.bfloat16, None
    return torch.float32, (f"param_dtype='bfloat16': this {device.type} device has no bf16; this run trains float32 "
                           "weights and AdamW state instead")


def cast_params(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Store every floating-point parameter of `model` as `dtype`, in place (buffers keep theirs); tied
    parameters stay one tensor. Call before the optimizer is built, so its state is created like them."""
    if dtype == torch.float32:
        return model
    with torch.no_grad():
        for param in model.parameters():  # each Parameter once, tied ones included
            if param.is_floating_point() and param.dtype != dtype:
                param.data = param.data.to(dtype)
    return model


def param_dtype_name(model: nn.Module) -> str:
    """"bfloat16", "float32" or "mixed": the dtype the model's parameters are stored in."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if len(dtypes) == 1:
        dtype = dtypes.pop()
        return NAMES.get(dtype, str(dtype).replace("torch.", ""))
    return "mixed"
